"""The ``aceso`` command: one module per subcommand, loaded lazily.

Each subcommand module has a docstring (its first paragraph is the help), ``add_arguments(parser)`` and
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

Errors: a usage error is one line naming the option and pointing to ``aceso COMMAND --help`` (``AcesoParser``), a
bad input one line (``AcesoError``), both exit 2; so is a pydantic ``ValidationError`` that reaches here (a schema
refused a value on its way in): one line naming the field (``errors.format_validation_error``), never the library's
own text. A module may set ``PASSTHROUGH = "name"``: everything after the
first ``--`` then goes untouched to ``args.name`` (``aceso launch PLAN -- TRAIN_ARGS``), whatever the order of
the options before it. SIGTERM is handled like Ctrl-C (``KeyboardInterrupt``: the search writes its best plan so
far), with exit status 143 instead of 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

import pydantic

from .. import __version__
from search.io.argparser import AcesoParser  # noqa: F401  (the one constructor; see search/io/argparser.py)
from search.spec.cluster import load_gpu_file
from search.io.errors import AcesoError, format_validation_error
from search.targets.preflight import RUNTIME_PACKAGES  # a runtime subcommand that misses these: install hint, exit 2

ENTRY_POINT_GROUP = "aceso.subcommands"
RUNTIME_INSTALL = 'pip install -e ".[runtime]"'

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
    "plot": "plot",
    "calibrate": "calibrate",
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
    parser = AcesoParser(prog="aceso", description="Aceso auto-parallel planner for megatron-core.")
    parser.add_argument("--version", action="version", version=f"aceso {__version__}")
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
        p = sub.add_parser(name, help=summary(doc) if doc else None, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _passthrough=getattr(mod, "PASSTHROUGH", None))
    return parser


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: ``aceso --help``'s summary, never cut mid-sentence."""
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())


def _not_installed(name: str) -> int:
    print(f"aceso {name}: not installed; it comes with the runtime: {RUNTIME_INSTALL} (in a checkout, rerun it "
          "after setup.py changes so the subcommand registers)", file=sys.stderr)
    return 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every subcommand stops the same way."""


def _on_sigterm(signum, frame) -> None:
    _terminated[0] = True
    raise Terminated()


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.get(name) if name else None


def _split_passthrough(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``argv`` before the first ``--`` and after it, for a subcommand with ``PASSTHROUGH`` (else ``argv, None``)."""
    if not argv or argv[0].startswith("-"):
        return argv, None
    p = _subparser(parser, argv[0])
    if p is None or not p.get_default("_passthrough"):
        return argv, None
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _parse(argv: list[str]) -> argparse.Namespace | int:
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    head, rest = _split_passthrough(parser, argv)
    try:
        args, extra = parser.parse_known_args(head)
        if extra:
            sub = _subparser(parser, args.command)
            hint = " (arguments for the command it starts go after a literal --)" if rest == [] else ""
            (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    except SystemExit as e:   # --help, --version (0) or a usage error already printed (2)
        return e.code if isinstance(e.code, int) else 2
    if rest is not None:
        setattr(args, args._passthrough, rest)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if isinstance(args, int):
        return args
    _terminated[0] = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        for f in getattr(args, "gpu_file", None) or ():   # before any --cluster or plan names the GPU
            load_gpu_file(f)
        rc = int(args._run(args) or 0)
        return 143 if rc == 130 and _terminated[0] else rc
    except AcesoError as e:
        print(f"aceso {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except pydantic.ValidationError as e:   # a schema refused a value: one line naming the field, never pydantic's text
        print(f"aceso {args.command}: error: {format_validation_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"aceso {args.command}: {'terminated' if isinstance(e, Terminated) else 'interrupted'}",
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:
        _quiet_stdout()
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
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


_terminated = [False]


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _quiet_stdout() -> None:
    """After a closed pipe (``aceso models | head -1``): no second BrokenPipeError when Python flushes at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
