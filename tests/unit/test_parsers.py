"""Every ``aceso`` parser refuses abbreviated options (issue 25): the planner's subcommands, the runtime's (through
the entry points), nested ones (``aceso data prepare``), the workers' own parsers and the bench scripts'. The walk
asks argparse itself how it resolves each option's prefix (stock argparse with abbreviations on resolves it to the
option: the reference the walk is checked against); the named cases from the issue run end to end."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from search.io.argparser import AcesoParser
from search.cli import PLANNER_SUBCOMMANDS, RUNTIME_SUBCOMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _walk(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _walk(p, f"{name} {sub}")


def _all_parsers():
    from aceso_megatron.training.args import train_parser
    from aceso_megatron.profiler.run import worker_parser

    yield from _walk(build_parser(), "aceso")
    yield "train worker", train_parser("python -m aceso_megatron.training.train")
    yield "profile worker", worker_parser()


def _resolves(parser: argparse.ArgumentParser, text: str) -> bool:
    """Whether argparse takes ``text`` as one of the parser's options (exact or abbreviated)."""
    found = parser._parse_optional(text)
    found = found[0] if isinstance(found, list) else found     # 3.12 returns a list of candidates
    return bool(found) and found[0] is not None


def _prefixes(parser: argparse.ArgumentParser):
    options = {s for a in parser._actions for s in a.option_strings}
    for opt in sorted(o for o in options if o.startswith("--") and len(o) > 4):
        prefix = opt[:-1]
        if prefix not in options:
            yield opt, prefix


def test_every_parser_is_built_by_the_one_constructor_and_refuses_prefixes():
    parsers = dict(_all_parsers())
    names = set(parsers)
    for sub in [*PLANNER_SUBCOMMANDS, *RUNTIME_SUBCOMMANDS, "data prepare"]:
        assert f"aceso {sub}" in names, f"aceso {sub} was not walked"
    checked = 0
    for name, parser in parsers.items():
        assert isinstance(parser, AcesoParser) and parser.allow_abbrev is False, name
        for opt, prefix in _prefixes(parser):
            assert _resolves(parser, opt), (name, opt)
            assert not _resolves(parser, prefix), f"{name}: {prefix} is taken as {opt}"
            checked += 1
    assert checked > 100


def test_the_reference_argparse_would_have_taken_the_prefixes():
    """The walk's check can fail: the same options in a stock parser resolve their prefixes."""
    stock = argparse.ArgumentParser()
    sub = build_parser("search")._subparsers._group_actions[0].choices["search"]
    for action in sub._actions:
        if action.option_strings and "-h" not in action.option_strings:
            stock.add_argument(*action.option_strings, dest=action.dest)
    assert _resolves(stock, "--sequence-paralle") and _resolves(stock, "--global-batch-siz")


def test_no_parser_outside_the_one_constructor():
    """Every parser in the project (bench scripts included) is an ``AcesoParser``."""
    stray = []
    for path in [*ROOT.glob("search/**/*.py"), *ROOT.glob("aceso_megatron/**/*.py"), *ROOT.glob("bench/**/*.py"),
                 *ROOT.glob("launch/**/*.py"), *ROOT.glob("patches/**/*.py")]:
        if path.name != "argparser.py" and re.search(r"argparse\.ArgumentParser\(", path.read_text()):
            stray.append(str(path.relative_to(ROOT)))
    assert not stray


SEARCH = ["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "16", "-o", "-"]


@pytest.mark.parametrize("argv,named", [
    (SEARCH + ["--seq", "on"], "--sequence-parallel"),
    (SEARCH + ["--tp-comm", "on"], "--tp-comm-overlap"),        # (--tp itself is a flag: the tp candidates)
    (SEARCH[:5] + ["--glob", "16", "-o", "-"], "--global-batch-size"),
    (["explain", "plan.json", "--cost", "analytic"], "--cost-model"),
    (["launch", "plan.json", "--dry", "--", "--mock-data", "--train-iters", "1"], "--dry-run"),
    (["launch", "plan.json", "--dry-run", "--", "--mock-data", "--train-it", "1"], "--train-iters"),
])
def test_abbreviations_fail_with_one_line_naming_the_option(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model

    (tmp_path / "plan.json").write_text(uniform_plan(load_model("gpt-1.3b"), 1, 1, 1, 1, 8).to_json())
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, err
    assert named in err and "Traceback" not in err
