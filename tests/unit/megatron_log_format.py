"""Megatron-LM core_v0.16.1's own log lines, for tests and the calibrate benchmark: the format strings copied from
its logging code paths so that the logs aceso calibrate reads are the ones Megatron-LM writes.

- ``iteration_line``: megatron/training/training.py ``training_log`` (core_v0.16.1, lines 2033-2088): the
  ``log_string`` built field by field (timestamp, iteration, consumed samples, elapsed time per iteration (ms),
  throughput per GPU (TFLOP/s/GPU) with ``--log-throughput``, learning rate, global batch size, each loss above 0,
  loss scale, grad norm, number of skipped / nan iterations), printed by ``print_rank_last``;
  the throughput is ``num_floating_point_operations(args, batch_size) / (elapsed_time_per_iteration * 10**12 *
  args.world_size)`` (line 2018).
- ``memory_line``: megatron/training/utils.py ``report_memory`` (lines 279-291), ``name`` =
  ``f'(after {iteration} iterations)'`` (training.py line 2095), printed as ``"[Rank {}] {}"``.
- ``arguments_block``: megatron/training/arguments.py ``_print_args`` (lines 1288-1299).

``megatron_log`` puts them together the way a run prints them: the arguments, the first iteration (warm-up, slower),
one line every ``log_interval``, the memory report of every tensor x pipeline rank after the first and second
logged iterations (``report_memory_flag`` stays on until the iteration after the first, lines 2090-2100).
"""

from __future__ import annotations

from datetime import datetime, timedelta


def iteration_line(iteration: int, train_iters: int, consumed: int, elapsed_ms: float, throughput: float | None,
                   lr: float, batch_size: int, losses: dict[str, float], loss_scale: float = 1.0,
                   grad_norm: float | None = 1.0, skipped: int = 0, nan: int = 0,
                   when: datetime | None = None) -> str:
    when = when or datetime(2026, 1, 2, 3, 4, 5)
    log_string = f" [{when.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_ms)
    if throughput is not None:
        log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
    log_string += f' learning rate: {lr:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    for key, avg in losses.items():
        if avg > 0.0:
            log_string += ' {}: {:.6E} |'.format(key, avg)
    log_string += f' loss scale: {loss_scale:.1f} |'
    if grad_norm is not None:
        log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(nan)
    return log_string


def memory_line(rank: int, iteration: int, allocated: float, max_allocated: float, reserved: float,
                max_reserved: float) -> str:
    """The four torch.cuda counters in bytes, as ``report_memory`` reads them."""
    mega_bytes = 1024.0 * 1024.0
    name = f'(after {iteration} iterations)'
    string = name + ' memory (MB)'
    string += f" | allocated: {allocated / mega_bytes:.2f}"
    string += f" | max allocated: {max_allocated / mega_bytes:.2f}"
    string += f" | reserved: {reserved / mega_bytes:.2f}"
    string += f" | max reserved: {max_reserved / mega_bytes:.2f}"
    return "[Rank {}] {}".format(rank, string)


def arguments_block(args: dict, title: str = "arguments") -> list[str]:
    out = [f'------------------------ {title} ------------------------']
    str_list = []
    for arg, value in args.items():
        dots = '.' * (48 - len(arg))
        str_list.append('  {} {} {}'.format(arg, dots, value))
    out += sorted(str_list, key=lambda x: x.lower())
    out.append(f'-------------------- end of {title} ---------------------')
    return out


def megatron_log(iteration_ms: float, flops_per_iteration: float, world_size: int, global_batch_size: int,
                 args: dict | None = None, train_iters: int = 50, log_interval: int = 10,
                 max_reserved_mb: dict[int, float] | None = None, warmup_factor: float = 3.0) -> str:
    """A complete stdout of a run whose steady iterations take ``iteration_ms`` (``max_reserved_mb``: the peak of
    the data-parallel rank 0 of each tensor x pipeline rank, by global rank)."""
    lines = [*arguments_block(args or {}), "> building train, validation, and test datasets ...",
             "[after dataloaders are built] datetime: 2026-01-02 03:04:00 ", "training ..."]
    t0 = datetime(2026, 1, 2, 3, 4, 5)
    report = True
    for it in [1, *range(log_interval, train_iters + 1, log_interval)]:
        ms = iteration_ms * (warmup_factor if it == 1 else 1.0)
        tput = flops_per_iteration / (ms / 1000.0 * 10**12 * world_size)
        lines.append(iteration_line(it, train_iters, it * global_batch_size, ms, tput, 1e-4, global_batch_size,
                                    {"lm loss": 10.0 / (1 + it / 10)}, when=t0 + timedelta(milliseconds=it * ms)))
        if report and max_reserved_mb:
            for rank, peak in sorted(max_reserved_mb.items()):
                b = peak * 2**20
                lines.append(memory_line(rank, it, 0.6 * b, 0.9 * b, 0.95 * b, b))
            report = it == 1
    lines.append("[after training is done] datetime: 2026-01-02 03:10:00 ")
    return "\n".join(lines) + "\n"
