"""bench/hybrid_published.py's row reader: a published Nemotron run becomes the plan of the hybrid preset its
settings describe (checked against the settings the row states, each sourced in bench/data/nemotron3_published.json),
Nemotron-3 Super's LatentMoE and shared-MTP rows included."""

from __future__ import annotations

import pytest

from bench_modules import load

hp = load("hybrid_published")


def _row(prefix: str) -> dict:
    return next(r for r in hp.load() if r["id"].startswith(prefix))


def test_nano_h100_row_is_the_plan_its_settings_say():
    row = _row("26.04.01/pretrain/nemotron-3-nano/h100x16/fp8-cs")
    s = row["settings"]
    plan, _notes = hp.row_plan(row)
    st = plan.stages[0]
    assert plan.model.name == "nemotron-3-nano" and plan.model.num_units == 52
    assert (st.tp, st.dp, st.ep, st.sequence_parallel) == (s["tp"], s["dp"], s["ep"], s["sequence_parallel"])
    assert plan.micro_batch_size == s["mbs"] * s["dp"] and plan.global_batch_size == s["gbs"]
    assert plan.num_micro_batches == s["ga"]
    assert plan.settings.low_precision.recipe == "fp8-tensorwise"        # fp8 hybrid, tensorwise scaling
    assert plan.moe.token_dispatcher == "flex" and plan.model.moe.moe_router_force_load_balancing
    # selective recompute of core_attn / moe_act / layernorm: attention and MoE units selective, Mamba units none
    kinds = {u.kind: rc for u, rc in zip(plan.model.units, st.chunks[0].recompute)}
    assert kinds["mamba"] == "none" and kinds["attention"] != "none" and kinds["moe"] != "none"
    x = hp.price_row(row)
    assert x["status"] == "priced" and x["fits"]
    # the recipe graphs the Mamba layers only (cuda_graph_scope [mamba]), a scope no plan holds: nothing is graphed
    # (it was read as --cuda-graph-impl with no scope, megatron-core's whole layers, MoE and attention included)
    assert s["cuda_graphs"]["scope"] == ["mamba"] and (plan.settings.stack is None or plan.settings.stack.cuda_graphs is None)


def test_super_nvfp4_row_is_the_plan_its_settings_say():
    """Nemotron-3 Super (LatentMoE, one MTP layer run at 2 depths) at its published gb200 NVFP4 shape: tp 2 with
    SP, ep 64, its last 14 layers in bf16 (the recipe's first_last_layers_bf16), what the plan cannot hold noted."""
    row = _row("26.04.01/pretrain/nemotron-3-super/gb200x64/nvfp4")
    s, p = row["settings"], row["settings"]["precision"]
    plan, notes = hp.row_plan(row)
    st, m = plan.stages[0], plan.model
    assert m.moe.moe_latent_size == 1024 and m.mtp_num_layers == 2 and m.mtp_use_repeated_layer
    assert (st.tp, st.dp, st.ep, st.sequence_parallel) == (s["tp"], s["dp"], s["ep"], s["sequence_parallel"])
    assert plan.settings.low_precision.recipe == "nvfp4"
    assert plan.settings.low_precision.bf16_layers_end == p["num_layers_at_end_in_bf16"] == 14
    assert any(n.startswith("per-module precision") for n in notes)
    x = hp.price_row(row)
    assert x["status"] == "priced" and x["fits"]


@pytest.mark.parametrize("prefix", ["26.04.01/pretrain/nemotron-3-nano/gb300x8", "dgxc-v25.05.05/pretrain/nemotron-h-56b/h100x32/"])
def test_rows_price_at_their_published_shape(prefix):
    row = _row(prefix)
    x = hp.price_row(row)
    tokens = row["settings"]["gbs"] * 8192 / (x["iteration_ms"] / 1000) / row["gpus"]
    assert x["predicted"] == pytest.approx(tokens) and x["error"] == pytest.approx(tokens / row["measured"] - 1)
