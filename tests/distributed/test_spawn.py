"""``testing.spawn`` and ``testing.run_fresh`` fork from a forkserver started earlier in the session, yet give each
process what the "spawn" start method gave it: the caller's environment and standard streams as they are at the
call (so pytest captures a rank's output under the test that started it), a test after another seeing its own."""

from __future__ import annotations

import os
import sys

from aceso_megatron.testing import run_fresh, spawn


def _say(rank: int, world_size: int, tag: str) -> None:
    print(f"rank {rank}/{world_size} says {tag} with ACESO_SPAWN_TAG={os.environ.get('ACESO_SPAWN_TAG')}", flush=True)
    print(f"rank {rank} writes {tag} to stderr", file=sys.stderr, flush=True)


def _fresh(tag: str) -> int:
    print(f"fresh process says {tag} with ACESO_SPAWN_TAG={os.environ.get('ACESO_SPAWN_TAG')} in {os.getcwd()}",
          flush=True)
    return 0


def test_ranks_get_the_callers_environment_and_streams(capfd, monkeypatch):
    monkeypatch.setenv("ACESO_SPAWN_TAG", "first")
    spawn(2, _say, "hello")
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"rank {r}/2 says hello with ACESO_SPAWN_TAG=first" in out, out
        assert f"rank {r} writes hello to stderr" in err, err


def test_a_later_call_gets_the_environment_of_then(capfd, monkeypatch, tmp_path):
    monkeypatch.setenv("ACESO_SPAWN_TAG", "second")
    spawn(1, _say, "again")
    run_fresh(_fresh, "bye", cwd=tmp_path)
    out, _ = capfd.readouterr()
    assert "rank 0/1 says again with ACESO_SPAWN_TAG=second" in out, out
    assert f"fresh process says bye with ACESO_SPAWN_TAG=second in {tmp_path}" in out, out
