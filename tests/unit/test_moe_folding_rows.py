"""bench/moe_published.py's "folding paper" group (bench/data/moe_folding_paper.json): the FLOP count that turns a
predicted iteration into TFLOP/s is Megatron-LM's own ``num_floating_point_operations`` (read from the checkout
``ACESO_MEGATRON_LM`` names, core_v0.16.1 to core_v0.19.0, and run on hand-written arguments of the published configs); every row either
carries the Megatron-LM arguments it ran or says what is missing; the arguments import to the settings the row
states; the qwen2-57b-a14b preset against its published size."""

import ast
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from search.layers.moe_params import counts
from search.spec.presets import load_model

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "bench" / "data" / "moe_folding_paper.json"


@pytest.fixture(scope="module")
def mp():
    spec = importlib.util.spec_from_file_location("moe_published_bench", ROOT / "bench" / "moe_published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _top_level(path: Path, name: str) -> ast.FunctionDef | None:
    return next((n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name),
                None)


def _megatron_flops_fn():
    """Megatron-LM's ``num_floating_point_operations``, its source taken from training.py and run alone, with the
    helper it calls at module level taken from the same checkout: ``is_hybrid_model`` (core_v0.17+,
    ``megatron/training/utils``; 0.16.1 reads ``args.is_hybrid_model``). The linear-attention helper it calls is only
    reached for gated-DeltaNet models, none here; the hybrid branch's imports are inside the function (not reached)."""
    root = os.environ.get("ACESO_MEGATRON_LM")
    training = Path(root or "/nonexistent") / "megatron" / "training"
    path = training / "training.py"
    if not path.is_file():
        pytest.skip("ACESO_MEGATRON_LM (a Megatron-LM checkout, core_v0.16.1 or later) not set")
    body = [_top_level(path, "num_floating_point_operations")]
    for f in [training / "utils.py", *sorted((training / "utils").glob("*.py"))]:
        helper = _top_level(f, "is_hybrid_model") if f.is_file() else None
        if helper is not None:
            body.append(helper)
            break
    ns = {"is_linear_attention_variant": lambda v: v is not None}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns["num_floating_point_operations"]


def _args(**kw):
    base = dict(is_hybrid_model=False, hybrid_override_pattern=None, hybrid_layer_pattern=None,
                group_query_attention=True, multi_latent_attention=False, num_experts=None, moe_layer_freq=1,
                mtp_num_layers=None, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, swiglu=True,
                attention_output_gate=False, experimental_attention_variant=None, moe_latent_size=None)
    return SimpleNamespace(**{**base, **kw})


# The published configurations as Megatron-LM arguments, written from the models' config.json (not from the presets)
CASES = {
    "mixtral-8x22b": _args(num_layers=56, hidden_size=6144, ffn_hidden_size=16384, num_attention_heads=48,
                           num_query_groups=8, kv_channels=128, num_experts=8, moe_router_topk=2,
                           seq_length=4096, padded_vocab_size=32768),
    "qwen3-235b-a22b": _args(num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
                             num_query_groups=4, kv_channels=128, num_experts=128, moe_router_topk=8,
                             moe_ffn_hidden_size=1536, seq_length=4096, padded_vocab_size=151936),
    "qwen2-57b-a14b": _args(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                            num_query_groups=4, kv_channels=128, num_experts=64, moe_router_topk=8,
                            moe_ffn_hidden_size=2560, moe_shared_expert_intermediate_size=20480, seq_length=4096,
                            padded_vocab_size=151936),
    "deepseek-v3": _args(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
                         group_query_attention=False, num_query_groups=128, kv_channels=128,
                         multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                         qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256, moe_router_topk=8,
                         moe_layer_freq=[0] * 3 + [1] * 58, moe_ffn_hidden_size=2048,
                         moe_shared_expert_intermediate_size=2048, mtp_num_layers=1, seq_length=4096,
                         padded_vocab_size=129280),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flop_count_is_megatron_lms(mp, name):
    want = _megatron_flops_fn()(CASES[name], 256)
    assert mp.megatron_moe_flops(load_model(name), 256) == pytest.approx(want, rel=1e-12)


def test_mixtral_flops_by_hand(mp):
    """6 x tokens x (2 of 8 SwiGLU experts + GQA attention with causal half + logits), Mixtral 8x22B."""
    h, s, L, f, V, q, kv = 6144, 4096, 56, 16384, 32768, 6144, 1024
    per_token = 6 * h * f * 3 * 2 * L + 6 * (h * (q + 2 * kv) + q * s + q * h) * L + 6 * h * V
    assert mp.megatron_moe_flops(load_model("mixtral-8x22b"), 1) == pytest.approx(s * per_token, rel=1e-12)


def test_every_row_is_sourced_and_either_runnable_or_says_what_is_missing(mp):
    rows = mp.load_folding_rows(DATA)
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"]["url"].startswith("https://") and r["measured_as_published"], r["id"]
        assert r["measured"], r["id"]
        if r["args"] is None:
            assert r["why_not"], r["id"]
    # the folding paper's two abstract numbers are kept, exactly as published, with everything they leave out
    paper = {r["id"]: r for r in rows if r["id"].startswith("paper/folding/")}
    assert paper["paper/folding/mixtral-8x22b/h100/mfu"]["measured"] == {"mfu": 0.493}
    assert paper["paper/folding/qwen2-57b-a14b/h100/mfu"]["measured"] == {"mfu": 0.39}
    assert all("tp" in r["missing"] and r["args"] is None for r in paper.values())


def _row(mp, start):
    rows = [r for r in mp.load_folding_rows(DATA) if r["id"].startswith(start)]
    assert len(rows) == 1, start
    return rows[0]


def test_arguments_import_to_the_stated_settings(mp):
    """Mixtral 8x22B on 128 H100s: TP2 PP8 VPP7 EP8 (runtime.conf's defaults), 1 layer per chunk, alltoall."""
    r = _row(mp, "zoo/mixtral-8x22b/h100x128/bf16/tp2pp8vp7ep8-alltoall-forced")
    plan = mp.prepare(r)["plan"]
    st = plan.stages[0]
    assert (plan.world_size, plan.num_stages, plan.num_virtual_stages) == (128, 8, 7)
    assert (st.tp, st.ep, st.etp, st.dp) == (2, 8, 1, 8) and plan.global_batch_size == 256
    assert plan.moe.token_dispatcher == "alltoall" and plan.model.padded_vocab_size == 32768


def test_long_context_row_counts_embedding_and_loss(mp):
    """94 layers + embedding + loss over PP8 x VPP4 (--num-layers-per-virtual-pipeline-stage 3): 3 per chunk, the
    first and last one fewer; CP 8 at 128K."""
    r = _row(mp, "zoo/qwen3-235b/h100x256/bf16/seq131072-tp4cp8pp8vp4ep8-forced")
    plan = mp.prepare(r)["plan"]
    starts = plan.model.layer_starts
    chunks = [sum(1 for x in starts[:-1] if c.start_unit <= x < c.end_unit) for _, _, c in plan.chunks_in_order()]
    assert chunks == [2] + [3] * 30 + [2]
    assert (plan.stages[0].cp, plan.model.seq_length, plan.stages[0].tp) == (8, 131072, 4)


def test_priced_row_error_is_against_the_published_tflops(mp):
    r = _row(mp, "zoo/mixtral-8x22b/h100x128/bf16/tp2pp8vp7ep8-alltoall-forced")
    out = mp.price_folding_row(r)
    assert out["status"] == "priced"
    flops = mp.megatron_moe_flops(mp.prepare(r)["plan"].model, 256)
    assert out["tflops"] == pytest.approx(flops / (out["iteration_ms"] / 1e3) / 128 / 1e12)
    assert out["error"] == pytest.approx(out["tflops"] / 465 - 1)


def test_qwen2_57b_a14b_preset_is_the_published_size():
    """Qwen2 technical report (arXiv 2407.10671, table 1): 57.4B parameters; model card: 14B activated."""
    c = counts(load_model("qwen2-57b-a14b"))
    assert c.total / 1e9 == pytest.approx(57.4, rel=0.002)
    assert c.active / 1e9 == pytest.approx(14.0, rel=0.02)


def test_group_mae_is_over_the_fully_stated_rows(mp):
    """A priced row with unstated settings counts in mae_all only; unpriced rows in neither (hand-computed)."""
    rows = [{"status": "priced", "error": 0.10, "missing": [], "fits": True},
            {"status": "priced", "error": -0.30, "missing": [], "fits": True},
            {"status": "priced", "error": 0.50, "missing": ["router balance"], "fits": False},
            {"status": "not priced: settings not stated: tp", "missing": ["tp"]}]
    s = mp.summarize_folding(rows)
    assert (s["priced"], s["complete"], s["missing_settings"]) == (3, 2, 1)
    assert s["mae_complete"] == pytest.approx(0.20) and s["mae_all"] == pytest.approx(0.30)
    assert s["all_fit"] is False and s["median_speedup"] is None
