"""The search's per-stage recompute takes ``mla_up_proj`` where it is the cheapest way to fit: an MLA model under the
analytic cost model, a memory limit between what the stage needs without recompute and with ``mla_up_proj`` on
every attention unit; the solver's answer equals brute force over every per-unit assignment the units can take
(``allowed_codes``: 5 choices per MLA attention unit, 3 per MLP unit) and uses ``mla_up_proj``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import MLA_UP_PROJ, RC_CODE
from search.spec.model import ModelSpec
from search.planner.recompute import allowed_codes, optimize_stage
from search.spec.training import TrainingSpec

MLA_MODEL = ModelSpec(name="mla-dense", family="llama", num_layers=2, hidden_size=2048, num_attention_heads=32,
                      ffn_hidden_size=5632, seq_length=4096, vocab_size=32000, activation="swiglu",
                      normalization="rmsnorm", position_embedding="rope", tied_embeddings=False,
                      add_bias_linear=False,
                      mla={"q_lora_rank": 512, "kv_lora_rank": 256, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                           "v_head_dim": 128})


def _cm(limit_mb: float):
    cluster = parse_cluster("1x1-h100", memory_limit_mb=limit_mb)
    return make_cost_model(MLA_MODEL, cluster, TrainingSpec(global_batch_size=8))


def test_allowed_codes_give_mla_up_proj_to_mla_attention_units_only():
    n = MLA_MODEL.num_units
    codes = allowed_codes(MLA_MODEL, 0, n)
    for u, c in zip(MLA_MODEL.units, codes):
        assert (MLA_UP_PROJ in c) == (u.kind == "attention")
    plain = MLA_MODEL.model_copy(update={"mla": None})
    assert all(MLA_UP_PROJ not in c for c in allowed_codes(plain, 0, n))


def test_solver_picks_mla_up_proj_and_matches_brute_force():
    n, mbs = MLA_MODEL.num_units, 2
    probe = _cm(81920)
    none = probe.stage_cost(0, 1, 0, 0, n, 1, 1, np.zeros(n, np.int8), mbs)
    up = np.array([RC_CODE["mla_up_proj"] if u.kind == "attention" else 0 for u in MLA_MODEL.units], np.int8)
    with_up = probe.stage_cost(0, 1, 0, 0, n, 1, 1, up, mbs)
    assert with_up.memory_mb < none.memory_mb          # it frees Q, K, V
    assert with_up.time_per_microbatch_ms > none.time_per_microbatch_ms   # and re-runs the up projections
    cm = _cm((none.memory_mb + with_up.memory_mb) / 2)
    codes, cost = optimize_stage(cm, 0, 1, 0, 0, n, 1, 1, mbs)
    best, best_codes = np.inf, None
    for ch in itertools.product(*allowed_codes(MLA_MODEL, 0, n)):
        c = cm.stage_cost(0, 1, 0, 0, n, 1, 1, np.array(ch, np.int8), mbs)
        if c.fits and c.time_per_microbatch_ms < best:
            best, best_codes = c.time_per_microbatch_ms, ch
    assert cost.fits and cost.time_per_microbatch_ms == pytest.approx(best, rel=1e-12)
    assert MLA_UP_PROJ in set(best_codes) and MLA_UP_PROJ in set(np.asarray(codes).tolist())
