"""Throughput of a plan or a run: samples/s, tokens/s per GPU (the unit of NVIDIA's published performance tables:
global batch x tokens per sample / step time / GPUs), model TFLOP/s per GPU and MFU. One function,
``throughput``, for every report (search, explain, baseline, the export header, the training log), so the numbers
agree wherever they are printed.

Tokens per sample: the sequence length (``ModelSpec.seq_length``); T5 carries its encoder and decoder tokens
(``seq_length + decoder_seq_length``). Model FLOPs: ``ModelSpec.training_flops_per_sample`` (forward + backward,
recompute not counted: Narayanan et al., SC'21); MFU is their rate over the GPU's dense peak in the training dtype.
"""

from __future__ import annotations

from typing import NamedTuple


class Throughput(NamedTuple):
    samples_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float | None                # None: no peak given (the training log, a GPU without that dtype)

    def text(self) -> str:
        """``51.09 samples/s, 13,078 tokens/s per GPU, 412.3 TFLOP/s per GPU, MFU 41.7%``."""
        mfu = f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else ""
        return (f"{self.samples_per_s:,.2f} samples/s, {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                f"{self.tflops_per_gpu:,.1f} TFLOP/s per GPU{mfu}")


def tokens_per_sample(model) -> int:
    return model.seq_length + (model.decoder_seq_length if model.is_t5 else 0)


def throughput(model, global_batch_size: int, iteration_ms: float, num_gpus: int,
               peak_tflops: float | None = None) -> Throughput:
    """The throughput of ``global_batch_size`` samples of ``model`` per ``iteration_ms`` on ``num_gpus`` GPUs
    (zeros for a zero or infinite time); ``peak_tflops``: the GPU's dense peak, for MFU."""
    if not 0 < iteration_ms < float("inf"):
        return Throughput(0.0, 0.0, 0.0, 0.0 if peak_tflops else None)
    samples = global_batch_size / (iteration_ms / 1e3)
    tflops = model.training_flops_per_sample() * samples / num_gpus / 1e12
    return Throughput(samples, samples * tokens_per_sample(model) / num_gpus, tflops,
                      tflops / peak_tflops if peak_tflops else None)
