"""``aceso train --config FILE``: the train flags from a YAML file (as torchtitan's TOML and Megatron-Bridge's YAML
overrides), so a run's settings can live beside its plan.

The file is a mapping of flag names, written as on the command line without the dashes (``train-iters: 100``;
``train_iters`` works too) to values: a number or a string for a valued flag, a list for a multi-valued one
(``data-path: [0.7, data/a, 0.3, data/b]``), ``true``/``false`` for a switch. Every value goes through the flag's
own argparse type and choices, so a file accepts exactly what the command line does. Command-line flags win: a
value from the file is taken only for a flag still at its default when ``--config`` is read, and flags after
``--config`` overwrite it as argparse always does. An unknown key is an error naming the key and the closest
valid one; so is a value of the wrong kind, naming the key.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

NOT_IN_FILE = {"plan", "config", "help"}


class ConfigAction(argparse.Action):
    """``--config FILE``: set every flag of FILE that the command line has not set (see the module docstring)."""

    def __call__(self, parser, namespace, path, option_string=None):
        for dest, value in read_config(path, parser, self).items():
            if getattr(namespace, dest, None) == parser.get_default(dest):
                setattr(namespace, dest, value)
        setattr(namespace, self.dest, path)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out = {}
    for action in parser._actions:
        if action.dest in NOT_IN_FILE or not action.option_strings:
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-"):
                out[opt[2:]] = action
    return out


def read_config(path: str, parser: argparse.ArgumentParser, me: argparse.Action) -> dict:
    """``{dest: value}`` of the file, each value converted as the command line would convert it."""
    import yaml

    def fail(msg: str):
        raise argparse.ArgumentError(me, f"{path}: {msg}")

    p = Path(path)
    if not p.is_file():
        fail("no such file; give a YAML file of train flags")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        fail(f"not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        fail("must be a mapping of flag: value (e.g. train-iters: 100)")
    flags = _flags(parser)
    out = {}
    for key, value in data.items():
        name = str(key)
        action = flags.get(name) or flags.get(name.replace("_", "-"))
        if action is None:
            close = difflib.get_close_matches(name.replace("_", "-"), list(flags), n=1)
            fail(f"unknown key {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        out[action.dest] = _convert(name, value, action, fail)
    return out


def _convert(key: str, value, action: argparse.Action, fail):
    if action.nargs == 0:   # a switch (store_true, or --x/--no-x)
        if not isinstance(value, bool):
            fail(f"{key}: give true or false, not {value!r}")
        return value if not isinstance(action, argparse._StoreFalseAction) else not value
    many = action.nargs in ("+", "*")
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, (list, dict)) or many and not items or isinstance(value, dict):
        fail(f"{key}: give {'a list of values' if many else 'one value'}, not {value!r}")
    converted = []
    for item in items:
        text = str(item).lower() if isinstance(item, bool) else str(item)
        try:
            v = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            fail(f"{key}: {e}")
        if action.choices is not None and v not in action.choices:
            fail(f"{key}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        converted.append(v)
    return converted if many else converted[0]
