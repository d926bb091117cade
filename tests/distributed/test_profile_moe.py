"""CPU end to end for MoE: ``aceso profile`` of a tiny MoE llama (a dense first layer, a shared expert) at ep 1
and 2 on 2 gloo processes, with megatron-core's own MoELayer as the runtime builds it; the database's moe rows
carry the expert shape, the routed experts' bytes (checked by hand) and the forward split into the layer's parts,
the comm profile the all-to-all over the 2-rank EP group; the profile cost model then prices an MoE plan from
exactly the measured rows (the reader round trip) and refuses an expert shape that was not profiled."""

from __future__ import annotations

import json

import numpy as np
import pytest

from search.io.errors import AcesoError
from tests.distributed.test_profile_e2e import aceso

H, F, FS, E = 32, 32, 16, 4
TINY_MOE = {"name": "tiny-llama-moe", "family": "llama", "num_layers": 2, "hidden_size": H, "num_attention_heads": 4,
            "num_query_groups": 2, "ffn_hidden_size": 48, "seq_length": 16, "vocab_size": 128, "activation": "swiglu",
            "normalization": "rmsnorm", "position_embedding": "rope", "tied_embeddings": False,
            "add_bias_linear": False, "params_dtype": "fp32",
            "moe": {"num_experts": E, "moe_router_topk": 2, "moe_ffn_hidden_size": F,
                    "moe_shared_expert_intermediate_size": FS, "first_k_dense_layers": 1}}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile-moe")
    spec = d / "moe.json"
    spec.write_text(json.dumps(TINY_MOE))
    r = aceso("profile", "--model", spec, "--tp", "1", "--ep", "1", "2", "--micro-batch-sizes", "1", "2", "-o",
              d / "db.json", "--cpu", "--warmup", "1", "--repeats", "3", "--max-bytes", 4096, "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    return spec, d / "db.json"


def test_moe_rows(profiled):
    _spec, db = profiled
    d = json.loads(db.read_text())
    rows = {(u["kind"], u.get("ep"), u["batch"]): u for u in d["units"]}
    assert set(rows) == ({(k, None, b) for k in ("attention", "mlp") for b in (1, 2)}
                         | {("moe", ep, b) for ep in (1, 2) for b in (1, 2)})
    experts = E * (H * 2 * F + F * H) * 4                 # SwiGLU experts: h x 2f and f x h, fp32
    for (kind, ep, b), u in rows.items():
        assert u["fwd_us"] > 0 and u["bwd_us"] > 0
        if kind != "moe":
            continue
        assert (u["etp"], u["dispatcher"], u["grouped_gemm"], u["permute_fusion"]) == (1, "alltoall", False, False)
        assert u["expert_weight_bytes"] == experts / ep
        # + pre-MLP RMSNorm, router (E x h), shared expert (h x 2 fs and fs x h)
        assert u["weight_bytes"] == experts / ep + 4 * (H + E * H + H * 2 * FS + FS * H)
        assert set(u["parts_fwd_us"]) == {"router", "dispatch", "experts", "combine", "shared_expert",
                                          "norm_residual"}
        assert u["parts_fwd_us"]["experts"] > 0 and u["parts_fwd_us"]["router"] > 0
        assert len(u["act_bytes"]) == 3 and u["act_bytes"][2] == 4 * 16 * b * H   # full: the unit input only
    assert d["model"]["moe"]["num_experts"] == E and "first_k_dense_layers" not in d["model"]["moe"]
    a2a = d["all_to_all"][0]
    assert a2a["group"] == 2 and [p[0] for p in a2a["points"]] == [1024, 4096]


def _cost_model(spec, db):
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.spec.presets import load_model
    from search.spec.training import TrainingSpec

    model = load_model(str(spec))
    tr = TrainingSpec(global_batch_size=8, micro_batch_sizes=[1, 2], precision="fp32")
    return model, make_cost_model(model, parse_cluster("1x2-cpu"), tr, kind="profile", db=db)


def test_the_cost_model_prices_the_measured_rows(profiled):
    spec, db = profiled
    d = json.loads(db.read_text())
    model, cm = _cost_model(spec, db)
    kinds = [u.kind for u in model.units]
    assert kinds == ["attention", "mlp", "attention", "moe"]
    for ep in (1, 2):
        for b in (1, 2):
            t = cm.source.unit_table(b, 1, ep=ep)
            for i, kind in enumerate(kinds):
                row = next(u for u in d["units"] if (u["kind"], u["batch"], u.get("ep", ep)) == (kind, b, ep))
                assert t.fwd_ms[i] == pytest.approx(row["fwd_us"] / 1e3)
                assert t.bwd_ms[i] == pytest.approx(row["bwd_us"] / 1e3)
                rec = np.array(row["recompute_us"]) / 1e3
                assert t.recompute_ms[i, :len(rec)] == pytest.approx(rec)
            row = next(u for u in d["units"] if (u["kind"], u["batch"], u.get("ep")) == ("moe", b, ep))
            assert t.expert_params[3] == row["expert_weight_bytes"] / 4
            parts = row["parts_fwd_us"]
            assert t.ep_comm_ms[3] == pytest.approx(2 * (parts["dispatch"] + parts["combine"]) / 1e3)
    assert cm.source.warnings == []


def test_an_moe_plan_is_priced_and_an_unprofiled_shape_refused(profiled):
    from search.spec.plan import parse_plan

    spec, db = profiled
    model, cm = _cost_model(spec, db)
    raw = {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 8,
           "stages": [{"num_gpus": 2, "tp": 1, "dp": 2, "ep": 2, "start_unit": 0, "end_unit": 4,
                       "recompute": ["none"] * 4}]}
    cost = cm.evaluate(parse_plan(raw, world_size=2))
    t = cm.source.unit_table(1, 1, ep=2)
    assert cost.iteration_ms > 4 * float(t.fwd_ms.sum() + t.bwd_ms.sum())    # 4 micro-batches of the units
    with pytest.raises(AcesoError, match=r"tp1 ep4 etp1 alltoall \(measured: tp1 ep1 etp1 alltoall, tp1 ep2"):
        cm.source.unit_table(1, 1, ep=4)
