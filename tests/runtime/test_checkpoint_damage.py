"""``--load`` of a checkpoint with a damaged file: one line naming the file and ``--load``, exit 2, no traceback (it
was an ``UnpicklingError`` / ``EOFError`` / ``OSError`` traceback from every rank). A real checkpoint of ``aceso train``
(one CPU process, a tiny GPT) is damaged one file at a time: the ``.pt`` files, ``metadata.json`` and a missing
folder are refused by the torch-free check before any process group (``aceso launch`` runs it before starting
torchrun); torch DCP's ``.metadata`` and ``.distcp`` files are traced to the file once the load failed. An intact
copy still resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aceso_megatron.testing import run_fresh
from aceso_megatron.training.checkpoint_files import damaged_file, damaged_index, damaged_item
from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from tests.tiny_models import GPT

TRAIN = ["--cpu", "--mock-data", "--log-interval", "1", "--seed", "3", "--lr-decay-iters", "8"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(plan, a checkpoint folder at iteration 2)."""
    d = tmp_path_factory.mktemp("ckpt")
    plan = d / "plan.json"
    plan.write_text(uniform_plan(GPT, 1, 1, 1, 2, 4, cluster=parse_cluster("1x1-cpu")).to_json())
    run_fresh(main, ["train", str(plan), *TRAIN, "--train-iters", "2", "--save", str(d / "ckpt")])
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return plan, d / "ckpt"


def _garbage(p: Path) -> None:
    p.write_bytes(b"\x80\x04garbage, not what was saved" * 3)


def _cut(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _header(p: Path) -> None:          # the first item's zip header overwritten, the size unchanged
    data = bytearray(p.read_bytes())
    data[:64] = b"\0" * 64
    p.write_bytes(bytes(data))


CASES = {   # id -> (file in iter_0000002, damage, text the line names, found before any process starts)
    "extra-garbage": ("extra_rank_00000.pt", _garbage, "extra_rank_00000.pt is not a torch.save archive", True),
    "common-cut": ("common.pt", _cut, "common.pt is not a torch.save archive", True),
    "common-missing": ("common.pt", Path.unlink, "common.pt is missing (and .metadata records no common_state", False),
    "metadata-json": ("metadata.json", _garbage, "metadata.json is not JSON", True),
    "dcp-metadata-missing": (".metadata", Path.unlink, ".metadata is missing", True),
    "folder-missing": ("", shutil.rmtree, "names iteration 2 but", True),
    "dcp-metadata-garbage": (".metadata", _garbage, ".metadata cannot be read", False),
    "distcp-cut": ("__0_0.distcp", _cut, "__0_0.distcp is cut short", False),
    "distcp-header": ("__0_0.distcp", _header, "__0_0.distcp has a damaged item at byte 0 (it ", False),
}


def _one_line(err: str, needle: str, d: Path) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and f"--load {d}" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_checkpoint_file_is_one_line_naming_it(case, saved, tmp_path, capfd):
    plan, ckpt = saved
    name, damage, needle, early = CASES[case]
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    if name and not (d / "iter_0000002" / name).exists():      # megatron-core 0.19: the common state in .metadata
        pytest.skip(f"this megatron-core writes no {name}")
    damage(d / "iter_0000002" / name if name else d / "iter_0000002")
    capfd.readouterr()
    argv = ["--mock-data", "--train-iters", "4", "--lr-decay-iters", "8", "--load", str(d)]
    # aceso launch checks before starting torchrun: the torch-free files are refused there, the others pass
    assert main(["launch", str(plan), "--cpu", "--dry-run", "--", *argv]) == (2 if early else 0)
    out = capfd.readouterr()
    if early:
        return _one_line(out.err, needle, d)
    with pytest.raises(RuntimeError, match="exit status 2"):      # the worker, once the load failed
        run_fresh(main, ["train", str(plan), *TRAIN, "--train-iters", "4", "--load", str(d)])
    _one_line(capfd.readouterr().err, needle, d)


def test_intact_checkpoints_pass_both_checks_and_resume(saved, tmp_path):
    plan, ckpt = saved
    folder = ckpt / "iter_0000002"
    assert damaged_file(folder) is None and damaged_index(folder) is None and damaged_item(folder) is None
    run_fresh(main, ["train", str(plan), *TRAIN, "--train-iters", "3", "--load", str(ckpt), "--save",
                     str(tmp_path / "next")])
    assert (tmp_path / "next" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
