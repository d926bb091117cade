"""``aceso validate`` of a hybrid (Mamba-2) plan for a CPU cluster gives the runtime's own verdict on this
megatron-core, as ``aceso launch`` does (docs/runtime.md: the pre-flight ``model.layers.hybrid_refusal``, read by
validate, launch and the workers). Before, validate skipped the runtime's checks for a hybrid model and said "valid
plan ... (what aceso launch runs)" on megatron-core 0.16.1, where launch then refused it."""

from __future__ import annotations

import json

from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

SPEC = {"name": "tiny-hyb", "family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 32, "vocab_size": 512,
        "activation": "squared_relu", "normalization": "rmsnorm", "position_embedding": "none",
        "tied_embeddings": False, "add_bias_linear": False, "params_dtype": "fp32", "hybrid_layer_pattern": "M*M-",
        "mamba": {"mamba_state_dim": 16, "mamba_head_dim": 16, "mamba_num_groups": 2, "mamba_num_heads": 8}}


def test_validate_gives_the_runtimes_verdict_on_this_megatron_core(tmp_path, capsys):
    from aceso_megatron.model.layers import hybrid_refusal

    spec = tmp_path / "tiny-hyb.json"
    spec.write_text(json.dumps(SPEC))
    model = load_model(str(spec))
    path = tmp_path / "plan.json"
    path.write_text(uniform_plan(model, 2, 1, 1, 2, 4, cluster=parse_cluster("1x2-cpu")).to_json())
    rc = main(["validate", str(path), "--world-size", "2"])
    out, err = capsys.readouterr()
    why = hybrid_refusal(model)
    if why is None:          # megatron-core 0.19: the runtime runs it
        assert rc == 0 and "valid plan" in out, err
    else:                    # 0.16.1: refused in the runtime's own words
        assert rc == 2 and err.count("\n") == 1 and why in err, (out, err)
