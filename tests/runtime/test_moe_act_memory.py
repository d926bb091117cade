"""What megatron-core 0.16.1's ``MoELayer`` keeps for backward, measured with saved-tensor hooks on CPU, against
``search.costmodel.moe_cost.moe_act_bytes``.

The layer is megatron-core's own (local spec: ``SequentialMLP`` experts, the allgather dispatcher, unfused
permute; fp32), one process. Routing is random, so the per-expert split varies, but a dropless layer always
computes ``m = T k`` token copies; the tensors that depend on the hidden width h are then exactly the experts'
fc1 input (``m h``), and on the expert width f the activation input, the activation output the probs multiply
saves and the fc2 input. So the kept bytes' differences between two widths are what the model's must be: the
router's and the permutation's index tensors cancel. The point they prove: nothing of size ``T k h`` is kept after
fc2 (megatron-core applies the routing probs inside the experts' activation and unpermutes without probs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from search.spec.model import ModelSpec

T, H, E, K, FFN = 64, 32, 4, 2, 24


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())
    from patches import moe_router_without_te

    moe_router_without_te.apply()     # megatron-core 0.16.1's router needs it without transformer-engine


def _spec(h: int, f: int, activation: str) -> ModelSpec:
    return ModelSpec(name="t", family="llama", num_layers=1, hidden_size=h, num_attention_heads=4,
                     ffn_hidden_size=2 * f, seq_length=T, vocab_size=128, activation=activation,
                     normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                     tied_embeddings=False, params_dtype="fp32",
                     moe={"num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": f})


def _kept(m: ModelSpec) -> int:
    """Bytes megatron-core's MoELayer keeps after one forward of T tokens (its input and parameters excluded)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from patches.compat import build_mlp

    from aceso_megatron.profiler.memory import SavedTensors

    cfg = TransformerConfig(num_layers=1, hidden_size=m.hidden_size, num_attention_heads=4,
                            ffn_hidden_size=m.ffn_hidden_size, add_bias_linear=False, normalization="RMSNorm",
                            gated_linear_unit=m.gated_mlp, activation_func=F.silu if m.gated_mlp else F.gelu,
                            use_cpu_initialization=True, params_dtype=torch.float32, num_moe_experts=E,
                            moe_router_topk=K, moe_ffn_hidden_size=m.moe.moe_ffn_hidden_size,
                            moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")  # alltoall: a CUDA stream
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False).layer_specs[0].submodules.mlp
    torch.manual_seed(0)
    moe = build_mlp(spec, cfg, layer_number=1)
    x = torch.randn(T, 1, m.hidden_size, requires_grad=True)
    with SavedTensors(exclude=[x], params=list(moe.parameters())) as saved:
        out, _ = moe(x)
    kept = saved.nbytes
    out.square().sum().backward()      # the graph was whole
    assert x.grad is not None
    return kept


def _model(m: ModelSpec) -> float:
    from search.spec.cluster import parse_cluster
    from search.costmodel.analytic import AnalyticSource
    from search.costmodel.comm import CommModel
    from search.costmodel.moe_cost import moe_act_bytes
    from search.settings.moe_plan import MoEPlanSettings
    from search.spec.training import TrainingSpec

    cl = parse_cluster("1x1-cpu")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=1, precision="fp32"), CommModel(cl), kernels="flat")
    return moe_act_bytes(src, 1.0, T, 1, 1, 1, MoEPlanSettings(token_dispatcher="allgather"))[0]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_hidden_width_costs_only_the_experts_fc1_input(single_process, activation):
    """+16 hidden: megatron-core keeps 4 m 16 more bytes (the fc1 input; no T k h expert output), the model too
    (its norm input and output, outside megatron-core's MoELayer, add 2 x 4 T 16)."""
    a, b = _spec(H, FFN, activation), _spec(H + 16, FFN, activation)
    measured = _kept(b) - _kept(a)
    assert measured == 4 * T * K * 16
    assert _model(b) - _model(a) == pytest.approx(measured + 2 * 4 * T * 16)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_width_costs_what_the_unfused_activation_keeps(single_process, activation):
    """+8 expert width: gelu keeps its input, its output (saved by the probs multiply) and the fc2 input: 3 m 8
    floats; SwiGLU its 2f-wide input, the silu output, the (x_linear + offset) copy the gate multiply saves, the
    gated product the probs multiply saves and the fc2 input: 6 m 8. The model (the cpu "GPU" runs the unfused
    path) says the same."""
    a, b = _spec(H, FFN, activation), _spec(H, FFN + 8, activation)
    measured = _kept(b) - _kept(a)
    assert measured == 4 * T * K * 8 * (6 if activation == "swiglu" else 3)
    assert _model(b) - _model(a) == pytest.approx(measured)
