"""The ``aceso`` command: one module per subcommand, loaded lazily.

Each subcommand module has a docstring (its first line is the help), ``add_arguments(parser)`` and
``run(args) -> int``. Conventions: files are positional, ``-o -`` writes stdout, ``--json`` prints machine-readable
output; exit 0 ok, 2 bad input (one line on stderr naming the field and the fix), 1 internal error.
Set ``ACESO_DEBUG=1`` to see tracebacks of internal errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import AcesoError

# subcommand -> (module under search.cli, the issue that delivers it)
SUBCOMMANDS: dict[str, str] = {
    "models": "models",
    "clusters": "clusters",
    "validate": "validate",
    "import-hf": "import_hf",
    "explain": "explain",
    "search": "search_cmd",
    "baseline": "baseline",
    "export": "export",
    "import": "import_cmd",
    "profile": "profile",
    "train": "train",
    "launch": "launch",
    "data": "data",
    "plot": "plot",
}


def _load(module: str):
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{module}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aceso", description="Aceso auto-parallel planner for megatron-core.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        mod = _load(module)
        if mod is None:
            p = sub.add_parser(name, help="(not implemented yet)", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_run=lambda args, name=name: _not_yet(name))
            continue
        doc = (mod.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _not_yet(name: str) -> int:
    print(f"aceso {name}: not implemented yet in this version", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except AcesoError as e:
        print(f"aceso {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"aceso {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # internal error: one line unless debugging
        if os.environ.get("ACESO_DEBUG"):
            raise
        print(f"aceso {args.command}: internal error: {type(e).__name__}: {e} (ACESO_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
