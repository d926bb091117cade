"""One model chunk of a pipeline stage, built from megatron-core modules.

A stage holds one chunk (or, interleaved, ``v`` chunks: chunk ``j`` of stage ``s`` is model chunk ``j * S + s``),
each a span of units ``[start_unit, end_unit)``; each unit is a megatron-core ``TransformerLayer``
built from the unit spec (``model_specs.builders.unit_spec``: the layer spec, stock or the user's ``layer_spec``,
with the other halves as ``IdentityOp``; ``attn_dropout`` units with ``aceso_megatron.model.attention``'s core
attention), with the unit's config (its stage's tp, its selective recompute) and its global layer number; a layer
that cannot be carved runs whole (``aceso_megatron.model.layers``).
The first chunk of the first stage adds megatron-core's ``LanguageModelEmbedding``; the last chunk of the last
stage the final norm, the output layer (``ColumnParallelLinear``, vocab-sharded) and the per-token loss. RoPE
(no parameters; plain, Llama 3.x-scaled or YaRN: ``rotary``) is on every chunk. Either of those two chunks may
hold no unit (the plan's ``holds_only``, Megatron-LM's ``E|...`` / ``...|L``): the unit list is then empty and the
chunk runs only the embedding, or only the final norm, output layer and loss, as a ``GPTModel`` chunk with a
zero-layer ``TransformerBlock`` does.

Sequence parallelism (a stage's ``sequence_parallel``): the config flag does the rest in megatron-core's modules
(the embedding scatters the sequence, column-parallel linears all-gather it, row-parallel ones reduce-scatter,
the output layer gathers); here the torch norms become ``norms.SequenceParallelNorm``, RoPE covers the full
sequence, and the units run in the rng tracker's fork as megatron-core's ``TransformerBlock`` runs its layers
(hidden dropout then differs per TP rank, on its own tokens). The fast paths (layer specs, fusions) are
``fast_path.choose``'s.

Layers are placed here, not by ``pipeline_model_parallel_layout``: that path reads the global pipeline rank and
would silently build the wrong layers with per-stage groups.

``GPTStage`` is a GPT/Llama stage; ``T5Stage`` a T5 stage (encoder output carried along with the activations).
``canonical_names()`` maps each parameter to its name in a plain single-process megatron-core ``GPTModel`` /
``T5Model`` (``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...), the key of plan-independent
initialisation and of the full-model gradients the tests compare.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from model_specs.builders import final_norm_spec
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan

from . import hybrid, lowprec, moe, mtp, rotary, softmax_offset
from .attention import attention_mismatch, fall_back_with_te
from .config import stage_config, without_grad_accum_fusion
from .fast_path import Environment, FastPath, choose
from .layers import UnitLayer, build_unit_layers  # noqa: F401  (UnitLayer re-exported)
from .loss import vocab_parallel_cross_entropy
from .norms import sequence_parallel_norm, with_sequence_parallel_norms

# transformer-engine fuses a layer's norms into the next linear; the canonical (local-spec) names of those weights
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
             "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}

log = logging.getLogger(__name__)
_UNIT_PREFIXES = ("units.", "decoder.layers.")   # a chunk's unit layers: a ModuleList, or its HybridStack's


def local_layer_name(name: str) -> str:
    """A layer parameter's name in megatron-core's local spec (transformer-engine's fused norm weights renamed):
    the key that makes TE and local checkpoints interchangeable."""
    for te_name, local in _TE_NORMS.items():
        if name.startswith(te_name):
            return local + name[len(te_name):]
    return name


class _Stage(MegatronModule):
    """What GPT and T5 chunks share: unit layers, pipeline input, the output head and the per-token loss."""

    def __init__(self, plan: ParallelPlan, stage: int, pg_collection, device: str, chunk: int = 0,
                 fast: FastPath | None = None, per_token_loss: bool = False):
        model: ModelSpec = plan.model
        st = plan.stages[stage]
        span = st.chunks[chunk]
        self.fast = fast or choose(Environment.detect(device), model, plan.tp_comm_overlap)
        config = stage_config(model, st.tp, device, cp=st.cp, sequence_parallel=st.sequence_parallel,
                              fast=self.fast, moe=moe.stage_fields(plan, stage, device != "cpu", self.fast.te),
                              low=plan.settings.low_precision if plan.settings is not None else None,
                              per_token_loss=per_token_loss)
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.spec = model
        self.pg_collection = pg_collection
        self.stage, self.chunk = stage, chunk
        # routed experts of this EP rank: local expert i is the stock model's expert ep_rank * local + i
        self._ep_rank = pg_collection.ep.rank() if model.moe is not None else 0
        self._local_experts = model.moe.num_experts // st.ep if model.moe is not None else 0
        if plan.num_virtual_stages > 1:
            self.vp_stage = chunk  # megatron-core's schedule checks it against the chunk it runs
        self.pre_process = stage == 0 and chunk == 0
        self.post_process = stage == plan.num_stages - 1 and chunk == plan.num_virtual_stages - 1
        self.share_embeddings_and_output_weights = model.tied_embeddings
        self.input_tensor = None
        self.te = self.fast.te
        if self.pre_process and (msg := attention_mismatch(plan, self.te, device)):
            log.warning(msg)
        units = list(model.units[span.start_unit:span.end_unit])
        n_mtp = sum(u.kind == mtp.UNIT for u in units)   # the MTP units end the last chunk (mtp.block_spec)
        recompute = fall_back_with_te(span.recompute, self.te, stage)[:len(units) - n_mtp]
        layer_units = units[:len(units) - n_mtp]
        layers = build_unit_layers(model, layer_units, recompute, config, pg_collection, self.te,
                                   transform=with_sequence_parallel_norms if config.sequence_parallel else None)
        # megatron-core 0.19: the units placed by HybridStack from the chunk's layer pattern (model.hybrid);
        # ``units`` is then its layer list (not registered twice)
        stack = hybrid.build_stack(model, layer_units, layers, span.start_unit, config, pg_collection)
        if stack is not None:
            self.decoder = stack
            object.__setattr__(self, "units", stack.layers)
        else:
            self.units = torch.nn.ModuleList(layers)
        if n_mtp:   # named as GPTModel's; absent otherwise (megatron-core's schedule walks ``mtp.layers`` if present)
            self.mtp = mtp.build_block(model, config, pg_collection, self.te)

    @property
    def mtp_block(self):
        """The chunk's ``MultiTokenPredictionBlock`` (the ``mtp`` units), or None."""
        return getattr(self, "mtp", None)

    def _embedding(self, max_len: int, kind: str) -> LanguageModelEmbedding:
        return LanguageModelEmbedding(config=self.config, vocab_size=self.spec.padded_vocab_size,
                                      max_sequence_length=max_len, position_embedding_type=kind,
                                      tp_group=self.pg_collection.tp)

    def _norm(self):
        c = self.config
        spec = final_norm_spec(self.spec, self.te)
        if c.sequence_parallel:
            spec = sequence_parallel_norm(spec)
        return build_module(spec, config=c, hidden_size=c.hidden_size, eps=c.layernorm_epsilon)

    def units_context(self):
        """The context the units run in: the rng tracker's fork under sequence parallelism (as megatron-core's
        ``TransformerBlock``: dropout on sequence-sharded activations differs per TP rank), and in the recipe's
        block context (``lowprec.block_context``: delayed scaling's one FP8 context; otherwise each unit enters
        its own)."""
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else None
        return lowprec.entered(rng or contextlib.nullcontext(), lowprec.block_context(self.config))

    def _output_layer(self, has_embedding: bool, bias: bool) -> tensor_parallel.ColumnParallelLinear:
        c = self.config if self.fast.output_layer_grad_accum_fusion else without_grad_accum_fusion(self.config)
        return tensor_parallel.ColumnParallelLinear(
            c.hidden_size, self.spec.padded_vocab_size, config=c, init_method=c.init_method, bias=bias,
            skip_bias_add=False, gather_output=False,
            skip_weight_param_allocation=has_embedding and self.share_embeddings_and_output_weights,
            tp_group=self.pg_collection.tp,
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    # local name prefix -> its name in the single-process megatron-core model (per subclass)
    _RENAMES: dict[str, str] = {}

    def canonical_names(self) -> dict[str, str]:
        """Local parameter name -> name in a single-process megatron-core ``GPTModel``/``T5Model``."""
        out = {}
        for name, _ in self.named_parameters():
            if name.startswith(_UNIT_PREFIXES):
                out[name] = self._unit_name(name)
            elif name == "output_layer.weight" and self.share_embeddings_and_output_weights:
                out[name] = "embedding.word_embeddings.weight"
            elif name.startswith("mtp.") and self._local_experts:   # GPTModel's names; experts by global index
                out[name] = moe.global_expert_name(name, self._ep_rank, self._local_experts)
            else:
                out[name] = next((new + name[len(old):] for old, new in self._RENAMES.items()
                                  if name.startswith(old)), name)
        return out

    def _unit_name(self, name: str) -> str:
        prefix = next(p for p in _UNIT_PREFIXES if name.startswith(p))
        idx, rest = name[len(prefix):].split(".", 1)
        unit = self.units[int(idx)].unit
        name = f"{unit.stack}.layers.{unit.layer}.{local_layer_name(rest[len('layer.'):])}"
        return moe.global_expert_name(name, self._ep_rank, self._local_experts) if self._local_experts else name


class GPTStage(_Stage):
    """A GPT/Llama pipeline stage; ``forward`` returns the hidden states, or on the last stage the loss [b, s]."""

    def __init__(self, plan: ParallelPlan, stage: int, pg_collection, device: str = "cpu", chunk: int = 0,
                 fast: FastPath | None = None, per_token_loss: bool = False):
        super().__init__(plan, stage, pg_collection, device, chunk, fast, per_token_loss)
        model = self.spec
        if self.pre_process or self.mtp_block is not None:   # MTP embeds the shifted tokens (a copy after stage 0)
            kind = "learned_absolute" if model.position_embedding == "learned" else "none"
            self.embedding = self._embedding(model.seq_length, kind)
        # plain, Llama 3.x-scaled or YaRN RoPE as GPTModel builds it (None: learned positions, MLA's own RoPE)
        self.rotary_pos_emb = rotary.build(model, self.config, pg_collection.cp)
        if self.post_process:
            self.final_layernorm = self._norm()
            self.output_layer = self._output_layer(hasattr(self, "embedding"), bias=False)

    def rotary_table(self, seq_len: int) -> torch.Tensor | None:
        """RoPE's angle table for ``seq_len`` positions, as the units take it (None without RoPE)."""
        return rotary.table(self.rotary_pos_emb, seq_len)

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "embedding") and self.share_embeddings_and_output_weights:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, input_ids=None, position_ids=None, labels=None, loss_mask=None):
        """``loss_mask`` feeds the MTP loss of a chunk with the MTP block (``mtp.mtp_loss``), as ``GPTModel``'s."""
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids, position_ids=position_ids)
        else:
            hidden = self.input_tensor
        # the full sequence: attention sees it whole (SP all-gathers it; RoPE slices its CP share itself)
        rotary = self.rotary_table(self.spec.seq_length)
        with self.units_context():
            for unit in self.units:
                hidden = unit(hidden, rotary_pos_emb=rotary)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(hidden)
        if self.mtp_block is not None:
            # (under SP each MTP layer forks the rng tracker itself)
            hidden = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden,
                              attention_mask=None, rotary_pos_emb=rotary, embedding=self.embedding)
            hidden = mtp.mtp_loss(self, hidden, labels, loss_mask)
        logits, _ = self.output_layer(hidden, weight=self.output_weight())
        return self._loss(logits, labels)

    _RENAMES = {"final_layernorm.": "decoder.final_layernorm."}


class T5Stage(_Stage):
    """A T5 pipeline stage. The activation between stages is the encoder hidden states ``[s_enc, b, h]`` while
    the encoder runs, then ``cat([encoder output, decoder hidden], dim=0)``: the encoder output travels with the
    activations to every decoder stage (its gradient flows back the same way).

    Embeddings (shared by encoder and decoder input, as in ``T5Model``) sit on the first stage and on the stage
    of the first decoder unit; the encoder's final norm right after the last encoder unit; the decoder's final
    norm and the LM head (tied: embedding weight + a vocab-sharded bias) on the last stage.
    """

    def __init__(self, plan: ParallelPlan, stage: int, pg_collection, device: str = "cpu", chunk: int = 0,
                 fast: FastPath | None = None, per_token_loss: bool = False):
        super().__init__(plan, stage, pg_collection, device, chunk, fast, per_token_loss)
        model = self.spec
        st = plan.stages[stage]
        n_enc = model.num_encoder_units
        self.s_enc, self.s_dec = model.seq_length, model.decoder_seq_length
        # the encoder output's share of a decoder stage's input [enc; dec] (each part sequence-sharded under SP)
        self.s_enc_local = self.s_enc // st.tp if self.config.sequence_parallel else self.s_enc
        self.starts_decoder = st.start_unit <= n_enc < st.end_unit  # holds the first decoder unit
        self.ends_encoder = st.start_unit < n_enc <= st.end_unit  # holds the last encoder unit
        self.in_decoder = st.start_unit > n_enc  # receives encoder output + decoder hidden
        self.receives_encoder_output = st.start_unit == n_enc and stage > 0
        if self.pre_process or self.starts_decoder:
            self.embedding = self._embedding(max(self.s_enc, self.s_dec), "learned_absolute")
        if self.ends_encoder:
            self.encoder_final_layernorm = self._norm()
        if self.post_process:
            self.decoder_final_layernorm = self._norm()
            has_emb = hasattr(self, "embedding")
            self.output_layer = self._output_layer(has_emb, bias=model.tied_embeddings)
        self.seq_out = self.s_enc if st.end_unit <= n_enc else self.s_enc + self.s_dec

    def _embed(self, ids):
        pos = torch.arange(ids.size(1)).unsqueeze(0).expand_as(ids)
        return self.embedding(input_ids=ids, position_ids=pos)

    def forward(self, enc_ids=None, dec_ids=None, labels=None):
        enc_mask = torch.zeros(1, 1, self.s_enc, self.s_enc, dtype=torch.bool)  # no padding
        cross_mask = torch.zeros(1, 1, self.s_dec, self.s_enc, dtype=torch.bool)
        enc = dec = enc_out = None
        if self.pre_process:
            enc = self._embed(enc_ids)
        elif self.in_decoder:
            enc_out, dec = self.input_tensor[:self.s_enc_local], self.input_tensor[self.s_enc_local:]
        elif self.receives_encoder_output:
            enc_out = self.input_tensor
        else:
            enc = self.input_tensor
        with self.units_context():
            for unit in self.units:
                if unit.unit.stack == "encoder":
                    enc = unit(enc, attention_mask=enc_mask)
                    continue
                if dec is None:  # first decoder unit
                    if enc_out is None:
                        enc_out = self.encoder_final_layernorm(enc)
                    dec = self._embed(dec_ids)
                dec = unit(dec, context=enc_out, context_mask=cross_mask)
        if dec is None:
            return self.encoder_final_layernorm(enc) if self.ends_encoder else enc
        if not self.post_process:
            return torch.cat([enc_out, dec], dim=0)
        weight = self.embedding.word_embeddings.weight if (
            hasattr(self, "embedding") and self.share_embeddings_and_output_weights) else self.output_layer.weight
        logits, _ = self.output_layer(self.decoder_final_layernorm(dec), weight=weight)
        return self._loss(logits, labels)

    _RENAMES = {"encoder_final_layernorm.": "encoder.final_layernorm.",
                "decoder_final_layernorm.": "decoder.final_layernorm.", "output_layer.": "lm_head.output_layer."}


def build_stage(plan: ParallelPlan, stage: int, pg_collection, device: str = "cpu", chunk: int = 0,
                fast: FastPath | None = None, per_token_loss: bool = False) -> _Stage:
    """Model chunk ``chunk`` of stage ``stage`` (one-chunk plans: the stage's only chunk); ``per_token_loss``:
    megatron-core's ``calculate_per_token_loss`` (``engine``)."""
    cls = T5Stage if plan.model.is_t5 else GPTStage
    built = cls(plan, stage, pg_collection, device, chunk, fast, per_token_loss)
    softmax_offset.mark_tp_split(built)   # GPT-OSS's attention sinks: split over TP like the query heads
    return built
