"""`aceso train --config FILE`: YAML train flags, converted by the flags' own argparse types; the command line
wins in either order; unknown keys and wrong values are one line naming the key (and the closest valid one)."""

from __future__ import annotations

import pytest

from aceso_megatron.training.args import check_train_args, parse_train_args
from search.io.errors import AcesoError


def _cfg(tmp_path, text: str) -> str:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return str(path)


def test_config_values_go_through_the_flags_types(tmp_path):
    cfg = _cfg(tmp_path, "train-iters: 40\nlr: 3e-3\nlr_decay_style: linear\nmock-data: true\n"
                         "exit-signal-handler: false\nsplit: 90,10,0\n")
    args = parse_train_args("plan.json", ["--config", cfg])
    assert (args.train_iters, args.lr, args.lr_decay_style, args.mock_data, args.exit_signal_handler,
            args.split) == (40, 3e-3, "linear", True, False, "90,10,0")
    check_train_args(args)   # --train-iters from the file satisfies the requirement
    args = parse_train_args("plan.json", ["--config", _cfg(tmp_path, "data-path: [0.7, a, 0.3, b]\n")])
    assert args.data_path == ["0.7", "a", "0.3", "b"]


def test_command_line_wins_before_and_after_config(tmp_path):
    cfg = _cfg(tmp_path, "train-iters: 40\nlr: 3e-3\nseed: 9\n")
    args = parse_train_args("plan.json", ["--lr", "1e-2", "--config", cfg, "--seed", "5"])
    assert (args.lr, args.seed, args.train_iters) == (1e-2, 5, 40)


@pytest.mark.parametrize("text, message", [
    ("trian-iters: 5\n", "unknown key 'trian-iters'; did you mean 'train-iters'?"),
    ("lr: fast\n", "lr: "),
    ("lr-decay-style: cubic\n", "lr-decay-style: 'cubic' is not one of constant, linear, cosine"),
    ("mock-data: 1\n", "mock-data: give true or false, not 1"),
    ("train-iters: [1, 2]\n", "train-iters: give one value"),
    ("- train-iters\n", "must be a mapping of flag: value"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(AcesoError) as e:
        parse_train_args("plan.json", ["--config", _cfg(tmp_path, text), "--mock-data"])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_iters_still_required(tmp_path):
    args = parse_train_args("plan.json", ["--mock-data", "--config", _cfg(tmp_path, "lr: 1e-3\n")])
    with pytest.raises(AcesoError, match="required: --train-iters"):
        check_train_args(args)
