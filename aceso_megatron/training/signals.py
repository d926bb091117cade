"""Stop cleanly on SIGTERM or SIGINT (as Megatron-LM's ``--exit-signal-handler``): finish the step, save, exit.

A scheduler's pre-emption (SLURM sends SIGTERM before killing a job) or a Ctrl-C should not lose the steps since
the last ``--save-interval``. ``ExitSignal`` replaces the handlers of both signals with one that only records the
signal; after every step the training loop asks ``agreed()``, an all-reduce (max) of the recorded signal over the
world, so every rank stops after the same step even when the signal reached them at different times (torchrun
forwards it to its workers one by one). The loop then saves a checkpoint (when ``--save`` is given), prints how to
resume and exits with the shell's code for the signal, 128 + its number: 143 for SIGTERM, 130 for SIGINT.

A second signal of the same kind while the first is being handled is recorded again (no effect): the save must not
be cut half-way. A checkpoint is written under a temporary name and renamed only when complete
(``checkpoint.save``), so even a SIGKILL leaves no half-written ``iter_N`` folder.
"""

from __future__ import annotations

import signal

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


def exit_code(signum: int) -> int:
    """The shell's exit status for a process stopped by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name
