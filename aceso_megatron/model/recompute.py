"""Per-unit activation recompute, on megatron-core's own checkpointing (``tensor_parallel.checkpoint``, which
saves and replays the RNG state; on CPU through ``patches.cpu_mode``).

The four choices of ``search.spec.plan.Recompute`` for one unit:
- ``none``: keep every activation.
- ``selective``: attention units recompute the attention core (megatron-core's ``recompute_modules=["core_attn"]``,
  set in the unit's config by ``aceso_megatron.model.config.unit_config``); MLP units recompute the activation function
  only (``CheckpointedActivation`` as the unit's ``activation_func``). Not megatron-core's ``"mlp"`` module: with
  ``add_bias_linear`` it returns a bias Parameter from the checkpointed function, which hangs in backward on
  torch 2.13.
- ``full``: only the unit's input is kept; the whole unit runs again in backward (``run_unit``).
- ``attn_dropout`` (attention units only): the attention-probability dropout and the probs x V product run again
  in backward (``aceso_megatron.model.attention``, the unit's core attention).

Units are half layers, so a plan may recompute the attention half of a layer and keep its MLP half.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import tensor_parallel


class CheckpointedActivation:
    """An ``activation_func`` whose output is dropped after use and recomputed in backward (selective recompute
    of an MLP unit), on megatron-core's ``CheckpointWithoutOutput`` as its MoE experts use it.

    A plain checkpoint would save nothing: ``linear_fc2`` saves the activation output for its weight gradient.
    So the output's storage is released once ``linear_fc2`` has run (``release_after`` installs that forward
    hook) and re-materialised from the kept input when the gradient of ``linear_fc2``'s output arrives.
    """

    def __init__(self, fn):
        self.fn = fn
        self._pending = None
        functools.update_wrapper(self, fn)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.fn(x)
        # fp8=None: megatron-core 0.16 reads ``fp8 is not None`` as "fp8 on", so the default False turns it on
        ckpt = tensor_parallel.CheckpointWithoutOutput(fp8=None)
        out = ckpt.checkpoint(self.fn, x)
        self._pending = ckpt
        return out

    def release_after(self, fc2: torch.nn.Module):
        """Free the activation output once ``fc2`` (the MLP's second linear) has consumed it."""

        def hook(module, inputs, output):
            ckpt, self._pending = self._pending, None
            if ckpt is not None:
                ckpt.discard_output_and_register_recompute(output[0] if isinstance(output, tuple) else output)

        return fc2.register_forward_hook(hook)

    def __eq__(self, other):  # megatron-core compares activation_func with F.gelu / F.silu
        return other is self or other == self.fn

    def __hash__(self):
        return hash(self.fn)


def run_unit(fn, full: bool, hidden: torch.Tensor, context: torch.Tensor | None):
    """``fn(hidden, context)``, recomputed in backward when ``full`` (inputs kept, everything else dropped)."""
    if full and torch.is_grad_enabled():
        return tensor_parallel.checkpoint(fn, False, hidden, context)
    return fn(hidden, context)
