"""The ``aceso`` command: one module per subcommand, loaded lazily.

Each subcommand module has a docstring (its first line is the help), ``add_arguments(parser)`` and
``run(args) -> int``. Conventions: files are positional, ``-o -`` writes stdout, ``--json`` prints machine-readable
output; exit 0 ok, 2 bad input (one line on stderr naming the field and the fix), 1 internal error.
Set ``ACESO_DEBUG=1`` to see tracebacks of internal errors.

Where subcommands come from: the planner's are modules of this package (``PLANNER_SUBCOMMANDS``); any installed
package adds more through the ``aceso.subcommands`` entry-point group (``name = package.module``, a module with
the same contract). The runtime registers ``profile``, ``train``, ``launch`` and ``data`` that way (setup.py), so
the torch-free planner never names or imports it; a subcommand's module is imported only when that subcommand
(or the full ``aceso --help``) is asked for. Entry points are read from the installed metadata only, with no
fallback list here (it would have to name the runtime): they register when the package is installed, and again
after a change to setup.py (``pip install -e .``). Until then, and in a planner-only install, the runtime's
subcommands say in one line how to install the runtime and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import AcesoError

ENTRY_POINT_GROUP = "aceso.subcommands"
RUNTIME_INSTALL = 'pip install -e ".[runtime]"'
RUNTIME_PACKAGES = ("torch", "megatron")   # a runtime subcommand that misses these: install hint, exit 2

# subcommand -> module under search.cli
PLANNER_SUBCOMMANDS: dict[str, str] = {
    "models": "models",
    "clusters": "clusters",
    "validate": "validate",
    "import-hf": "import_hf",
    "explain": "explain",
    "search": "search_cmd",
    "baseline": "baseline",
    "export": "export",
    "import": "import_cmd",
}
# registered by the runtime through ENTRY_POINT_GROUP; named here only to list them (and say how to get them)
RUNTIME_SUBCOMMANDS = ("profile", "train", "launch", "data")


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in PLANNER_SUBCOMMANDS}


def _load(name: str, eps: dict):
    """The subcommand's module; None when it is not installed (not registered, or its package is gone)."""
    if name in PLANNER_SUBCOMMANDS:
        return importlib.import_module(f"{__name__}.{PLANNER_SUBCOMMANDS[name]}")
    ep = eps.get(name)
    if ep is None:
        return None
    try:
        return ep.load()
    except ModuleNotFoundError as e:
        if e.name and (ep.module == e.name or ep.module.startswith(e.name + ".")):
            return None
        raise


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``command``, only that subcommand's module is imported (the others are bare names)."""
    parser = argparse.ArgumentParser(prog="aceso", description="Aceso auto-parallel planner for megatron-core.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    eps = _entry_points()
    names = [*PLANNER_SUBCOMMANDS, *RUNTIME_SUBCOMMANDS, *sorted(set(eps) - set(RUNTIME_SUBCOMMANDS))]
    for name in names:
        if command is not None and name != command:
            sub.add_parser(name, add_help=False)
            continue
        mod = _load(name, eps)
        if mod is None:
            p = sub.add_parser(name, help=f"(needs the runtime: {RUNTIME_INSTALL})", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_run=lambda args, name=name: _not_installed(name))
            continue
        doc = (mod.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _not_installed(name: str) -> int:
    print(f"aceso {name}: not installed; it comes with the runtime: {RUNTIME_INSTALL} (in a checkout, rerun it "
          "after setup.py changes so the subcommand registers)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
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
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in RUNTIME_PACKAGES:
            print(f"aceso {args.command}: needs the runtime ({e.name} is not installed): {RUNTIME_INSTALL}",
                  file=sys.stderr)
            return 2
        if os.environ.get("ACESO_DEBUG"):
            raise
        print(f"aceso {args.command}: internal error: {type(e).__name__}: {e} (ACESO_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
