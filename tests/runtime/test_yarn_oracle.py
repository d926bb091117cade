"""GPT-OSS-20B's YaRN as each Megatron-LM release runs the exported command line (its own parse_args,
validate_args and core_transformer_config_from_args, megatron_lm_oracle.py), against transformers' YaRN.

core_v0.19.0 sets the yarn_* config attributes the spec says, and the ``YarnRotaryEmbedding`` that ``GPTModel``
builds from them computes the inverse frequencies and the attention factor that transformers'
``_compute_yarn_parameters`` computes from the config.json (``hf_yarn`` below, transcribed from transformers'
``modeling_rope_utils.py``: ``truncate``, ``mscale`` / ``mscale_all_dim``, ``original_max_position_embeddings``).
core_v0.16.1 / core_v0.17.1 reject ``--position-embedding-type yarn``; core_v0.18.2 takes it but its config has no
yarn_* attribute (``GPTModel`` would raise): why the export refuses them (tests/unit/test_yarn_standard_attention.py).
Checkouts as test_megatron_lm_oracle.py (``ACESO_MEGATRON_LM`` with ``{tag}``; Python 3.12 for 0.17 on).
"""

import json
import math
from pathlib import Path

import pytest

from search.cli.import_hf import hf_to_spec
from search.megatron import megatron_config
from search.megatron.script import args_line
from search.megatron.versions import release
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.spec.rope_scaling import yarn_config
from tests.runtime.test_megatron_lm_oracle import _oracle

CONFIG = json.loads((Path(__file__).parents[1] / "unit" / "data" / "hf" / "gpt-oss-20b" / "config.json").read_text())
YARN_FLAGS = ("--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
              "--no-yarn-correction-range-round-to-int", "--yarn-correction-range-round-to-int")


def hf_yarn(cfg: dict) -> tuple[list[float], float]:
    """transformers' ``_compute_yarn_parameters`` (inverse frequencies, attention factor), in plain Python."""
    rs = cfg["rope_scaling"]
    base, dim = cfg["rope_theta"], int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    factor = rs["factor"]
    orig = rs.get("original_max_position_embeddings") or cfg["max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention = rs.get("attention_factor") or (get_mscale(factor, mscale) / get_mscale(factor, all_dim)
                                               if mscale and all_dim else get_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    out = []
    for i in range(dim // 2):
        pos = base ** (2 * i / dim)
        extra = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append((1 / (factor * pos)) * (1 - extra) + (1 / pos) * extra)
    return out, attention


VARIANTS = {   # the published config, and the same model under the other readings of each key
    "published": {},
    "truncate": {"truncate": True},
    "mscale-only": {"mscale": 0.707},
    "mscale-pair": {"mscale": 0.707, "mscale_all_dim": 0.5, "beta_slow": 2.0},
    "no-original": {"original_max_position_embeddings": None},
}


def _cfg(change: dict) -> dict:
    rs = {k: v for k, v in {**CONFIG["rope_scaling"], **change}.items() if v is not None}
    return {**CONFIG, "rope_scaling": rs}


def _plan(cfg):
    m = hf_to_spec(cfg, source="gpt-oss-20b")
    return uniform_plan(m.model_copy(update={"num_layers": 4}), 2, 1, 4, 4, 16, cluster=parse_cluster("1x8-h100"))


def test_core_v0_19_builds_transformers_yarn():
    plans = {n: _plan(_cfg(c)) for n, c in VARIANTS.items()}
    got = dict(zip(plans, _oracle(plans, "core_v0.19.0")))
    for name, plan in plans.items():
        g = got[name]
        assert "error" not in g, (name, g)
        y = g["yarn"]
        assert y["attrs"] == {k[len("yarn_"):]: v for k, v in yarn_config(plan.model).items()}, name
        assert y["apply_rope_fusion"] is False
        inv, attention = hf_yarn(_cfg(VARIANTS[name]))
        assert y["inv_freq"] == pytest.approx(inv, rel=1e-5), name
        assert y["mscale"] == pytest.approx(attention, rel=1e-12) == y["concentration"], name
    # the published config does not round: its frequencies differ from the rounded (truncate true) ones
    assert got["published"]["yarn"]["inv_freq"] != pytest.approx(got["truncate"]["yarn"]["inv_freq"], rel=1e-3)


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2"])
def test_the_older_releases_do_not_build_it(tag):
    """The core_v0.19.0 line, without the flags a release does not have: 0.16.1 / 0.17.1's parser exits on
    --position-embedding-type yarn (and runs the line with rope); 0.18.2's config holds no yarn_* attribute for
    GPTModel to read."""
    plan = _plan(CONFIG)
    words = args_line(megatron_config(plan), release("0.19")).split()
    line = " ".join(w for i, w in enumerate(words)
                    if w not in YARN_FLAGS and not (i and words[i - 1] in YARN_FLAGS and not w.startswith("--")))
    rope = line.replace("--position-embedding-type yarn", "--position-embedding-type rope")
    got, plain = _oracle([plan, plan], tag, [line, rope])
    assert "error" not in plain, plain              # the same line with plain RoPE runs: the yarn type is the cause
    if tag == "core_v0.18.2":
        assert got.get("yarn") == {"missing": True}, got
    else:                                           # argparse: invalid choice 'yarn' (exit 2)
        assert got == {"error": "SystemExit: 2"}, got
