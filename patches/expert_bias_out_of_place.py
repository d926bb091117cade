"""A biased expert's output bias added out of place (GPT-OSS's experts on megatron-core's local linears).

Target: ``megatron.core.transformer.mlp.MLP.forward`` (a wrapper around the original).

Reason: an expert MLP with biases (``add_bias_linear`` with MoE, GPT-OSS) that gets its routing probabilities as
``per_token_scale`` (``SequentialMLP``: every MoE layer without transformer-engine's grouped GEMM) adds its fc2 bias
with ``output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)`` (``MLP.forward``, 0.16.1 to 0.19.2).
With megatron-core's own ``RowParallelLinear`` that ``output`` is the output of ``_ReduceFromModelParallelRegion``,
a custom autograd function that returns its input as it is (the all-reduce is in place, or none on one rank), and
autograd forbids the in-place add on it: "Output 0 of _ReduceFromModelParallelRegion is a view and is being
modified inplace" (stock single-process ``GPTModel`` fails the same way). transformer-engine's linears return a new
tensor, so GPU runs with TE specs never meet it. The wrapper hooks the MLP's ``linear_fc2`` for that one call and
returns ``output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)`` with no bias: the same sum, out of
place, so the original's in-place branch is skipped (``output_bias`` is None) and nothing else changes. Applied by
``build_runtime`` (and the single-process reference) for MoE models with linear biases.

Tested megatron-core versions: 0.16.1, 0.19.2 (both still add in place).
"""

from __future__ import annotations

import functools

from ._base import Swaps, check_version

NAME = "expert_bias_out_of_place"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()


def is_applied() -> bool:
    return _swaps.active


def _out_of_place(original):
    @functools.wraps(original)
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is None:
            return original(self, hidden_states, per_token_scale, **kwargs)

        def add_bias(module, args, out):
            output, bias = out
            if bias is None:
                return out
            return output + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1), None

        handle = self.linear_fc2.register_forward_hook(add_bias)
        try:
            return original(self, hidden_states, per_token_scale, **kwargs)
        finally:
            handle.remove()

    return forward


def apply() -> None:
    """Install the wrapper (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.transformer.mlp import MLP

    _swaps.set(MLP, "forward", _out_of_place(MLP.forward))


def revert() -> None:
    _swaps.restore()
