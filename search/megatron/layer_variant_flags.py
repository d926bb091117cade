"""GPT-OSS's layer fields (``search.layers.layer_variants``) as Megatron-LM core_v0.16.1 flags, both ways, and as
Megatron-Bridge ``model`` fields.

Megatron-LM (``megatron/training/arguments.py``): ``--window-size L,R`` (``tuple_type``: "128,0" or "(128,0)"),
``--window-attn-skip-freq`` (``moe_freq_type``: an integer N, or a Python list expression such as "[1,0]*18"),
``--quick-geglu`` (``gated_linear_unit`` with ``quick_gelu``; asserts ``not --swiglu``), ``--squared-relu``
(``activation_func = squared_relu``, same GEMM shapes as GeLU; asserts ``not --swiglu``; ``names.py`` writes it), and from
``TransformerConfig`` through its ``ArgumentGroupFactory``: ``--softmax-type vanilla|off-by-one|learnable``,
``--glu-linear-offset``, ``--activation-func-clamp-value``. ``--kv-channels`` is read with the other sizes
(``model_args``). Bridge: the same ``TransformerConfig`` names; the activation comes with the recipe (as SwiGLU's).
``read`` / ``write`` / ``bridge`` / ``FLAG_KINDS`` also carry the architecture fields of ``arch_flags`` (QKV bias,
norm epsilon, top-k scaling, rotary percent, RoPE scaling).
"""

from __future__ import annotations

import ast

from search.io.errors import AcesoError
from . import arch_flags

# flag -> value kind (search.megatron.cmdline's FLAGS kinds)
FLAG_KINDS: dict[str, str] = {"--window-size": "str", "--window-attn-skip-freq": "str", "--softmax-type": "str",
                              "--glu-linear-offset": "float", "--activation-func-clamp-value": "float",
                              "--quick-geglu": "bool", "--squared-relu": "bool", **arch_flags.FLAG_KINDS}
_SOFTMAX = ("vanilla", "off-by-one", "learnable")


def _window(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.strip("()").split(",")]
    except ValueError:
        out = []
    if len(out) != 2:
        raise AcesoError(f"--window-size {text}: give two integers LEFT,RIGHT (e.g. 128,0)")
    return out


def _pattern(text: str) -> int | list[int]:
    """``moe_freq_type``: an integer, or a list expression of 0/1 lists joined by + and repeated by * n."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            seq, n = (a, b) if isinstance(a, list) else (b, a)
            if isinstance(node.op, ast.Mult) and isinstance(seq, list) and isinstance(n, int) and \
                    len(seq) * n > 1 << 16:
                raise ValueError        # far more layers than any model (MAX_LAYERS 4096)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError
    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, MemoryError):
        out = None
    if not (isinstance(out, int) or isinstance(out, list) and all(x in (0, 1) for x in out)):
        raise AcesoError(f"--window-attn-skip-freq {text}: give an integer N or a 0/1 list such as [1,0]*18")
    return out


def read(f) -> dict:
    """The ``ModelSpec`` fields the flags of ``f`` (``cmdline.Flags``) set (absent flags: nothing)."""
    out: dict = {}
    if f.has("--quick-geglu"):
        if f.has("--swiglu"):
            raise AcesoError("--quick-geglu and --swiglu together: Megatron-LM asserts one of them")
        out["activation"] = "quick_geglu"
    if f.has("--squared-relu"):
        # core_v0.16.1 arguments.py:1338-1340, core_v0.19.0 training/argument_utils.py:320-322: asserts not --swiglu;
        # it is tested before --quick-geglu (elif), so it wins over that one
        if f.has("--swiglu"):
            raise AcesoError("--squared-relu and --swiglu together: Megatron-LM asserts one of them")
        out["activation"] = "squared_relu"
    if f.has("--window-size"):
        out["window_size"] = _window(f.get("--window-size"))
    if f.has("--window-attn-skip-freq"):
        out["window_attn_skip_freq"] = _pattern(f.get("--window-attn-skip-freq"))
    kind = f.value("--softmax-type")
    if kind not in _SOFTMAX:
        raise AcesoError(f"--softmax-type {kind}: use {', '.join(_SOFTMAX)}")
    out["softmax_type"] = None if kind == "vanilla" else kind
    offset = f.value("--glu-linear-offset")
    out["glu_linear_offset"] = offset or None
    out["activation_func_clamp_value"] = f.get("--activation-func-clamp-value")
    return {**out, **arch_flags.read(f)}


def _freq(v: int | list[int]) -> str:
    return str(v) if isinstance(v, int) else "[" + ",".join(map(str, v)) + "]"


def write(m) -> list[str]:
    """Megatron-LM flags of the layer fields a ``ModelSpec`` sets (none for a spec without them)."""
    out = ["--quick-geglu"] if m.activation == "quick_geglu" else []
    if m.glu_linear_offset is not None:
        out += ["--glu-linear-offset", repr(float(m.glu_linear_offset))]
    if m.activation_func_clamp_value is not None:
        out += ["--activation-func-clamp-value", repr(float(m.activation_func_clamp_value))]
    if m.softmax_type not in (None, "vanilla"):
        out += ["--softmax-type", m.softmax_type]
    if m.window_size is not None:
        out += ["--window-size", f"{m.window_size[0]},{m.window_size[1]}"]
    if m.window_attn_skip_freq is not None:
        out += ["--window-attn-skip-freq", _freq(m.window_attn_skip_freq)]
    return out + arch_flags.write(m)


def bridge(m) -> dict:
    """Megatron-Bridge ``model`` fields (``TransformerConfig`` names) of the layer fields a spec sets."""
    out = {k: getattr(m, k) for k in ("window_attn_skip_freq", "softmax_type", "glu_linear_offset",
                                      "activation_func_clamp_value") if getattr(m, k) is not None}
    if m.window_size is not None:
        out["window_size"] = list(m.window_size)
    return {**out, **arch_flags.bridge(m)}
