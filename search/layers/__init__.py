"""Layer kinds: the registry (``kind``) and one module per kind, in megatron-core's hybrid vocabulary
(docs/layer-kinds.md). Importing the package registers the built-in kinds, in the order a layer runs them.

``dense``: self-attention ``*``, T5's cross-attention, MLP ``-``; ``mla``: multi-latent attention ``+`` (a variant
of ``*``); ``moe``: the MoE layer's MLP half ``E``; ``mtp``: a multi-token prediction depth (``/``).
``mamba``: megatron-core's Mamba-2 layer ``M`` (formulas and its kind; issue 36); ``gdn``: its Gated DeltaNet
layer ``G`` (0.19); ``hybrid``: the layer pattern.
"""

from . import dense, mla, moe, mtp  # noqa: F401  (registration order: a layer's units run in this order)
from . import gdn, mamba  # noqa: F401  (M, G: only where a hybrid layer pattern writes them)
from .kind import (LayerKind, by_symbol, ep_overlap_pairs, get, kinds, layer_kinds, register, resolve, symbols,
                   tail_kinds, unregister)

__all__ = ["LayerKind", "by_symbol", "ep_overlap_pairs", "get", "kinds", "layer_kinds", "register", "resolve",
           "symbols", "tail_kinds", "unregister"]
