"""Multi-latent attention without transformer-engine.

Target: ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` (a module global).

Reason: ``multi_latent_attention`` sets ``HAVE_TE = True`` when its imports from
``megatron.core.extensions.transformer_engine`` succeed -- and they do without transformer-engine, where that
module stands ``transformer_engine`` in by a ``MagicMock``, so ``TELinear`` is a mock instance, not a class.
``MultiLatentAttention.__init__`` then runs ``isinstance(self.linear_proj, TELinear)``, which raises ``TypeError``:
no MLA layer can be built without transformer-engine. With ``HAVE_TE`` False (what the extension module itself
says, ``transformer_engine.HAVE_TE``) that check is skipped, as its ``except ImportError`` branch intends; nothing
else in the module reads it. Applied by ``build_runtime`` (and the single-process reference) for MLA models when
transformer-engine is not importable.

Tested megatron-core versions: 0.16.1. Not needed on 0.19 (``multi_latent_attention`` takes ``HAVE_TE`` from the
extension there: ``needed()`` is False and ``apply()`` does nothing). Remove with 0.16 support.
"""

from __future__ import annotations

from ._base import Swaps, check_version

NAME = "mla_without_te"
TESTED_VERSIONS = ("0.16.1",)
_swaps = Swaps()


def needed() -> bool:
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    return mla.HAVE_TE and not te_ext.HAVE_TE


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Set ``multi_latent_attention.HAVE_TE = False`` when transformer-engine is absent (idempotent)."""
    if _swaps.active or not needed():
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.transformer import multi_latent_attention as mla

    _swaps.set(mla, "HAVE_TE", False)


def revert() -> None:
    _swaps.restore()
