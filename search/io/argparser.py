"""The one argparse constructor of every ``aceso`` parser: the planner's subcommands, the runtime's (imported
from here by the runtime package, never the reverse), the workers' own entry points and the bench scripts.

Why one class: prefix abbreviations are off everywhere (``allow_abbrev=False``), so ``--seq on`` is not silently
``--sequence-parallel on``, ``--glob 16`` not ``--global-batch-size 16`` and ``--tp 8`` not ``--tp-comm-overlap``;
subparsers (``add_subparsers``) are built by the same class, so they inherit it. A usage error is one line,
``PROG: error: MSG; see `PROG --help```, exit 2, with the closest choice or option named. Torch-free.
"""

from __future__ import annotations

import argparse
import difflib
import re


class AcesoParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations, with one-line errors (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("allow_abbrev"):
            raise ValueError("aceso parsers take no abbreviations (allow_abbrev=False)")
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(args) if args is not None else None      # for error(): what the user typed
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {self.explain(message)}; see `{self.prog} --help`\n")

    def explain(self, message: str) -> str:
        """argparse's message with the closest real choice or option named; a required option reported missing
        because the user abbreviated it (``--glob=16``) is reported as the abbreviation."""
        if message.startswith("the following arguments are required"):
            message = self._abbreviation(message) or message
        return suggest_option(self, suggest_choice(message))

    def _abbreviation(self, message: str) -> str | None:
        """"unrecognized arguments: --glob=16" when a given option is a prefix of a missing required one."""
        import sys

        given = getattr(self, "_given", None)
        given = sys.argv[1:] if given is None else given
        options = {s for a in self._actions for s in a.option_strings}
        for tok in given:
            flag = tok.split("=", 1)[0]
            if flag.startswith("--") and flag not in options and any(
                    o.startswith(flag) and o in message for o in options):
                return f"unrecognized arguments: {tok}"
        return None


def suggest_choice(message: str) -> str:
    """argparse's "invalid choice: 'serch' (choose from ...)" with the closest choice named."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not m:
        return message
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
    if close:
        return f"{message[:m.start()]}invalid choice: '{m.group(1)}'; did you mean {close[0]}?"
    return message


def suggest_option(parser: argparse.ArgumentParser, message: str) -> str:
    """"unrecognized arguments: --seq on" with the real options it could mean (prefix, then close spelling)."""
    m = re.match(r"unrecognized arguments: (\S+)", message)
    if not m or not m.group(1).startswith("--"):
        return message
    flag = m.group(1).split("=", 1)[0]
    options = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    close = [o for o in options if o.startswith(flag)]
    note = " (options are not abbreviated)" if close else ""
    close = close or difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
    if not close:
        return message
    return f"{message}; did you mean {' or '.join(close[:3])}{' ...' if len(close) > 3 else ''}?{note}"
