"""The single-process reference: a stock megatron-core ``GPTModel`` (or ``T5Model``; on megatron-core 0.19 also
``HybridModel``, ``hybrid=True``) built the usual way (``parallel_state``, ``get_gpt_layer_local_spec`` or the model's
own ``layer_spec``, megatron-core DDP and optimizer with its own gradient clipping, the no-pipelining schedule), with
the same plan-independent initial weights as the runtime.

Tests compare the runtime under any plan with this model; ``bench/runtime_overhead.py`` times it.
Needs a 1-process ``torch.distributed`` group and ``parallel_state.initialize_model_parallel()``
(``init_single_process`` does both).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from search.spec.model import ModelSpec
from search.spec.rope_scaling import rotary_kwargs

from ..model.config import stage_config
from ..model.rotary import position_embedding_type
from ..model.init import initialize
from ..training.engine import TrainConfig


def init_single_process(port: int) -> None:
    """A 1-rank gloo group and megatron-core's global parallel state (tp = pp = 1)."""
    from megatron.core import parallel_state

    from patches import cpu_mode

    cpu_mode.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized() and not _groups_live(parallel_state):
        parallel_state.destroy_model_parallel()   # an earlier run's groups, whose process group is destroyed since
    if not parallel_state.model_parallel_is_initialized():
        if parallel_state._GLOBAL_MEMORY_BUFFER is not None:  # made by a runtime built earlier in this process
            parallel_state.destroy_global_memory_buffer()
        parallel_state.initialize_model_parallel()


def _groups_live(parallel_state) -> bool:
    """Whether ``parallel_state``'s groups belong to the current process group (a run that destroyed its process
    group without ``destroy_model_parallel`` leaves groups torch no longer knows)."""
    try:
        dist.get_rank(parallel_state.get_pipeline_model_parallel_group())
        dist.get_rank(parallel_state.get_tensor_model_parallel_group())
    except (ValueError, RuntimeError, AssertionError):
        return False
    return True


def _decoder_spec(model: ModelSpec, config):
    """The stock decoder spec: one layer spec, or for an MoE model megatron-core's block spec (dense and
    ``MoELayer`` layers by ``moe_layer_freq``, ``SequentialMLP`` experts)."""
    from model_specs.builders import layer_spec

    if model.moe is None or model.layer_spec_path("decoder"):
        return layer_spec(model, "decoder", te=False)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    norm = "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm"
    # pp_rank 0: the reference is one stage (megatron-core 0.19 asks parallel_state otherwise, whose groups may be a
    # former test's, destroyed since)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=norm, pp_rank=0)
    if model.mla is None:
        return block
    from model_specs.mla_core import with_mla_core   # the local MLA core as the runtime builds it

    return dataclasses.replace(block, layer_specs=[with_mla_core(s) for s in block.layer_specs])


def hybrid_model(model: ModelSpec, config):
    """Stock ``HybridModel`` (megatron-core 0.19) of ``model``: its hybrid layer pattern (``model.hybrid_layer_pattern``,
    or a dense GPT / Llama model's units as ``*-`` per layer), with megatron-core's local layers -- the attention
    layer a ``TransformerLayer`` of its input norm, self-attention and residual add, the MLP layer ``MLPLayer`` of
    its pre-MLP norm, MLP and residual add (both from the local GPT layer spec), the MoE layer
    ``MoETransformerLayer`` of its pre-MLP norm, the local GPT spec's ``MoELayer`` (``SequentialMLP`` experts) and
    residual add, the Mamba layer megatron-core's local Mamba layer (``get_mamba_stack_modelopt_spec``: ``MambaLayer``
    with ``MambaMixer``, column- / row-parallel projections; its norm the local norm), the GDN layer megatron-core's
    local one (the same spec's ``gdn_layer``: ``TransformerLayer`` with ``GatedDeltaNet``, its two norms the local
    norm) -- and the local final norm in
    ``HybridStack``'s ``final_norm`` (which it builds as transformer-engine's ``TENorm`` whatever the spec: no
    ``HybridModel`` builds without TE otherwise). Returns (module, local name -> canonical GPT name)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from model_specs.builders import final_norm_spec, gpt_layer_spec

    from ..model.hybrid import pattern

    text = model.hybrid_layer_pattern or pattern(model, list(model.units))
    if text is None or model.mla is not None or model.layer_spec or (model.mtp_num_layers and
                                                                      not model.hybrid_layer_pattern):
        raise ValueError(f"{model.name}: the stock HybridModel reference covers GPT / Llama hybrids without MLA or a "
                         "layer spec only (MTP: as the pattern's '/' part)")
    full = gpt_layer_spec(model, te=False).submodules        # a dense layer (MoE: layer None picks no experts)
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=full.input_layernorm, self_attention=full.self_attention, self_attn_bda=full.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=full.pre_mlp_layernorm, mlp=full.mlp, mlp_bda=full.mlp_bda))
    slots = {"attention_layer": attention, "mlp_layer": mlp}
    if "E" in text:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        norm = "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm"
        experts = get_gpt_layer_local_spec(num_experts=model.moe.num_experts, normalization=norm).submodules
        slots["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=experts.pre_mlp_layernorm, mlp=experts.mlp, mlp_bda=experts.mlp_bda))
    if "M" in text:
        from megatron.core.post_training.modelopt.mamba.model_specs import get_mamba_stack_modelopt_spec

        local = get_mamba_stack_modelopt_spec().submodules.mamba_layer
        mixer = dataclasses.replace(local.submodules.mixer, params={
            "chunk_size": model.mamba.chunk_size, "d_conv": model.mamba.d_conv, "expand": model.mamba.expand})
        slots["mamba_layer"] = dataclasses.replace(local, submodules=dataclasses.replace(
            local.submodules, norm=final_norm_spec(model, te=False), mixer=mixer))
    if "G" in text:    # megatron-core's own local GDN layer (the modelopt hybrid spec), its norms the local norm
        from megatron.core.post_training.modelopt.hybrid.model_specs import get_hybrid_stack_modelopt_spec

        local = get_hybrid_stack_modelopt_spec(local_core_attention=True).submodules.gdn_layer
        norm, mixer = final_norm_spec(model, te=False), local.submodules.self_attention
        slots["gdn_layer"] = dataclasses.replace(local, submodules=dataclasses.replace(
            local.submodules, input_layernorm=norm, self_attention=dataclasses.replace(
                mixer, submodules=dataclasses.replace(mixer.submodules, out_norm=norm))))
    if "/" in text:    # HybridModel's MTP block (its stock spec with the local norms and eh_proj)
        slots["mtp_block_spec"] = _local_mtp_block_spec(final_norm_spec(model, te=False))
    stack = ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                       submodules=HybridStackSubmodules(**slots))
    m = HybridModel(config, stack, vocab_size=model.padded_vocab_size, max_sequence_length=model.seq_length,
                    hybrid_layer_pattern=text, share_embeddings_and_output_weights=model.tied_embeddings,
                    position_embedding_type=position_embedding_type(model),
                    rotary_base=int(model.rotary_base), rotary_percent=model.rotary_percent)
    m.decoder.final_norm = build_module(final_norm_spec(model, te=False), config=config,
                                        hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    m.decoder.post_layer_norm = True

    def canonical(name: str) -> str:
        if name.startswith("mtp.layers.") and ".mtp_model_layer.layers." in name:   # GPTModel's one inner layer
            head, rest = name.split(".mtp_model_layer.layers.", 1)
            return f"{head}.mtp_model_layer.{rest.split('.', 1)[1]}"
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{model.units[int(idx)].layer}.{rest}"
        return name.replace("decoder.final_norm.", "decoder.final_layernorm.")

    return m, {n: canonical(n) for n, _ in m.named_parameters()}


def _local_mtp_block_spec(norm):
    """megatron-core 0.19's ``hybrid_layer_specs._hybrid_mtp_block_spec`` without transformer-engine: the MTP layer's
    ``enorm`` / ``hnorm`` / final ``layer_norm`` the local norm, ``eh_proj`` a column-parallel linear, its inner
    layers built by ``HybridStack`` from the pattern's '/' part."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))


class Reference:
    """Stock GPTModel/T5Model (``hybrid``: HybridModel, megatron-core 0.19) + DDP + megatron-core optimizer, one
    process. Gradients and parameters are given by canonical (GPTModel) name."""

    def __init__(self, model: ModelSpec, seed: int = 1234, train_config: TrainConfig | None = None,
                 global_batch_size: int = 1, hybrid: bool = False):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from model_specs.builders import layer_spec

        if model.moe is not None:
            from patches import moe_router_without_te

            moe_router_without_te.apply()
        if model.moe is not None and model.add_bias_linear:
            from patches import expert_bias_out_of_place     # the fc2 bias of a SequentialMLP expert, out of place

            expert_bias_out_of_place.apply()
        if model.mla is not None:
            from patches import mla_without_te

            mla_without_te.apply()
        if model.mamba is not None:
            from patches import mamba_cpu     # megatron-core's MambaMixer on reference kernels without mamba-ssm

            mamba_cpu.apply()
        if model.gdn is not None:
            from patches import gdn_cpu       # megatron-core's GatedDeltaNet on reference kernels without fla

            gdn_cpu.apply()
        tc = train_config or TrainConfig()
        self.spec, self.tc = model, tc
        model_parallel_cuda_manual_seed(seed)
        per_token = tc.calculate_per_token_loss      # megatron-core's own normalisation, either way
        if model.is_t5:
            from megatron.core.models.T5 import T5Model

            config = stage_config(model, 1, num_layers=model.num_decoder_layers, per_token_loss=per_token)
            enc_config = stage_config(model, 1, num_layers=model.num_layers, per_token_loss=per_token)
            enc_spec, dec_spec = layer_spec(model, "encoder", te=False), layer_spec(model, "decoder", te=False)
            self.gpt = T5Model(
                config=config, encoder_config=enc_config, transformer_encoder_layer_spec=enc_spec,
                transformer_decoder_layer_spec=dec_spec, vocab_size=model.padded_vocab_size,
                max_sequence_length=max(model.seq_length, model.decoder_seq_length),
                share_embeddings_and_output_weights=model.tied_embeddings,
            )
        elif hybrid:
            config = stage_config(model, 1)
            self.gpt, names = hybrid_model(model, config)
        else:
            config = stage_config(model, 1, per_token_loss=per_token)
            spec = _decoder_spec(model, config)
            mtp = None
            if model.mtp_num_layers:   # megatron-core's MTP block after the decoder's last layer spec
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

                mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
            self.gpt = GPTModel(
                config=config, transformer_layer_spec=spec, mtp_block_spec=mtp,
                vocab_size=model.padded_vocab_size, max_sequence_length=model.seq_length,
                share_embeddings_and_output_weights=model.tied_embeddings,
                position_embedding_type=position_embedding_type(model),
                rotary_base=int(model.rotary_base), rotary_percent=model.rotary_percent,
                **rotary_kwargs(model),
            )
        std = tc.std_for(model)
        config.init_method_std = std
        if not hybrid:
            names = {n: n for n, _ in self.gpt.named_parameters()}
        self.names = names
        initialize(self.gpt, names, model, seed, 1, 0, std)
        self.model = DistributedDataParallel(
            config, DistributedDataParallelConfig(overlap_grad_reduce=False), self.gpt
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
                            adam_beta2=tc.adam_beta2, clip_grad=tc.clip_grad, params_dtype=torch.float32),
            [self.model],
        )
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
        self.config = config

    def forward_backward(self, micro_batches: list[dict]) -> float:
        from megatron.core.pipeline_parallel.schedules import (
            forward_backward_no_pipelining,
        )

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        m = self.spec

        def step(it, model):
            b = next(it)
            if m.is_t5:
                enc_mask = torch.zeros(1, 1, m.seq_length, m.seq_length, dtype=torch.bool)
                cross_mask = torch.zeros(1, 1, m.decoder_seq_length, m.seq_length, dtype=torch.bool)
                out = model(b["enc_tokens"], b["dec_tokens"], enc_mask, None, cross_mask, lm_labels=b["labels"])
            else:
                tokens = b["tokens"]
                pos = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
                out = model(tokens, pos, None, labels=b["labels"], loss_mask=b.get("loss_mask"))
            mask = b.get("loss_mask")

            def loss_func(per_token):   # Megatron-LM core_v0.16.1 pretrain_gpt.loss_func
                losses = per_token.view(-1).float()
                mask_1d = torch.ones_like(losses) if mask is None else mask.view(-1).float()
                s = torch.sum(losses * mask_1d)
                n = mask_1d.sum().clone().detach().to(torch.int)
                return s, n, {"sum": s.detach().clone(), "n": int(n)}

            return out, loss_func

        store = forward_backward_no_pipelining(
            forward_step_func=step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=len(micro_batches), seq_length=self.spec.seq_length,
            micro_batch_size=micro_batches[0]["labels"].size(0),
        )
        return float(sum(float(d["sum"]) for d in store) / sum(d["n"] for d in store))

    def train_step(self, micro_batches: list[dict]) -> float:
        loss = self.forward_backward(micro_batches)
        self.optimizer.step()
        return loss

    def grads(self) -> dict[str, torch.Tensor]:
        return {self.names[n]: p.main_grad.detach().clone() for n, p in self.gpt.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        return {self.names[n]: p.detach().clone() for n, p in self.gpt.named_parameters()}

    def expert_biases(self) -> dict[str, torch.Tensor]:
        from ..parallel.gather import expert_biases

        return expert_biases(self.gpt.named_modules(), self.names)


_STOCK_RUNS: dict[tuple, dict] = {}


def stock_run(raw: dict, seed: int, train_config: TrainConfig, steps: int, loss_mask: bool = False,
              hybrid: bool = False) -> dict:
    """What the stock single-process model does on plan ``raw``'s model and batches (``make_batches`` with ``seed``
    and ``loss_mask``): the losses of ``steps`` optimizer steps, the gradients of the first and the parameters after
    the last, and the routers' expert biases after the last. ``hybrid``: the stock model is megatron-core 0.19's ``HybridModel`` (else ``GPTModel`` / ``T5Model``).

    Its micro-batch is Megatron-LM's ``--micro-batch-size``: the samples one rank of the plan's loss stage gets (the
    pipeline micro-batch / that stage's DP), so each micro-batch is normalised by its own token count as it would
    be on that rank (``calculate_per_token_loss`` off). It depends on the plan's model, that micro-batch and the
    global batch only (not its stages or features: that is the equivalence the tests check), so it is computed once
    per process for each of those with ``seed``, ``train_config`` and ``steps``; plans sharing them (most plans of
    a test file) get a copy of that run."""
    from search.spec.plan import ParallelPlan

    p = ParallelPlan.model_validate(raw)
    per_rank = p.micro_batch_per_rank(p.num_stages - 1)
    key = (p.model.model_dump_json(), p.micro_batch_size, per_rank, p.global_batch_size, seed, repr(train_config),
           steps, loss_mask, hybrid)
    if key not in _STOCK_RUNS:
        _STOCK_RUNS[key] = _stock_run(p, seed, train_config, steps, per_rank, loss_mask, hybrid)
    got = _STOCK_RUNS[key]
    return {"losses": list(got["losses"]), "grads": {k: v.clone() for k, v in got["grads"].items()},
            "params": {k: v.clone() for k, v in got["params"].items()},
            "expert_bias": {k: v.clone() for k, v in got["expert_bias"].items()}}


def _stock_run(p, seed: int, train_config: TrainConfig, steps: int, per_rank: int, loss_mask: bool,
               hybrid: bool = False) -> dict:
    from ..model.mtp import reset_loss_tracker
    from . import make_batches

    from patches.compat import reset_moe_metrics

    reset_loss_tracker()      # megatron-core's process-wide MTP loss log, sized by the last MTP model's depth
    reset_moe_metrics()       # and its MoE aux-loss log, sized by the first MoE model's layers + MTP depths
    ref = Reference(p.model, seed=seed, train_config=train_config, hybrid=hybrid)
    batches = [{k: v[i:i + per_rank] for k, v in b.items()}      # the plan's micro-batches, rank by rank
               for b in make_batches(p.model, p.micro_batch_size, p.global_batch_size, seed, loss_mask)
               for i in range(0, p.micro_batch_size, per_rank)]
    losses = [ref.forward_backward(batches)]
    grads = ref.grads()
    ref.optimizer.step()
    losses += [ref.train_step(batches) for _ in range(steps - 1)]
    return {"losses": losses, "grads": grads, "params": ref.params(), "expert_bias": ref.expert_biases()}
