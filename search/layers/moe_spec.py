"""Mixture-of-Experts, Multi-Latent Attention and multi-token prediction as model-spec data (issue 22, part 1).

``MoESpec`` and ``MLASpec`` are ``ModelSpec``'s optional ``moe`` and ``mla`` blocks; ``ModelSpec.mtp_num_layers`` is
the MTP depth. Field names are megatron-core 0.16.1's ``TransformerConfig`` / ``MLATransformerConfig`` names (and
Megatron-LM's flags with ``_`` for ``-``), so a preset reads like the Megatron-Bridge recipe that trains it. Counts
live in ``search.layers.moe_params``.

The analytic cost model prices them (``search/costmodel/moe_cost.py``, ``mla_mtp.py``); ``refuse_unpriced`` is the
one check every pricing entry calls (search, explain, baseline, validate, import, export), so what it does not
price is refused with one line instead of being priced as a dense model, and the runtime, the profile-db and
aceso-compat cost models refuse every MoE / MLA / MTP feature with their own reason. docs/moe.md says what is built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from search.io.errors import AcesoError
from search.settings.moe_plan import drop_defaults

MAX_EXPERTS = 1 << 14
# megatron-core's load-balancing types (TransformerConfig moe_router_load_balancing_type); the three aux losses
# take moe_aux_loss_coeff, sinkhorn refuses one (router.py ``sinkhorn_load_balancing``'s assert)
LB_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
MAX_MTP = 64
_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class MoESpec(BaseModel):
    """Experts in megatron-core's terms: which layers are MoE, their experts, the router, token dropping and the
    load-balance assumption a cost model prices under."""

    model_config = _STRICT

    num_experts: int = Field(gt=1, le=MAX_EXPERTS, description="Routed experts per MoE layer (megatron-core "
                             "num_moe_experts, Megatron-LM --num-experts).")
    moe_router_topk: int = Field(gt=0, le=MAX_EXPERTS, description="Routed experts each token goes to.")
    moe_ffn_hidden_size: int = Field(gt=0, le=1 << 20, description="Inner width of one routed expert's MLP (the "
                                     "model's activation; swiglu doubles the first linear).")
    moe_shared_expert_intermediate_size: int | None = Field(
        None, gt=0, le=1 << 22, description="Inner width of the shared expert(s) every token also runs, all shared "
        "experts together (DeepSeek: n_shared_experts x moe_intermediate_size); None = no shared expert.")
    moe_shared_expert_gate: bool = Field(
        False, description="The shared expert's output scaled by a learned sigmoid gate, sigmoid(x w) with w a "
        "1 x hidden_size weight per MoE layer (HF Qwen2-MoE's shared_expert_gate; megatron-core's "
        "moe_shared_expert_gate, Megatron-LM --moe-shared-expert-gate, every release from 0.16.1). Needs "
        "moe_shared_expert_intermediate_size.")
    moe_layer_freq: int | list[Literal[0, 1]] = Field(
        1, description="Which layers are MoE: N = every N-th layer (layer i when i % N == 0), or one 0/1 per "
        "layer (1 = MoE), as Megatron-LM's --moe-layer-freq.")
    first_k_dense_layers: int = Field(0, ge=0, le=4096, description="The first k layers stay dense (DeepSeek's "
                                      "first_k_dense_replace); with an integer moe_layer_freq only.")
    moe_router_score_function: Literal["softmax", "sigmoid"] = Field("softmax", description="Router score: softmax "
                                                                     "(Mixtral, Qwen3) or sigmoid (DeepSeek-V3).")
    moe_router_num_groups: int | None = Field(None, gt=0, le=MAX_EXPERTS, description="Group-limited routing: "
                                              "experts fall in this many groups (device-limited routing).")
    moe_router_group_topk: int | None = Field(None, gt=0, le=MAX_EXPERTS, description="Group-limited routing: "
                                              "groups each token may pick experts from.")
    moe_router_enable_expert_bias: bool = Field(False, description="Aux-loss-free balancing: a per-expert score "
                                                "bias (a buffer, not a parameter; DeepSeek-V3).")
    moe_router_bias_update_rate: float = Field(1e-3, ge=0, description="How far each step moves an expert's bias "
                                               "towards balance (megatron-core's moe_router_bias_update_rate, "
                                               "Megatron-LM --moe-router-bias-update-rate; default 1e-3). Numerics "
                                               "only; read with moe_router_enable_expert_bias.")
    moe_router_pre_softmax: bool = Field(False, description="A softmax router's softmax over all experts' scores "
                                         "before the top-k, so the top-k weights are not renormalized (HF "
                                         "norm_topk_prob false; megatron-core's moe_router_pre_softmax). Numerics "
                                         "only; a sigmoid router ignores it, and a top-1 softmax router needs it "
                                         "(the exports write it there).")
    moe_aux_loss_coeff: float = Field(0.0, ge=0, le=1, description="Load-balancing auxiliary loss coefficient.")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = \
        Field("aux_loss", description="megatron-core's moe_router_load_balancing_type (Megatron-LM "
              "--moe-router-load-balancing-type; default aux_loss, as both): aux_loss over the micro-batch, "
              "seq_aux_loss per sequence (DeepSeek-V3), global_aux_loss over the global batch, sinkhorn routing "
              "(needs coefficient 0), none. An aux-loss type at coefficient 0 runs as none (``lb_type``).")
    moe_expert_capacity_factor: float | None = Field(
        None, gt=0, le=1024, description="Token dropping: each expert takes at most this factor times its even "
        "share of tokens; None = dropless (megatron-core's default; a negative factor, as megatron-core reads "
        "it, is dropless too and reads as None).")
    moe_pad_expert_input_to_capacity: bool = Field(
        False, description="With a capacity factor: pad every expert's input to its capacity (Megatron-LM "
        "--moe-pad-expert-input-to-capacity); the dispatcher then needs no device-to-host sync of token counts.")
    moe_router_force_load_balancing: bool = Field(
        False, description="Benchmark only: the router ignores its scores and spreads tokens evenly over the "
        "experts (Megatron-LM --moe-router-force-load-balancing, as NVIDIA's published throughput runs); a model "
        "trained so learns nothing useful. False (default): learned routing, priced at moe_imbalance_factor.")
    moe_latent_size: int | None = Field(
        None, gt=0, le=1 << 20, description="LatentMoE (megatron-core 0.19 moe_latent_size, Nemotron-3 Super / "
        "Ultra): fc1_latent_proj maps h to this width before the dispatch, the routed experts run at it "
        "(latent -> moe_ffn_hidden_size -> latent) and fc2_latent_proj maps back after the combine; the router and "
        "the shared expert stay at h. None = experts at h.")
    moe_imbalance_factor: float = Field(
        1.0, ge=1, le=1024, description="Learned routing: the busiest EP rank's routed tokens over the even "
        "share, which the slowest EP rank (and every all-to-all) waits on; the cost model multiplies that rank's "
        "expert GEMMs and dispatch / combine by it (capped by moe_expert_capacity_factor). 1 = as even as forced "
        "balance (docs/moe.md, 'Routing and load balance').")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Without ``moe_latent_size`` when unset, ``moe_router_pre_softmax`` and ``moe_shared_expert_gate`` when off,
        the bias update rate and the load-balancing type at their defaults: such a model dumps (and a plan digests)
        as before."""
        out = drop_defaults(handler(self), {"moe_latent_size": None, "moe_router_pre_softmax": False,
                                                "moe_router_bias_update_rate": 1e-3, "moe_shared_expert_gate": False})
        if isinstance(out, dict) and out.get("moe_router_load_balancing_type") == "aux_loss":
            del out["moe_router_load_balancing_type"]       # the default: older dumps and digests stay as they were
        return out

    @field_validator("moe_expert_capacity_factor", mode="before")
    @classmethod
    def _dropless(cls, v):
        """A negative capacity factor is dropless: megatron-core sets it None (transformer_config.py:1105-1107)."""
        return None if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0 else v

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be at most num_experts "
                             f"({self.num_experts})")
        if isinstance(self.moe_layer_freq, int) and self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq ({self.moe_layer_freq}) must be at least 1, or a 0/1 list per layer")
        if isinstance(self.moe_layer_freq, list) and self.first_k_dense_layers:
            raise ValueError("first_k_dense_layers works with an integer moe_layer_freq; with a 0/1 list write the "
                             "dense layers as 0s")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError("moe_shared_expert_gate gates the shared expert; set moe_shared_expert_intermediate_size "
                             "or remove the gate (megatron-core ignores a gate without a shared expert)")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError("moe_router_num_groups and moe_router_group_topk go together; set both or neither")
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff:
            raise ValueError(f"moe_router_load_balancing_type sinkhorn takes no aux loss (megatron-core asserts "
                             f"it); set moe_aux_loss_coeff 0, not {self.moe_aux_loss_coeff:g}")
        if self.moe_router_force_load_balancing and self.moe_imbalance_factor != 1.0:
            raise ValueError("moe_imbalance_factor needs moe_router_force_load_balancing false; set it false or "
                             "remove the factor")
        return self

    @property
    def lb_type(self) -> str:
        """The load balancing megatron-core runs: the type, but ``none`` for an aux-loss type at coefficient 0
        (megatron-core then computes no aux loss; the runtime and the exports write ``none``)."""
        t = self.moe_router_load_balancing_type
        return "none" if t in AUX_LOSS_TYPES and not self.moe_aux_loss_coeff else t

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) is an MoE layer."""
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer])
        return layer >= self.first_k_dense_layers and layer % self.moe_layer_freq == 0

    def check_layers(self, num_layers: int) -> None:
        """The layer pattern fits a model of ``num_layers`` (ValueError, one line)."""
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != num_layers:
            raise ValueError(f"moe.moe_layer_freq lists {len(self.moe_layer_freq)} layers but num_layers is "
                             f"{num_layers}; give one 0/1 per layer")
        if self.first_k_dense_layers >= num_layers:
            raise ValueError(f"moe.first_k_dense_layers ({self.first_k_dense_layers}) leaves no MoE layer in "
                             f"{num_layers} layers; lower it")


class MLASpec(BaseModel):
    """Multi-Latent Attention (DeepSeek-V2/V3, Kimi-K2) in megatron-core's ``MLATransformerConfig`` terms."""

    model_config = _STRICT

    q_lora_rank: int | None = Field(None, gt=0, le=1 << 18, description="Query down-projection rank; None = a "
                                    "full query projection (DeepSeek-V2-Lite).")
    kv_lora_rank: int = Field(gt=0, le=1 << 18, description="Compressed key/value latent width.")
    qk_head_dim: int = Field(gt=0, le=1 << 14, description="Per-head query/key width without RoPE (HF "
                             "qk_nope_head_dim).")
    qk_pos_emb_head_dim: int = Field(gt=0, le=1 << 14, description="Per-head query/key RoPE width (HF "
                                     "qk_rope_head_dim), its key part shared by all heads.")
    v_head_dim: int = Field(gt=0, le=1 << 14, description="Per-head value width.")


def check_model(model) -> None:
    """Cross-field rules of a ``ModelSpec`` that carries MoE / MLA / MTP (ValueError, one line)."""
    if model.is_t5 and (model.moe or model.mla or model.mtp_num_layers):
        raise ValueError("moe, mla and mtp_num_layers are for gpt/llama decoders, not t5; remove them")
    if model.moe is not None:
        model.moe.check_layers(model.num_layers)


def moe_features(model) -> list[str]:
    """The MoE / MLA / MTP features of ``model`` (empty: a dense model)."""
    out = []
    if model.moe is not None:
        out.append(f"MoE ({model.moe.num_experts} experts, top-{model.moe.moe_router_topk})")
    if model.mla is not None:
        out.append("multi-latent attention")
    if model.mtp_num_layers:
        out.append(f"{model.mtp_num_layers} MTP layer(s)")
    return out


def unpriced_features(model) -> list[str]:
    """The features of ``model`` the analytic cost model does not price (empty: it prices the model). It prices
    MoE layers (``costmodel/moe_cost.py``), MLA and MTP (``costmodel/mla_mtp.py``); what it approximates is
    written there (group-limited routing as plain top-k, the aux loss's kernels not counted, flex as alltoall)."""
    return []


def refuse_unpriced(model, reason: str | None = None) -> None:
    """The one check where models enter pricing: what the analytic cost model does not price is refused
    (``AcesoError``, exit 2) rather than priced as if it were dense. With a ``reason`` (the runtime's plan check,
    the profile-db and aceso-compat cost models) every MoE / MLA / MTP feature is refused with it."""
    what = moe_features(model) if reason else unpriced_features(model)
    if what:
        raise AcesoError(f"model {model.name}: {', '.join(what)}: " + (reason or (
            "the cost model does not price this yet (docs/moe.md)")))
