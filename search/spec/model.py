"""Model architecture as data (``ModelSpec``) and its sub-layer units.

The model is a sequence of *units*, each of one layer kind (``search.layers``: one record per kind, in
megatron-core's hybrid vocabulary, docs/layer-kinds.md): a transformer layer is its attention unit (input norm,
attention, residual add) and its MLP unit (norm, MLP or MoE, residual add); a T5 decoder layer has a cross-attention
unit between them; an MTP depth is one unit after the decoder. Units are the granularity of stage boundaries and of
recompute choices in a ``ParallelPlan``. The embedding belongs to the first stage, the final norm, output layer and
loss to the last one.

Each unit's parameters and FLOPs are its kind's (``search.layers.dense``, ``mla``, ``moe``, ``mtp``); what one rank
of a TP group holds: ``costmodel.memory`` (``*_params_per_rank``). FLOPs follow Narayanan et al. (SC'21, appendix):
2 FLOPs per multiply-add, backward = 2x forward.

Extension in megatron-core's format (docs/model-specs.md): ``layer_spec`` names the user's own layer-spec provider
(an import path, imported only by the runtime and the profiler) and ``megatron`` carries extra ``TransformerConfig``
fields as data (``search.spec.megatron_fields``). Counts and FLOPs here are the stock layer's; a custom layer is priced
by profiling it.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_serializer, model_validator

from search.spec import megatron_fields
from search.layers import layer_variants
from search import layers
from search.spec import rope_scaling as _rope_scaling
from search.spec import model_rules
from search.layers import hybrid as _hybrid
from search.layers.gdn import GDNSpec
from search.layers.mamba import Mamba2Spec
from search.layers.moe_spec import MAX_MTP, MLASpec, MoESpec, check_model as _check_moe
from search.settings.moe_plan import drop_defaults
from search.spec.rope_scaling import RopeScaling

Family = Literal["gpt", "t5", "llama"]
UnitKind = str      # a registered layer kind's name (``search.layers``): attention, cross_attention, mlp, moe, mtp
Stack = Literal["decoder", "encoder"]

# Upper bounds (docs/inputs.md): far above any published model (Llama 3 405B: 126 layers, hidden 16384, ffn 53248,
# 128 heads, vocabulary 128256), low enough that a typo such as 10^30 is refused instead of exhausting memory.
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 18            # 262144
MAX_HEADS = 1 << 14             # 16384
MAX_FFN = 1 << 20
MAX_SEQ = 1 << 24               # 16M tokens
MAX_VOCAB = 1 << 24
MAX_NAME = 200


class Unit(NamedTuple):
    """One sub-layer unit: which stack (GPT/Llama layers are ``decoder``), which layer in it, which kind."""

    stack: Stack
    layer: int
    kind: UnitKind


HYBRID_FIELDS = ("hybrid_layer_pattern", "mamba", "gdn")   # left out of a dump when None (``ModelSpec._dump``)
OFF_FIELDS = ("mtp_use_repeated_layer",)            # left out of a dump when False
_PROVIDER = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")   # package.module:attr


class ModelSpec(BaseModel):
    """A transformer architecture. Lengths are tokens; sizes are elements."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str = Field("custom", min_length=1, max_length=MAX_NAME, description="Preset or user name, shown in "
                      "reports.")
    family: Family = Field(description="gpt (decoder-only), llama (decoder-only, Llama-style), t5 (encoder-decoder).")
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="Transformer layers (T5: encoder layers).")
    num_decoder_layers: int | None = Field(None, gt=0, le=MAX_LAYERS, description="T5 only: decoder layers.")
    hidden_size: int = Field(gt=0, le=MAX_HIDDEN, description="Model width h.")
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS, description="Attention heads.")
    num_query_groups: int | None = Field(None, gt=0, le=MAX_HEADS,
                                         description="KV heads for grouped-query attention; None = heads.")
    kv_channels: int | None = Field(None, gt=0, le=MAX_HIDDEN,
                                    description="Per-head width; None = hidden_size / heads.")
    ffn_hidden_size: int = Field(gt=0, le=MAX_FFN, description="MLP inner width.")
    seq_length: int = Field(gt=0, le=MAX_SEQ, description="Sequence length (T5: encoder sequence length).")
    decoder_seq_length: int | None = Field(None, gt=0, le=MAX_SEQ, description="T5 only: decoder sequence length.")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB, description="Tokenizer vocabulary size.")
    make_vocab_size_divisible_by: int = Field(128, gt=0, le=1 << 16,
                                              description="Megatron pads the vocabulary to a multiple of this.")
    activation: Literal["gelu", "swiglu", "quick_geglu", "squared_relu"] = Field(
        "gelu", description="MLP activation: gelu, swiglu, quick_geglu (gated quick-GELU, GPT-OSS) or squared_relu "
        "(Nemotron-H / Nemotron-3, not gated); the gated ones double the first linear.")
    normalization: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="Norm layers.")
    position_embedding: Literal["learned", "rope", "none"] = Field(
        "learned", description="Absolute learned, rotary, or none (NoPE: Nemotron-H / Nemotron-3).")
    rotary_base: float = Field(10000.0, gt=0, le=1e12, description="RoPE base (rope only).")
    tied_embeddings: bool = Field(True, description="Output layer shares the input word embedding.")
    add_bias_linear: bool = Field(True, description="Linear layers carry biases.")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the attention probabilities "
                                     "(Megatron's default for GPT and T5 is 0.1; Llama trains without).")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after the attention and MLP outputs and "
                                  "on the embedding.")
    params_dtype: Literal["bf16", "fp16", "fp32"] = Field("fp16", description="Dtype of parameters and activations.")
    aceso_db_key: str | None = Field(None, max_length=MAX_NAME,
                                     description="Model key in the Aceso reference database, e.g. gpt_1_3B.")
    nominal_params_b: float | None = Field(None, gt=0, le=1e6,
                                           description="The size the preset is named after, billions.")

    # ----- extension in megatron-core's format (docs/model-specs.md) -----
    rotary_percent: float = Field(1.0, gt=0, le=1, description="Fraction of each head's channels that RoPE "
                                  "rotates (rope only; megatron-core's rotary_percent).")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling for a longer context "
                                             "(search.spec.rope_scaling: llama3 or yarn); None = plain RoPE.")
    layer_spec: str | dict[Literal["encoder", "decoder"], str] | None = Field(
        None, description="Your own megatron-core layer spec: 'package.module:function', a function (or a ModuleSpec) "
        "giving the ModuleSpec of one TransformerLayer; T5: {encoder: ..., decoder: ...}. Imported only by the "
        "runtime and the profiler; None = megatron-core's stock GPT/T5 layer.")
    megatron: dict[str, JsonValue] | None = Field(
        None, description="Extra megatron-core TransformerConfig fields passed to every stage's config unchanged "
        "(qk_layernorm, softmax_scale, layernorm_epsilon, init_method_std, ...). Fields our spec or the plan "
        "controls are refused.")

    # ----- MoE / MLA / MTP (search.layers.moe_spec; counted by search.layers.moe_params, not priced yet: docs/moe.md) -----
    moe: MoESpec | None = Field(None, description="Mixture-of-Experts layers (search.layers.moe_spec.MoESpec); None = dense.")
    mla: MLASpec | None = Field(None, description="Multi-latent attention (search.layers.moe_spec.MLASpec); None = standard "
                                "attention.")
    mtp_num_layers: int | None = Field(None, gt=0, le=MAX_MTP, description="Multi-token prediction layers after "
                                       "the decoder (DeepSeek-V3: 1); None = none.")
    mtp_use_repeated_layer: bool = Field(False, description="All MTP depths run one shared MTP layer (megatron-core "
                                         "0.19 mtp_use_repeated_layer, Nemotron-3 Super / Ultra): its weights once, "
                                         "its compute and activations per depth.")

    # ----- sliding window, softmax offset, clamped GEGLU (search.layers.layer_variants; GPT-OSS) -----
    window_size: list[int] | None = Field(None, description="Sliding-window attention [left, right] (megatron-core "
                                          "window_size; -1 = unbounded; GPT-OSS: [127, 0]); None = full attention.")
    window_attn_skip_freq: int | list[Literal[0, 1]] | None = Field(
        None, description="Which layers the window applies to: N = every layer but each N-th (1-based layer "
        "number % N != 0), or one 0/1 per layer (1 = windowed); None = all layers.")
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] | None = Field(
        None, description="Attention softmax: vanilla (None), off-by-one, or learnable (a per-head "
        "softmax_offset parameter: GPT-OSS's attention sinks).")
    glu_linear_offset: float | None = Field(None, ge=-1e6, le=1e6, description="Gated MLP: act(x W) * (x V + "
                                            "offset) (GPT-OSS: 1.0); None = 0.")
    activation_func_clamp_value: float | None = Field(None, gt=0, le=1e6, description="quick_geglu: clamp of "
                                                      "linear_fc1's output (GPT-OSS: 7.0); None = none.")

    # ----- hybrid models (megatron-core's HybridModel; search.layers.hybrid.check_model, docs/model-specs.md) -----
    hybrid_layer_pattern: str | None = Field(
        None, max_length=2 * MAX_LAYERS, description="The decoder as megatron-core's hybrid layer pattern, one symbol "
        "per layer (M Mamba-2, G Gated DeltaNet, * attention, + MLA, - MLP, E MoE; Megatron-LM --hybrid-layer-pattern), then '/' and "
        "one MTP depth's symbols per depth; no '|' (where to cut is the plan's). Its main part has num_layers "
        "symbols. None = a GPT / Llama / T5 model of attention + MLP layers.")
    mamba: Mamba2Spec | None = Field(None, description="The Mamba-2 mixer of the pattern's M layers "
                                     "(search.layers.mamba.Mamba2Spec); exactly when the pattern has M.")
    gdn: GDNSpec | None = Field(None, description="The Gated DeltaNet mixer of the pattern's G layers "
                                "(search.layers.gdn.GDNSpec, megatron-core 0.19's linear_* fields); exactly when "
                                "the pattern has G.")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Without the hybrid fields when they are unset: a model without them dumps (and a plan digests) as
        before they existed."""
        out = handler(self)
        for name in HYBRID_FIELDS:
            if isinstance(out, dict) and out.get(name, 0) is None:
                del out[name]
        return drop_defaults(out, {name: False for name in OFF_FIELDS})

    @field_validator("layer_spec")
    @classmethod
    def _provider_paths(cls, v):
        for path in ([v] if isinstance(v, str) else (v or {}).values()):
            if not _PROVIDER.match(path):
                raise ValueError(f"'{path}' is not an import path; write 'package.module:function'")
        return v

    @field_validator("megatron")
    @classmethod
    def _megatron_block(cls, v):
        if not v:
            return None   # an empty block is no block (plans and fingerprints stay as without it)
        megatron_fields.check_names(v, megatron_fields.transformer_config_fields())
        return v

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.family == "t5":
            if self.num_decoder_layers is None or self.decoder_seq_length is None:
                raise ValueError("t5 models need num_decoder_layers and decoder_seq_length; add both")
        else:
            if self.num_decoder_layers is not None or self.decoder_seq_length is not None:
                raise ValueError(
                    f"num_decoder_layers/decoder_seq_length are for t5 only, not {self.family}; remove them"
                )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}), or set kv_channels"
            )
        if self.is_t5 and isinstance(self.layer_spec, str):
            raise ValueError("t5 models need two layer specs: layer_spec: {encoder: 'pkg.mod:fn', decoder: "
                             "'pkg.mod:fn'}")
        if isinstance(self.layer_spec, dict) and (not self.is_t5 or set(self.layer_spec) != {"encoder", "decoder"}):
            raise ValueError(f"layer_spec: {self.family} models take one 'package.module:function'" if not self.is_t5
                             else "layer_spec: give both encoder and decoder providers")
        if self.rotary_percent != 1.0 and self.position_embedding != "rope":
            raise ValueError(f"rotary_percent ({self.rotary_percent}) is for position_embedding rope; remove it")
        if self.num_attention_heads % self.groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups "
                f"({self.groups})"
            )
        if self.mtp_use_repeated_layer and not self.mtp_num_layers:
            raise ValueError("mtp_use_repeated_layer needs mtp_num_layers (the depths that share the layer); set it "
                             "or remove mtp_use_repeated_layer")
        _hybrid.check_model(self)
        _check_moe(self)
        layer_variants.check(self)
        _rope_scaling.check(self)
        model_rules.check_model(self)       # what megatron-core (and Megatron-LM) refuse at model build
        return self

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "ModelSpec":
        """A validated copy (pydantic's would carry the cached ``units`` over and skip validation)."""
        return type(self).model_validate({**self.model_dump(), **(update or {})})

    # ----- derived sizes -------------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """The self-attention's QKV projection carries a bias: ``add_bias_linear``, or ``megatron.add_qkv_bias``
        alone (Qwen2, GLM-4.5; megatron-core's ``SelfAttention.linear_qkv`` takes either)."""
        return self.add_bias_linear or bool((self.megatron or {}).get("add_qkv_bias"))

    @property
    def gated_mlp(self) -> bool:
        """swiglu and quick_geglu: the first MLP linear is two (gate and linear halves)."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def is_t5(self) -> bool:
        return self.family == "t5"

    def layer_spec_path(self, stack: Stack) -> str | None:
        """The layer-spec provider of ``stack`` (None: megatron-core's stock layer)."""
        return self.layer_spec[stack] if isinstance(self.layer_spec, dict) else self.layer_spec

    @property
    def decoder_layers(self) -> int:
        """Layers in the decoder stack (GPT/Llama: all layers)."""
        return self.num_decoder_layers if self.is_t5 else self.num_layers

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.params_dtype == "fp32" else 2

    @property
    def stacks(self) -> tuple[tuple[Stack, int], ...]:
        """(stack, layers) in execution order: T5's encoder, then the decoder."""
        return (("encoder", self.num_layers), ("decoder", self.num_decoder_layers)) if self.is_t5 else \
            (("decoder", self.num_layers),)

    @cached_property
    def units(self) -> tuple[Unit, ...]:
        """All units in execution order: each layer's kinds (``layers.layer_kinds``: an MoE layer's second unit is
        ``moe`` instead of ``mlp``; a T5 decoder layer has ``cross_attention``), then the whole-layer kinds after
        the decoder (``layers.tail_kinds``: each MTP depth one ``mtp`` unit, layer index ``num_layers + j``)."""
        out = [Unit(stack, i, k) for stack, n in self.stacks for i in range(n)
               for k in layers.layer_kinds(self, stack, i)]
        return tuple(out + [Unit("decoder", self.decoder_layers + j, k)
                            for j, k in enumerate(layers.tail_kinds(self))])

    @property
    def layer_starts(self) -> list[int]:
        """Unit index where each layer starts, plus the end (T5: encoder layers, then decoder layers). The MTP units
        count as part of the last decoder layer: they belong to the last model chunk (megatron-core builds the MTP
        block on the last pipeline stage), so a layer-aligned cut never separates them from it."""
        out, last = [0], None
        for i, u in enumerate(self.units):
            if i and (u.stack, u.layer) != last and layers.get(u.kind).role != "layer":
                out.append(i)
            last = (u.stack, u.layer)
        return out + [len(self.units)]

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def num_encoder_units(self) -> int:
        """T5: units before the first decoder unit (0 for GPT/Llama)."""
        return sum(u.stack == "encoder" for u in self.units)

    # ----- parameter counts ----------------------------------------------------------------------------------
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "layernorm" else 1)

    def qk_norm_params(self) -> int:
        """The Q and K norms of a self-attention unit (``megatron.qk_layernorm``): two norms of width head_dim."""
        if not (self.megatron or {}).get("qk_layernorm"):
            return 0
        return 2 * self.head_dim * (2 if self.normalization == "layernorm" else 1)

    def unit_params(self, kind: UnitKind) -> int:
        """Parameters of one unit (unsharded), its norm included: its kind's count (``search.layers``)."""
        return layers.resolve(self, kind).params(self)

    def embedding_params(self) -> int:
        pos = self.seq_length if self.position_embedding == "learned" else 0
        if self.is_t5:
            pos = max(self.seq_length, self.decoder_seq_length)
        return (self.padded_vocab_size + pos) * self.hidden_size

    def output_params(self) -> int:
        """Final norm(s) + untied output layer (+ the T5 LM-head bias)."""
        n = self._norm_params() * (2 if self.is_t5 else 1)
        if not self.tied_embeddings:
            n += self.padded_vocab_size * self.hidden_size
        if self.is_t5:
            n += self.padded_vocab_size
        return n

    @property
    def num_parameters(self) -> int:
        if self.hybrid_layer_pattern:     # one unit per layer of the pattern, each its kind's count
            return self.embedding_params() + sum(self.unit_params(u.kind) for u in self.units
                                                 if not layers.mtp.shares_weights(self, u)) + self.output_params()
        if self.moe or self.mla or self.mtp_num_layers:
            from search.layers.moe_params import counts
            return counts(self).total
        return self.embedding_params() + sum(self.unit_params(u.kind) for u in self.units) + self.output_params()

    # ----- FLOPs -----------------------------------------------------------------------------------------------
    def unit_forward_flops(self, kind: UnitKind, tokens_per_sample: int, kv_len: int | None = None,
                           causal: bool = True) -> float:
        """Forward FLOPs of one unit per sample: 2 per multiply-add of the linears and of the attention core
        (its kind's formula, ``search.layers``); ``kv_len``: keys per query (default: the tokens).

        ``causal`` halves nothing here: like Megatron's reported TFLOP/s, the full score matrix is counted.
        """
        return layers.resolve(self, kind).flops(self, tokens_per_sample, kv_len)

    def forward_flops_per_sample(self) -> float:
        """Forward FLOPs for one sample through the whole model, logits included."""
        s_enc = self.seq_length
        s_dec = self.decoder_seq_length if self.is_t5 else self.seq_length
        total = 0.0
        for u in self.units:
            s = s_enc if u.stack == "encoder" else s_dec
            kind = layers.resolve(self, u.kind)
            total += kind.flops(self, s, kind.keys(self, u, s, s_enc))
        total += 2.0 * s_dec * self.hidden_size * self.padded_vocab_size
        return total

    def training_flops_per_sample(self) -> float:
        """Forward + backward (2x forward), without recompute."""
        return 3.0 * self.forward_flops_per_sample()

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per (decoder) token."""
        s_dec = self.decoder_seq_length if self.is_t5 else self.seq_length
        return self.training_flops_per_sample() / s_dec
