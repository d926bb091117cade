"""LatentMoE (``moe.moe_latent_size``) and the shared MTP layer (``mtp_use_repeated_layer``) against hand-written
formulas (megatron-core 0.19.2 ``MoELayer``: the router reads h, ``fc1_latent_proj`` h -> l before the dispatch, the
routed experts l -> f -> l, ``fc2_latent_proj`` l -> h after the combine, the shared expert at h;
``MultiTokenPredictionBlock`` with ``mtp_use_repeated_layer``: one layer built, run at every depth), with the
datasheet constants of tests/unit/test_moe_cost.py (H100 989 TFLOP/s bf16, 3350 GB/s HBM, NVLink 450 GB/s at 80%)
and the flat kernel model, never by calling the code under test for the expected number. The parameter counts of
the Nemotron-3 Super preset against its published HF checkpoint are in test_hybrid_specs.py /
test_hybrid_model_spec.py."""

from __future__ import annotations

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.kernels import GPU_EFFICIENCY, LAUNCH_MS
from search.costmodel.moe_cost import moe_unit
from search.costmodel.optimizers import muon_matrices
from search.settings.moe_plan import MoEPlanSettings
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from search.spec.training import TrainingSpec

PEAK, HBM, NVLINK = 989e9, 3350e6, 450e6 * 0.8
T, H, L, E, K, F, DT = 1024, 1024, 256, 8, 2, 512, 2       # tokens, hidden, latent, experts, top-k, expert ffn, bf16


def _model(latent: int | None = L, **kw) -> ModelSpec:
    moe = {"num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": F, "moe_latent_size": latent}
    return ModelSpec(**{**dict(name="latent", family="llama", num_layers=2, hidden_size=H, num_attention_heads=8,
                               ffn_hidden_size=2048, seq_length=T, vocab_size=32000, activation="gelu",
                               normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                               tied_embeddings=False, params_dtype="bf16", moe=moe), **kw})


def _src(m, cluster="1x8-h100", **training):
    cl = parse_cluster(cluster)
    return AnalyticSource(m, cl, TrainingSpec(global_batch_size=8, **training), CommModel(cl), kernels="flat")


def test_latent_size_is_left_out_of_a_dump_when_unset():
    """A model without LatentMoE dumps (and a plan of it digests) as before the field existed."""
    assert "moe_latent_size" not in _model(None).model_dump()["moe"]
    assert _model().model_dump()["moe"]["moe_latent_size"] == L
    assert "mtp_use_repeated_layer" not in _model(None).model_dump()


def test_latent_moe_parameters_by_hand():
    """Per MoE layer: norm h, router E h, two latent projections 2 h l, E experts of (l f + f l)."""
    m = _model()
    layer = H + E * H + 2 * H * L + E * (L * F + F * L)
    attention = H + H * (H + 2 * H) + H * H          # input norm, QKV (8 heads, 8 groups), projection
    assert m.num_parameters == 2 * (attention + layer) + 2 * 32000 * H + H
    assert m.num_parameters - _model(None).num_parameters == 2 * (2 * H * L + E * 2 * F * (L - H))


def test_latent_moe_flops_by_hand():
    """Forward per sample: router 2 s h E, the latent projections 2 x 2 s h l, k experts at the latent width."""
    m = _model()
    want = 2 * T * H * E + 2 * 2 * T * H * L + K * 2 * T * (L * F + F * L)
    assert m.unit_forward_flops("moe", T) == pytest.approx(want, rel=1e-12)


def test_latent_moe_unit_by_hand():
    """b 1, s 1024, tp 1, ep 4 (one node), etp 1, gelu, flat kernels: the latent model's forward minus the plain
    one's is the two latent GEMMs, the experts' GEMMs at l instead of h, the permute at l and the all-to-all of
    l-wide tokens (the dispatcher's buffers are sized by moe_latent_size)."""
    e = GPU_EFFICIENCY["h100"]
    gemm = lambda fl: fl / (PEAK * e.gemm) + LAUNCH_MS        # noqa: E731
    grouped = lambda fl: fl / (PEAK * e.bmm) + LAUNCH_MS      # noqa: E731
    m_e = T * K * 4 / E

    def own(w):     # the terms that depend on the expert width w
        experts = grouped(2 * 2 * m_e * F * w) + grouped(2 * 2 * m_e * w * F)
        perm = (DT * T * w + T * K * (DT * w + 4)) / (HBM * e.mem)
        dispatch = 0.003 + (T * K * w * DT + 4 * T * K) * 3 / 4 / NVLINK
        combine = 0.003 + T * K * w * DT * 3 / 4 / NVLINK
        return experts + perm + dispatch + combine, dispatch + combine

    (lat_own, lat_a2a), (plain_own, plain_a2a) = own(L), own(H)
    latent_gemms = gemm(2 * T * L * H + 2 * T * H * L)       # the flat model: one kernel per group of GEMMs
    args = (1.0, T, 1, False, 4, 1, MoEPlanSettings())
    lat, lat_act, lat_params, lat_experts = moe_unit(_src(_model()), *args)
    plain, plain_act, *_ = moe_unit(_src(_model(None)), *args)
    assert lat.fwd - plain.fwd == pytest.approx(latent_gemms + lat_own - plain_own, rel=1e-9)
    assert lat.ep_comm == pytest.approx(2 * lat_a2a, rel=1e-9)
    assert plain.ep_comm == pytest.approx(2 * plain_a2a, rel=1e-9)
    # kept: the experts' fc1 input at l (m = T k copies) and fc2_latent_proj's input (dt T l)
    assert plain_act[0] - lat_act[0] == pytest.approx(DT * T * K * (H - L) - DT * T * L)
    # per rank (optimizer state, gradients): E / ep = 2 local experts at l, the latent projections whole
    assert lat_experts == 2 * (L * F + F * L)
    assert lat_params == lat_experts + H + E * H + 2 * H * L


def test_latent_projections_stay_whole_under_tp():
    """tp 2 (SP): the projections are TE linears in ``duplicated`` mode: whole on each rank, run on the rank's
    T / 2 tokens; the experts stay at ep x etp."""
    m = _model()
    _, _, p1, x1 = moe_unit(_src(m), 1.0, T, 1, False, 4, 1, MoEPlanSettings())
    _, _, p2, x2 = moe_unit(_src(m), 1.0, T, 2, True, 4, 1, MoEPlanSettings())
    assert x1 == x2 and p1 == p2
    mats = muon_matrices(m, "moe", 2, ep=4, etp=1)      # (rows, cols, count) of the rank's 2-D shards
    assert (L, H, 1) in mats and (H, L, 1) in mats and (F, L, 2) in mats and (L, F, 2) in mats


def _mtp_model(repeated: bool) -> ModelSpec:
    return _model(mtp_num_layers=2, mtp_use_repeated_layer=repeated)


def test_repeated_mtp_counts_its_weights_once():
    """Two MTP depths of one shared layer: the model has one MTP layer's parameters fewer than with two layers
    (enorm, hnorm, final norm 3 h, eh_proj 2 h h, a layer like the last: attention + MoE)."""
    attention = H + H * (H + 2 * H) + H * H
    moe = H + E * H + 2 * H * L + E * (L * F + F * L)
    block = 3 * H + 2 * H * H + attention + moe
    assert _mtp_model(False).num_parameters - _mtp_model(True).num_parameters == block
    assert _mtp_model(True).num_parameters == _model().num_parameters + block


def test_repeated_mtp_depths_cost_compute_and_activations_per_depth():
    """On the unit table both depths take the same time and keep the same bytes; the second holds no weights, so
    the stage's parameters (and its gradients and optimizer state) are one MTP layer's fewer."""
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=8)
    rep, sep = _mtp_model(True), _mtp_model(False)
    tabs = [make_cost_model(m, cl, tr).unit_table(1, 1, ep=4, etp=1, moe=MoEPlanSettings())
            for m in (rep, sep)]
    i, j = [k for k, u in enumerate(rep.units) if u.kind == "mtp"]
    for tab in tabs:
        assert tab.fwd_ms[i] == tab.fwd_ms[j] and tab.bwd_ms[i] == tab.bwd_ms[j]
        assert (tab.act_mb[i] == tab.act_mb[j]).all()
    assert tabs[0].weight_params[j] == 0 and tabs[1].weight_params[j] == tabs[1].weight_params[i] > 0
    assert tabs[0].fwd_ms[j] == tabs[1].fwd_ms[j]
    one = parse_cluster("1x1-h100")
    plans = [uniform_plan(m, 1, 1, 1, 1, 8, cluster=one) for m in (rep, sep)]
    costs = [make_cost_model(m, one, tr).evaluate(p) for m, p in zip((rep, sep), plans)]
    assert costs[0].stages[0].memory_breakdown["params"] < costs[1].stages[0].memory_breakdown["params"]


def test_repeated_mtp_needs_mtp_layers():
    with pytest.raises(ValueError, match="mtp_use_repeated_layer needs mtp_num_layers"):
        _model(mtp_use_repeated_layer=True)


@pytest.mark.parametrize("update, needle", [({}, "moe.moe_latent_size (256): the aceso runtime does not build")])
def test_the_runtime_refuses_them_before_any_process_group(tmp_path, capsys, update, needle):
    """The one pre-flight (capability table, runtime column): ``aceso validate`` of a runtime plan exits 2 with one
    line naming the field and the fix; Megatron-LM runs it. (The shared MTP layer the runtime builds on megatron-core
    0.19; 0.16.1's refusal is the runtime's own: tests/runtime/test_preflight.py.)"""
    from search.targets.capabilities import model_refusal
    from search.cli import main

    m = _model().model_copy(update=update)
    assert needle in model_refusal("aceso", m) and model_refusal("megatron-lm", m) is None
    path = tmp_path / "plan.json"
    path.write_text(uniform_plan(m, 1, 1, 1, 1, 8, cluster=parse_cluster("1x1-h100")).to_json())
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_the_planner_offers_the_shared_mtp_layer_to_the_runtime():
    """The runtime builds megatron-core 0.19's shared MTP layer (tests/distributed/test_hybrid_plans.py): no target's
    model row refuses it."""
    from search.targets.capabilities import model_refusal

    m = _model().model_copy(update={"moe": {"num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": F},
                                    "mtp_num_layers": 2, "mtp_use_repeated_layer": True})
    assert model_refusal("aceso", m) is None and model_refusal("megatron-lm", m) is None


def test_fused_weighted_squared_relu_keeps_no_activation_output():
    """Squared-ReLU experts (Nemotron-3): unfused, the probs multiply keeps the activation output (dt m f per local
    expert's m tokens, beside the fc2 input); TEGroupedMLP's weighted_squared_relu_impl keeps its input and the
    probs only (megatron-core 0.16.1 / 0.19 experts.py). m = T k = 2048 token copies over the rank's experts."""
    m = _model(None, activation="squared_relu")
    src = _src(m)
    plain = moe_unit(src, 1.0, T, 1, False, 4, 1, MoEPlanSettings())[1]
    fused = moe_unit(src, 1.0, T, 1, False, 4, 1, MoEPlanSettings(fused_weighted_squared_relu=True))[1]
    assert plain[0] - fused[0] == pytest.approx(DT * T * K * F)
    assert plain[1] == pytest.approx(fused[1])             # moe_act frees both anyway
    assert "fused_weighted_squared_relu" not in MoEPlanSettings().model_dump()


def test_fused_weighted_squared_relu_flag_both_ways():
    """--use-fused-weighted-squared-relu (every supported Megatron-LM release) and the runtime's stage config."""
    from aceso_megatron.model.moe import stage_fields
    from search.megatron import megatron_config
    from search.megatron.importer import read_megatron
    from search.megatron.script import args_line

    m = _model(None, activation="squared_relu")
    p = uniform_plan(m, 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-h100"),
                     moe=MoEPlanSettings(fused_weighted_squared_relu=True))
    p = p.model_copy(update={"stages": [p.stages[0].model_copy(update={"ep": 4})]})
    line = args_line(megatron_config(p))
    assert "--use-fused-weighted-squared-relu" in line
    assert read_megatron(line, world_size=4).plan.moe.fused_weighted_squared_relu
    assert stage_fields(p, 0, cuda=False, te=False)["use_fused_weighted_squared_relu"] is True
