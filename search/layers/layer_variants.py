"""Sliding-window attention, the softmax offset (attention sinks) and the clamped quick-GEGLU MLP: GPT-OSS's layer
fields in megatron-core 0.16.1 ``TransformerConfig`` terms (issue 22).

``ModelSpec`` carries them flat, under megatron-core's names, all None by default (dense specs, plans and
fingerprints stay as they were):

- ``window_size`` ``[left, right]`` and ``window_attn_skip_freq``: which layers attend through a sliding window.
  megatron-core's ``is_layer_window_attention`` (transformer/utils.py) with its 1-based ``layer_number``: no
  ``window_attn_skip_freq`` = every layer windowed; an integer N = layer_number % N != 0 is windowed (N = 2:
  layers 1, 3, 5, ... windowed, 2, 4, 6, ... full; 0-based: even layers windowed, GPT-OSS's
  ``layer_types`` sliding/full/sliding/...); a 0/1 list = 1 is windowed. A query at position i sees keys
  ``[i - left, i + right]`` (flash-attn's convention; -1 = unbounded), under the causal mask ``left + 1`` keys.
- ``softmax_type``: vanilla (None), off-by-one (a zero offset buffer) or learnable (``DotProductAttention``
  registers ``softmax_offset``, one parameter per attention head per layer: GPT-OSS's attention sinks).
- ``activation: quick_geglu`` (``quick_gelu(x W1) * (x V + glu_linear_offset)``, megatron-core's
  ``activation_func=quick_gelu`` with ``gated_linear_unit``, Megatron-LM ``--quick-geglu``) and
  ``activation_func_clamp_value`` (both halves of ``linear_fc1``'s output clamped; no cost).

What they cost: ``window_keys`` is the one answer to "how many keys does a query of this layer score against";
``ModelSpec``'s FLOPs and the analytic flash-attention core use it (docs/moe.md).
"""

from __future__ import annotations

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
MAX_WINDOW = 1 << 24


def check(model) -> None:
    """Cross-field rules of the layer-variant fields (ValueError, one line naming the field and the fix)."""
    w, freq = model.window_size, model.window_attn_skip_freq
    if w is not None:
        if len(w) != 2 or any(x < -1 or x > MAX_WINDOW for x in w):
            raise ValueError(f"window_size {w}: give [left, right], each -1 (unbounded) or 0..{MAX_WINDOW}")
        if w[0] == -1 and w[1] in (-1, 0):
            raise ValueError(f"window_size {w} is no window (full attention); remove window_size")
        if model.is_t5:
            raise ValueError("window_size is for gpt/llama decoders, not t5; remove it")
    if freq is not None:
        if w is None:
            raise ValueError("window_attn_skip_freq needs window_size; set window_size or remove it")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"window_attn_skip_freq ({freq}) must be at least 1, or a 0/1 list per layer")
        if isinstance(freq, list) and len(freq) != model.num_layers:
            raise ValueError(f"window_attn_skip_freq lists {len(freq)} layers but num_layers is "
                             f"{model.num_layers}; give one 0/1 per layer (1 = sliding window)")
    if model.glu_linear_offset is not None and model.activation not in ("swiglu", "quick_geglu"):
        raise ValueError(f"glu_linear_offset is for gated MLPs (swiglu, quick_geglu), not {model.activation}; "
                         "remove it")
    if model.activation_func_clamp_value is not None and model.activation != "quick_geglu":
        raise ValueError("activation_func_clamp_value works with activation quick_geglu only (megatron-core "
                         "0.16.1); remove it")


def is_window_layer(model, layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) attends through the sliding window (megatron-core's
    ``is_layer_window_attention`` with ``layer_number = layer + 1``)."""
    if model.window_size is None:
        return False
    freq = model.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return (layer + 1) % freq != 0
    return bool(freq[layer])


def window_keys(model, layer: int, s: int) -> int:
    """Keys each query of decoder layer ``layer`` scores against over a sequence of ``s`` tokens, counted as
    Megatron counts attention FLOPs (the full s x s score matrix of a causal layer, s keys per query): ``s`` on a
    full layer; ``min(s, left + 1 + right)`` on a windowed one (-1 = unbounded)."""
    if not is_window_layer(model, layer):
        return s
    left, right = model.window_size
    if left == -1 or right == -1:
        return s
    return min(s, left + 1 + right)


def offset_blocks_cp(model) -> bool:
    """Whether context parallelism is out for ``model``: transformer-engine runs a softmax offset (off-by-one,
    learnable) under context parallelism only with ``cp_comm_type`` a2a (``get_attention_backend``'s softmax-type
    filter disables every other backend), and aceso prices ring (p2p) context parallelism only."""
    return model.softmax_type in ("off-by-one", "learnable")


def softmax_offset_params(model) -> int:
    """Parameters of one attention unit's softmax offset: one per head when ``softmax_type`` is learnable (the
    off-by-one offset is a constant, not a parameter)."""
    return model.num_attention_heads if model.softmax_type == "learnable" else 0


FIELDS = ("window_size", "window_attn_skip_freq", "softmax_type", "glu_linear_offset", "activation_func_clamp_value")


def config_kwargs(model) -> dict:
    """The ``TransformerConfig`` fields of GPT-OSS's layer (``model_specs.builders``): the sliding window, the
    softmax type and the quick-GEGLU offset and clamp, each only where the model sets it (megatron-core's defaults
    otherwise: vanilla softmax, offset 0.0, no clamp). The activation itself (``quick_gelu``, gated) is
    ``builders.architecture_kwargs``'s."""
    out = {"window_size": tuple(model.window_size)} if model.window_size is not None else {}
    for f in FIELDS[1:]:
        if getattr(model, f) is not None:
            out[f] = getattr(model, f)
    return out
