"""Mamba-2 layers on CPU: megatron-core's ``MambaMixer`` routed to pure-torch reference kernels.

Target: module globals of ``megatron.core.ssm.mamba_mixer``: ``HAVE_MAMBA_SSM`` (True),
``mamba_split_conv1d_scan_combined`` and ``mamba_chunk_scan_combined`` (mamba_ssm's triton SSD kernels),
``RMSNormGated`` / ``ExtendedRMSNorm`` (mamba_ssm's triton gated norm; without mamba_ssm megatron-core defines both
as a ``MagicMock``). ``causal_conv1d_fn`` stays None: both versions' prefill path then runs the layer's own
``conv1d``. On megatron-core 0.16.1 without triton, also the module
``megatron.core.inference.contexts.attention_context.triton.tensor_ops``: ``mamba_mixer`` imports it at module level
(``import triton`` inside) for dynamic-batching inference only, so it is stood in by a module whose three functions
raise, registered in ``sys.modules`` before ``mamba_mixer`` is imported (nothing else imports it).

Reason: ``MambaMixer.__init__`` raises ``ImportError`` without mamba-ssm (a CUDA package: its selective-scan
extension and triton kernels), and its training path calls mamba_ssm's fused conv + SSD kernel; causal-conv1d is
CUDA as well. The reference kernels (``patches/_mamba_ref.py``) compute the same functions in torch (the SSD block
decomposition of Dao & Gu 2024, checked against the step-by-step recurrence) and keep for backward what the fused
kernels keep, so a Mamba layer's output, gradients and activation memory on CPU are the GPU path's. Decode-step
inference (``selective_state_update``, ``causal_conv1d_update``), packed sequences and varlen states are not
covered: they raise ``NotImplementedError`` naming this patch.

Tested megatron-core versions: 0.16.1 (torch 2.13.0 CPU, Python 3.11), 0.19.2 (torch 2.14.1, Python 3.12).
Remove when megatron-core has a torch fallback for its Mamba kernels.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

from ._base import Swaps, may_apply, module_exists as _has

NAME = "mamba_cpu"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
_MIXER = "megatron.core.ssm.mamba_mixer"
_swaps = Swaps()
_stubbed: list[str] = []
_added: list[tuple] = []
log = logging.getLogger(__name__)


def refusal() -> str | None:
    """Why megatron-core's Mamba layer cannot be built on CPU in this process (None: it can, after ``apply()``);
    one line, read before anything is built."""
    if not _has("einops"):
        return "megatron-core's MambaMixer needs einops (pip install einops); no Mamba layer can be built"
    return None


def _raise_needs_triton(*args, **kwargs):
    raise NotImplementedError("dynamic-batching Mamba inference needs triton (megatron-core's tensor_ops); "
                              "aceso's CPU Mamba patch covers training and prefill only")


def _stub_tensor_ops() -> None:
    """0.16.1 without triton: ``mamba_mixer`` imports three triton helpers of dynamic inference at module level."""
    if _has("triton") or _MIXER in sys.modules or _TENSOR_OPS in sys.modules:
        return
    stub = types.ModuleType(_TENSOR_OPS, "aceso patches.mamba_cpu: triton is absent; dynamic inference only")
    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(stub, name, _raise_needs_triton)
    sys.modules[_TENSOR_OPS] = stub
    _stubbed.append(_TENSOR_OPS)
    log.info("mamba_cpu: %s stood in (no triton; dynamic-batching inference disabled)", _TENSOR_OPS)


def _norm_class(mixer):
    """``ExtendedRMSNorm`` on the reference gated norm: its weight sharded on axis 0, as megatron-core's."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from ._mamba_ref import RMSNormGated

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return type("ExtendedRMSNorm", (RMSNormGated,), {"sharded_state_dict": sharded_state_dict,
                                                     "__module__": mixer.__name__})


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Route ``MambaMixer`` to the reference kernels when mamba_ssm is absent (idempotent)."""
    if not may_apply(NAME, TESTED_VERSIONS, _swaps, refusal):
        return
    _stub_tensor_ops()
    mixer = importlib.import_module(_MIXER)
    if getattr(mixer, "HAVE_MAMBA_SSM", False) and not _is_mock(mixer.RMSNormGated):
        return   # mamba_ssm is installed: its kernels run
    from . import _mamba_ref as ref

    for name, value in (("HAVE_MAMBA_SSM", True),
                        ("mamba_split_conv1d_scan_combined", ref.mamba_split_conv1d_scan_combined),
                        ("mamba_chunk_scan_combined", ref.mamba_chunk_scan_combined),
                        ("RMSNormGated", ref.RMSNormGated), ("ExtendedRMSNorm", _norm_class(mixer))):
        if not hasattr(mixer, name):        # 0.16.1 leaves the kernel names undefined without mamba_ssm
            setattr(mixer, name, None)
            _added.append((mixer, name))
        _swaps.set(mixer, name, value)
    log.info("mamba_cpu: megatron-core MambaMixer runs aceso's torch reference kernels (%s)", mixer.__file__)


def _is_mock(obj) -> bool:
    return type(obj).__module__.startswith("unittest.mock")


def revert() -> None:
    _swaps.restore()
    while _added:
        delattr(*_added.pop())
    while _stubbed:
        name = _stubbed.pop()
        if _MIXER not in sys.modules:
            sys.modules.pop(name, None)
