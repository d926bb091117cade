"""Training operations in one process: the resume policy of the learning-rate schedule (Megatron-LM's two flags,
against the warm-up/cosine formula by hand), checkpoint rotation, and the signal recorder."""

from __future__ import annotations

import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from aceso_megatron.training import checkpoint, schedule, signals

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2


def _args(train_iters: int, **flags) -> SimpleNamespace:
    return SimpleNamespace(lr=LR, min_lr=MIN_LR, lr_warmup_iters=WARMUP, lr_decay_iters=None, train_iters=train_iters,
                           lr_decay_style="cosine", weight_decay=0.01, **flags)


def _scheduler(train_iters: int, **flags):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    return schedule.build_scheduler(_args(train_iters, **flags), opt)


def _cosine(step: int, decay: int) -> float:
    """megatron-core's cosine decay after a linear warm-up, by hand."""
    ratio = (step - WARMUP) / (decay - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _saved_after(steps: int, train_iters: int) -> dict:
    s = _scheduler(train_iters)
    s.step(steps)
    return s.state_dict()


def test_a_longer_train_iters_on_resume_is_refused_without_a_flag():
    saved = _saved_after(6, 10)
    msg = schedule.mismatch(saved, _scheduler(20))
    assert msg == ("was saved with lr_decay_steps 10 in its learning-rate schedule but the command line gives 20 "
                   "(--lr-decay-iters (default --train-iters)); add --use-checkpoint-opt_param-scheduler to keep the "
                   "checkpoint's schedule, or --override-opt_param-scheduler to continue on the command line's")
    assert schedule.mismatch(saved, _scheduler(10)) is None   # the same command line continues


def test_use_checkpoint_keeps_the_schedule_and_override_takes_the_command_lines():
    saved = _saved_after(6, 10)
    kept = _scheduler(20, use_checkpoint_opt_param_scheduler=True)
    assert schedule.mismatch(saved, kept) is None
    schedule.load_state(kept, saved)
    assert kept.optimizer.param_groups[0]["lr"] == pytest.approx(_cosine(6, 10), rel=1e-12)
    kept.step(1)
    assert kept.get_lr(kept.optimizer.param_groups[0]) == pytest.approx(_cosine(7, 10), rel=1e-12)
    new = _scheduler(20, override_opt_param_scheduler=True)
    schedule.load_state(new, saved)
    assert new.num_steps == 6
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(_cosine(6, 20), rel=1e-12)
    # the checkpoint's other peak rate, with --use-checkpoint: the groups follow it, not --lr
    other = _scheduler(10)
    other.max_lr = 5e-3
    for g in other.optimizer.param_groups:
        g["max_lr"] = 5e-3
    other.step(1)
    kept = _scheduler(10, use_checkpoint_opt_param_scheduler=True)
    schedule.load_state(kept, other.state_dict())
    assert kept.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 1 / WARMUP, rel=1e-12)


def test_rotate_keeps_the_newest_and_the_protected(tmp_path):
    for it in (1, 2, 3, 4, 5):
        (tmp_path / f"iter_{it:07d}").mkdir()
    (tmp_path / ".tmp_iter_0000006").mkdir()
    (tmp_path / checkpoint.MARKER).write_text("5\n")
    gone = checkpoint.rotate(str(tmp_path), 2, protect=1)
    assert sorted(p.name for p in gone) == ["iter_0000002", "iter_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_iter_0000006", "iter_0000001", "iter_0000004",
                                                          "iter_0000005", checkpoint.MARKER]


def test_exit_signal_records_sigint_instead_of_raising():
    before = signal.getsignal(signal.SIGINT)
    with signals.ExitSignal() as s:
        os.kill(os.getpid(), signal.SIGINT)   # without the recorder: KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal does not replace the first
        assert s.agreed() == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before
    assert signals.exit_code(signal.SIGINT) == 130 and signals.exit_code(signal.SIGTERM) == 143


def test_held_signals_reach_the_previous_handler_only_after_the_block():
    """``signals.held`` (around every checkpoint save): a SIGTERM inside the block changes nothing until it ends,
    then goes to the handler installed before (the recorder; a plain handler; SIG_IGN drops it)."""
    with signals.ExitSignal() as s:
        with signals.held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert s.received == 0              # the save is not cut: nothing acted yet
        assert s.received == signal.SIGTERM     # ... and the loop sees it after the save
    got = []
    before = signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    try:
        with signals.held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]          # once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with signals.held():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_cpu_mode_reads_a_shard_views_grad_without_torchs_warning():
    """megatron-core's distributed optimizer sets and reads ``.grad`` on views of its parameters (non-leaf)."""
    import warnings

    from patches import cpu_mode

    was = cpu_mode.is_applied()
    cpu_mode.apply()
    try:
        p = torch.nn.Parameter(torch.ones(4))
        shard = p.view(-1)[1:3]
        shard.grad = torch.full((2,), 2.0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert torch.equal(shard.grad, torch.full((2,), 2.0))   # the value torch stores, still returned
        assert not seen, [str(w.message) for w in seen]
    finally:
        if not was:
            cpu_mode.revert()


def test_known_third_party_future_warnings_are_filtered_by_aceso_train():
    import warnings

    import torch.distributed as dist

    from aceso_megatron.parallel.distenv import free_port

    own = not dist.is_initialized()      # another runtime test's one-process world may be up already
    if own:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from aceso_megatron.training.train import quiet_third_party_warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_third_party_warnings()   # what aceso train does first
            for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):   # torch's own messages
                getattr(dist, name)(torch.zeros(2), torch.ones(2))
        assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    finally:
        if own:
            dist.destroy_process_group()
