"""Stop cleanly on SIGTERM or SIGINT (as Megatron-LM's ``--exit-signal-handler``): finish the step, save, exit.

A scheduler's pre-emption (SLURM sends SIGTERM before killing a job) or a Ctrl-C should not lose the steps since
the last ``--save-interval``. ``ExitSignal`` replaces the handlers of both signals with one that only records the
signal; after every step the training loop asks ``agreed()``, an all-reduce (max) of the recorded signal over the
world, so every rank stops after the same step even when the signal reached them at different times (torchrun
forwards it to its workers one by one). The loop then saves a checkpoint (when ``--save`` is given), prints how to
resume and exits with the shell's code for the signal, 128 + its number: 143 for SIGTERM, 130 for SIGINT.

A second signal of the same kind while the first is being handled is recorded again (no effect): the save must not
be cut half-way. A checkpoint is written under a temporary name and renamed only when complete
(``checkpoint.save``), so even a SIGKILL leaves no half-written ``iter_N`` folder (the next save discards it).

``held()`` makes the save itself uninterruptible whatever handler is installed: inside it both signals are only
recorded; on leaving it a recorded signal goes to the handler that was there before -- ``ExitSignal`` records it
(the loop stops after the save, 143), the default handler ends the process with it (``--no-exit-signal-handler``:
the checkpoint is complete, then the shell's 143), SIG_IGN drops it. The loop asks ``agreed()`` once more after
the final save, so a signal that came during it still ends the run with 143.

``ACESO_TEST_SIGNAL_IN_SAVE=PATH`` (tests only): inside ``held()`` of a save, rank 0 creates PATH and every rank
waits (at most a minute) until a signal has reached it, so a test can send SIGTERM at exactly that moment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitSignal:
    """Records SIGTERM/SIGINT while installed (a context manager); ``agreed()`` says which one stops the run."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.received = 0
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signum

    def __enter__(self) -> ExitSignal:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agreed(self) -> int:
        """The signal number that stops the run (0: go on), the same on every rank (collective)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


_held: list[int] = []     # signals recorded inside held(), in order


def _hold(signum: int, frame) -> None:
    _held.append(signum)


@contextlib.contextmanager
def held():
    """Record SIGTERM/SIGINT until the block ends, then hand them to the handlers that were installed before (in the
    main thread; elsewhere the block runs as is)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held.clear()
    previous = {s: signal.signal(s, _hold) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        came, _held[:] = list(dict.fromkeys(_held)), []
        for s in came:
            handler = previous[s]
            if callable(handler):
                handler(s, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), s)      # the default action, now that the block is done


def pause_for_test_signal(rank: int) -> None:
    """``ACESO_TEST_SIGNAL_IN_SAVE`` (module docstring): tell the test we are inside the save, wait for its signal."""
    path = os.environ.get("ACESO_TEST_SIGNAL_IN_SAVE")
    if not path:
        return
    if rank == 0:
        with open(path, "w") as f:
            f.write("saving\n")
    deadline = time.monotonic() + 60
    while not _held and time.monotonic() < deadline:
        time.sleep(0.01)


def exit_code(signum: int) -> int:
    """The shell's exit status for a process stopped by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name
