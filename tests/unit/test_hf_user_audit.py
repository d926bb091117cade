"""Hugging Face imports as a user meets them (issue "Right answers", user audit 2): the published config.json of
nvidia/Nemotron-H-8B-Base-8K, field for field as the model repository holds it (its remote-code
``NemotronHConfig`` names the attention head size ``attention_head_dim``, not ``head_dim``; Megatron-Bridge's
NemotronH bridge test reproduces the same file). The import is the nemotron-h-8b preset (Megatron-Bridge's
``NemotronHModelProvider8B``), kv_channels 128 the config's attention_head_dim; it was refused as
"field head_dim is missing; this does not look like a complete config.json"."""

import json

from search.cli import main
from search.spec.presets import load_model

# https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                 "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"},
    "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "hidden_dropout": 0.0,
    "hidden_size": 4096, "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02, "intermediate_size": 21504, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 8192,
    "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h", "n_groups": 8,
    "num_attention_heads": 32, "num_hidden_layers": 52, "num_key_value_heads": 8, "num_logits_to_keep": 1,
    "pad_token_id": 0, "rescale_prenorm_residual": True, "residual_in_fp32": False, "rms_norm_eps": 1e-05,
    "ssm_state_size": 128, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0", "use_bias": False, "use_cache": True, "use_conv_bias": True,
    "use_mamba_kernels": True, "vocab_size": 131072}


def test_published_nemotron_h_8b_config_imports_as_the_preset(tmp_path, capsys):
    src = tmp_path / "Nemotron-H-8B-Base-8K" / "config.json"
    src.parent.mkdir()
    src.write_text(json.dumps(NEMOTRON_H_8B))
    out = tmp_path / "spec.json"
    rc = main(["import-hf", str(src), "-o", str(out), "--seq-length", "8192"])
    assert rc == 0, capsys.readouterr().err
    got = json.loads(out.read_text())
    assert got["kv_channels"] == NEMOTRON_H_8B["attention_head_dim"]
    preset = json.loads(load_model("nemotron-h-8b").model_dump_json(exclude_none=True))
    keep = {k for k in preset if k not in ("name", "nominal_params_b")}
    assert {k: got.get(k) for k in keep} == {k: preset[k] for k in keep}


def test_head_dim_and_attention_head_dim_that_disagree_are_refused(tmp_path, capsys):
    src = tmp_path / "config.json"
    src.write_text(json.dumps({**NEMOTRON_H_8B, "head_dim": 64}))
    rc = main(["import-hf", str(src), "-o", str(tmp_path / "spec.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "attention_head_dim" in err and "head_dim" in err and err.count("\n") == 1
    assert not (tmp_path / "spec.json").exists()
