"""megatron-core 0.16.1 itself refuses every model setting ``search.spec.model_rules`` refuses (its TransformerConfig /
MLATransformerConfig raise on the broken settings of tests/model_rule_cases.py and build the fixed ones), and
Megatron-LM core_v0.16.1's ``validate_args`` refuses the command lines of its two rules (needs a checkout:
``ACESO_MEGATRON_LM``, as test_megatron_lm_oracle.py). MLA with query groups: megatron-core builds that config
and its MLA attention ignores num_query_groups (the same parameters with and without), which is why Megatron-LM
refuses the pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron.core.transformer import transformer_config as tc
from search.spec import model_rules
from tests.model_rule_cases import CORE, MEGATRON_LM


@pytest.mark.parametrize("rule", sorted(CORE))
def test_megatron_core_refuses_what_aceso_refuses(rule):
    cls, broken, fixed = CORE[rule]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, AssertionError)):
            getattr(tc, cls)(**broken)
        getattr(tc, cls)(**fixed)
    assert model_rules.refusal(broken, model_rules.flag_name) and not model_rules.refusal(fixed, str)


def test_megatron_core_mla_ignores_query_groups(monkeypatch):
    """The MLA attention megatron-core builds has the same parameters with 2 query groups as without: it never reads
    num_query_groups (rope_type rope: yarn builds on the GPU; the local core attention holds no parameters and takes
    no MLA k_channels, so a stand-in replaces it, as tests/runtime/test_moe_params.py does)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    import megatron.core.transformer.multi_latent_attention as mla   # 0.16.1 tests isinstance(x, TELinear)
    monkeypatch.setattr(mla, "HAVE_TE", False)                       # with TELinear None here
    init_single_process(free_port())
    counts = []
    for groups in (None, 2):
        cfg = tc.MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                                      multi_latent_attention=True, rope_type="rope", kv_lora_rank=16, qk_head_dim=16,
                                      qk_pos_emb_head_dim=8, v_head_dim=16, use_cpu_initialization=True,
                                      params_dtype=torch.float32)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True)
        spec.submodules.self_attention.submodules.core_attention = _NoParameters
        layer = TransformerLayer(cfg, spec.submodules)
        counts.append(sum(p.numel() for p in layer.parameters()))
    assert counts[0] == counts[1] > 0


class _NoParameters(__import__("torch").nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


CHECKOUT = os.environ.get("ACESO_MEGATRON_LM")


@pytest.mark.skipif(not CHECKOUT or not (Path(CHECKOUT) / "megatron" / "training").is_dir(),
                    reason="set ACESO_MEGATRON_LM to a Megatron-LM core_v0.16.1 checkout")
def test_megatron_lm_validate_args_refuses_what_aceso_refuses():
    cases = [{"line": line, "world": 1} for rule in sorted(MEGATRON_LM) for line in MEGATRON_LM[rule][:2]]
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_oracle.py"))],
                       input=json.dumps(cases), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": CHECKOUT})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for i, rule in enumerate(sorted(MEGATRON_LM)):
        assert "AssertionError" in got[2 * i].get("error", ""), (rule, got[2 * i])
        assert "error" not in got[2 * i + 1], (rule, got[2 * i + 1])
