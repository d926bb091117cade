"""Users' own megatron-core layer specs, as a team would write them, for the tests of ``layer_spec`` (torch).

- ``qk_norm_squared_relu``: megatron-core's local GPT layer with QK-layernorm and an MLP whose activation is
  squared ReLU (a subclass of megatron-core's ``MLP``) with an extra projection before ``linear_fc1``, its ``mlp``
  slot written as the installed megatron-core's stock spec writes it (``patches.compat.with_mlp_class``); the same
  layer written for one release: ``qk_norm_squared_relu_v016`` (a ``ModuleSpec`` of the MLP class, megatron-core
  0.16's style) and ``qk_norm_squared_relu_v019`` (``partial(ProjectedMLP.as_mlp_submodule, submodules=...)``,
  0.19's);
- ``t5_encoder`` / ``t5_decoder``: megatron-core's local T5 layers with the squared-ReLU MLP;
- ``parallel_block``: a GPT-J-style layer (attention and MLP read the same normed input and add to one residual),
  a ``TransformerLayer`` subclass with its own ``forward``: it cannot be split into units and runs whole;
- the faults: ``not_a_spec`` (returns a dict), ``raises``, ``not_a_layer`` (a ModuleSpec of an MLP), ``moe``
  (an MoE mlp), ``SPEC_OBJECT`` (a ModuleSpec itself, not a function: accepted), ``cuda_stream`` (an MLP that
  creates a ``torch.cuda.Stream``: it needs CUDA).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.T5 import t5_spec
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from patches.compat import mlp_submodules, with_mlp_class


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 2


class SquaredReLUMLP(MLP):
    """megatron-core's MLP with squared ReLU as its activation (``config.activation_func`` stays GELU)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation_func = squared_relu


class ProjectedMLP(SquaredReLUMLP):
    """The squared-ReLU MLP behind an extra (replicated) projection of its input."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.linear_in = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=False,
                                         dtype=config.params_dtype)

    def forward(self, hidden_states, **kwargs):
        return super().forward(self.linear_in(hidden_states), **kwargs)


def _with_mlp(spec: ModuleSpec, mlp_class: type) -> ModuleSpec:
    mlp = with_mlp_class(spec.submodules.mlp, mlp_class)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def qk_norm_squared_relu() -> ModuleSpec:
    return _with_mlp(get_gpt_layer_local_spec(qk_layernorm=True), ProjectedMLP)


def _with_mlp_slot(spec: ModuleSpec, mlp) -> ModuleSpec:
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def qk_norm_squared_relu_v016() -> ModuleSpec:
    """The layer as a megatron-core 0.16 user wrote it: the MLP slot a ``ModuleSpec`` of the subclass."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    return _with_mlp_slot(spec, ModuleSpec(module=ProjectedMLP, submodules=mlp_submodules(spec.submodules.mlp)))


def qk_norm_squared_relu_v019() -> ModuleSpec:
    """The layer as a megatron-core 0.19 user writes it: the MLP slot the subclass's ``as_mlp_submodule`` builder."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    return _with_mlp_slot(spec, functools.partial(ProjectedMLP.as_mlp_submodule,
                                                  submodules=mlp_submodules(spec.submodules.mlp)))


def t5_encoder() -> ModuleSpec:
    return _with_mlp(t5_spec.encoder_model_with_local_spec(), SquaredReLUMLP)


def t5_decoder() -> ModuleSpec:
    return _with_mlp(t5_spec.decoder_model_with_local_spec(), SquaredReLUMLP)


class ParallelBlock(TransformerLayer):
    """h + attention(norm(h)) + mlp(norm(h)) (GPT-J / PaLM), with megatron-core's submodules."""

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                **kwargs):
        x = self.input_layernorm(hidden_states)
        attn, attn_bias = self.self_attention(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        mlp, mlp_bias = self.mlp(x)
        out = hidden_states + attn + mlp
        for b in (attn_bias, mlp_bias):
            if b is not None:
                out = out + b
        return out, context


def parallel_block() -> ModuleSpec:
    spec = get_gpt_layer_local_spec()
    return dataclasses.replace(spec, module=ParallelBlock)


SPEC_OBJECT = get_gpt_layer_local_spec(qk_layernorm=True)


def not_a_spec():
    return {"module": "TransformerLayer"}


def raises():
    raise RuntimeError("no spec for you")


def not_a_layer() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=None, linear_fc2=None))


def moe() -> ModuleSpec:
    return get_gpt_layer_local_spec(num_experts=4)


class CudaStreamMLP(MLP):
    """megatron-core's MLP that keeps a side CUDA stream of its own (raises without CUDA, as torch does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.side_stream = torch.cuda.Stream()


def cuda_stream() -> ModuleSpec:
    return _with_mlp(get_gpt_layer_local_spec(), CudaStreamMLP)
