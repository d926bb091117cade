"""Gated DeltaNet layers on CPU: megatron-core's ``GatedDeltaNet`` routed to pure-torch reference kernels.

Target: module globals of the package ``megatron.core.ssm.gated_delta_net`` (0.19): its ``common`` and ``gdn``
modules'   ``HAVE_FLA`` (True), ``l2norm`` (read by ``_GDNBase._prepare_input_for_gated_delta_rule``),
``causal_conv1d`` and ``chunk_gated_delta_rule`` (``GatedDeltaNet.forward``, which imports both by name), fla's
Triton kernels; and ``_GDNBase``'s three ``jit_fuser`` methods (``_prepare_input_for_gated_delta_rule``,
``_compute_g_and_beta``, ``_apply_gated_norm``: ``torch.compile`` from torch 2.2) as the functions they wrap.

Reason: ``_GDNBase.__init__`` raises ``ImportError`` without fla (flash-linear-attention: Triton kernels, CUDA only),
and its forward calls fla's ``causal_conv1d``, ``l2norm`` and ``chunk_gated_delta_rule``. The reference kernels
(``patches/_gdn_ref.py``) compute the same functions in torch, with fla's signatures: the chunked gated delta rule
written from the recurrence (equal to it in float64, and to megatron-core's own ``torch_chunk_gated_delta_rule``,
its deterministic-mode path, which needs fla's ``l2norm`` and ``causal_conv1d`` all the same), the depthwise causal
conv + SiLU, fla's L2 norm. Backward is torch autograd through them (the gradients of fla's backward, not its
memory). The three compiled methods run eagerly: inductor on a CPU builds C++ per process (a compiler, minutes on
a small machine) for element-wise work whose result is the same. Packed sequences, conv states and decode raise
``NotImplementedError`` naming this patch. Where fla is installed (a GPU), ``apply()`` changes nothing.

Tested megatron-core versions: 0.19.2 (torch 2.14.1, Python 3.12). The runtime builds hybrid models on 0.19 only
(``patches.compat.have_hybrid``); 0.17 and 0.18 (GDN in one module ``ssm/gated_delta_net.py``) are not installed
here and not covered. 0.16.1's ``ssm/gated_delta_net.py`` (causal-conv1d's kernel names) is built by no hybrid
pattern: ``needed()`` is False there and ``refusal()`` says so in one line.
Remove when megatron-core has a torch fallback for fla's kernels.
"""

from __future__ import annotations

import importlib
import logging

from ._base import Swaps, may_apply, module_exists as _has

NAME = "gdn_cpu"
TESTED_VERSIONS = ("0.19.2",)
_PACKAGE = "megatron.core.ssm.gated_delta_net"
_COMPILED = ("_prepare_input_for_gated_delta_rule", "_compute_g_and_beta", "_apply_gated_norm")
_swaps = Swaps()
log = logging.getLogger(__name__)


def needed() -> bool:
    """False on a megatron-core whose hybrid models have no ``G`` layer (0.16.1: its ``GatedDeltaNet`` module
    exists, with other kernel names, but no hybrid pattern builds it): nothing there to patch."""
    return _has(f"{_PACKAGE}.gdn")


def refusal() -> str | None:
    """Why megatron-core's GDN layer cannot be built in this process (None: it can, after ``apply()``); one line,
    read before anything is built."""
    if not needed():
        import megatron.core

        return (f"model.gdn: megatron-core {megatron.core.__version__} builds no Gated DeltaNet ('G') layer of a "
                "hybrid pattern (0.19 does); use the Python 3.12 stack (README)")
    return None


def _modules() -> tuple:
    """(``common``: ``HAVE_FLA``, ``l2norm``, ``_GDNBase``; ``gdn``: ``GatedDeltaNet``, whose forward calls the
    kernels by the names it imported)."""
    return importlib.import_module(f"{_PACKAGE}.common"), importlib.import_module(f"{_PACKAGE}.gdn")


def _eager(method):
    """The function a ``torch.compile`` (or ``torch.jit.script``) decorator wrapped; the method itself otherwise."""
    return getattr(method, "_torchdynamo_orig_callable", None) or getattr(method, "__wrapped__", method)


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Route ``GatedDeltaNet`` to the reference kernels when fla is absent (idempotent)."""
    if not may_apply(NAME, TESTED_VERSIONS, _swaps, refusal):
        return
    common, gdn = _modules()
    if getattr(common, "HAVE_FLA", False):
        return   # fla is installed: its kernels run
    from . import _gdn_ref as ref

    _swaps.set(common, "HAVE_FLA", True)
    _swaps.set(common, "l2norm", ref.l2norm)
    for mod in (common, gdn):
        _swaps.set(mod, "causal_conv1d", ref.causal_conv1d)
        _swaps.set(mod, "chunk_gated_delta_rule", ref.chunk_gated_delta_rule)
    base = common._GDNBase
    for name in _COMPILED:
        if name in vars(base) and _eager(vars(base)[name]) is not vars(base)[name]:
            _swaps.set(base, name, _eager(vars(base)[name]))
    log.info("gdn_cpu: megatron-core GatedDeltaNet runs aceso's torch reference kernels (%s)", gdn.__file__)


def revert() -> None:
    _swaps.restore()
