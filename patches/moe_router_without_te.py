"""The MoE router's gating GEMM without transformer-engine.

Target: ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` (a module global, set to None when absent).

Reason: ``moe_utils`` imports ``te_general_gemm`` inside its transformer-engine ``try`` block and never defines it
in the ``except ImportError`` branch, but ``RouterGatingLinearFunction`` reads it on every call (``if
te_general_gemm is not None``): without transformer-engine every MoE router raises ``NameError`` (unless the
router runs in fp64). With the name defined as None the function takes its own torch ``mm``/``addmm`` path,
forward and backward, which is what the code intends. Applied by ``build_runtime`` (and the single-process
reference) for MoE models when transformer-engine is not importable.

Tested megatron-core versions: 0.16.1. Not needed on 0.19 (``moe_utils`` sets ``te_general_gemm = None`` itself:
``needed()`` is False and ``apply()`` does nothing). Remove with 0.16 support.
"""

from __future__ import annotations

from ._base import check_version

NAME = "moe_router_without_te"
TESTED_VERSIONS = ("0.16.1",)
_applied = False


def needed() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def is_applied() -> bool:
    return _applied


def apply() -> None:
    """Define ``moe_utils.te_general_gemm = None`` when transformer-engine did not (idempotent)."""
    global _applied
    if _applied or not needed():
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    _applied = True


def revert() -> None:
    """Remove the name again (the module as megatron-core left it)."""
    global _applied
    if not _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    del moe_utils.te_general_gemm
    _applied = False
