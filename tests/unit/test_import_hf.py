"""`aceso import-hf`: Hugging Face config.json files (GPT-2, Llama, T5) become model specs."""

import json

import pytest

from search.cli import main
from search.spec.presets import load_model

GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "n_ctx": 1024,
        "vocab_size": 50257, "n_inner": None, "activation_function": "gelu_new"}
LLAMA2_7B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "max_position_embeddings": 4096,
             "vocab_size": 32000, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
             "rms_norm_eps": 1e-5}
T5_BASE = {"model_type": "t5", "num_layers": 12, "num_decoder_layers": 12, "d_model": 768, "num_heads": 12,
           "d_kv": 64, "d_ff": 3072, "vocab_size": 32128, "feed_forward_proj": "relu"}


def convert(tmp_path, cfg, *extra):
    src = tmp_path / "hf" / "config.json"
    src.parent.mkdir(exist_ok=True)
    src.write_text(json.dumps(cfg))
    out = tmp_path / "spec.json"
    assert main(["import-hf", str(src), "-o", str(out), *extra]) == 0
    return load_model(str(out))


def test_gpt2_small_matches_hf_parameter_count(tmp_path):
    m = convert(tmp_path, GPT2)
    assert (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.seq_length) == ("gpt", 12, 768, 3072, 1024)
    # Hugging Face reports 124,439,808 parameters; Megatron pads the vocabulary 50257 -> 50304 (+47 rows)
    assert m.num_parameters == 124_439_808 + 47 * 768
    assert (m.attention_dropout, m.hidden_dropout) == (0.1, 0.1)     # GPT-2's attn_pdrop / resid_pdrop defaults
    m = convert(tmp_path, {**GPT2, "attn_pdrop": 0.0, "resid_pdrop": 0.2})
    assert (m.attention_dropout, m.hidden_dropout) == (0.0, 0.2)


def test_llama2_7b_matches_hf_parameter_count_and_preset(tmp_path):
    m = convert(tmp_path, LLAMA2_7B, "--name", "llama2-7b")
    assert m.num_parameters == 6_738_415_616  # Hugging Face's count for Llama-2-7b
    preset = load_model("llama2-7b")
    assert m.model_dump(exclude={"nominal_params_b", "params_dtype"}) == \
        preset.model_dump(exclude={"nominal_params_b", "params_dtype"})


def test_t5_fields(tmp_path):
    m = convert(tmp_path, T5_BASE, "--seq-length", "1024", "--decoder-seq-length", "256")
    assert (m.family, m.num_layers, m.num_decoder_layers, m.hidden_size) == ("t5", 12, 12, 768)
    assert (m.num_attention_heads, m.kv_channels, m.ffn_hidden_size) == (12, 64, 3072)
    assert (m.seq_length, m.decoder_seq_length, m.num_units) == (1024, 256, 12 * 2 + 12 * 3)
    assert (m.attention_dropout, m.hidden_dropout) == (0.1, 0.1)     # T5's dropout_rate default


def test_models_from_hf_alias(tmp_path, capsys):
    src = tmp_path / "config.json"
    src.write_text(json.dumps(GPT2))
    assert main(["models", "--from-hf", str(src)]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_size"] == 768


@pytest.mark.parametrize("cfg, needle", [({"model_type": "bert"}, "model_type 'bert'"),
                                         ({"model_type": "llama"}, "is missing"),
                                         ({**GPT2, "n_head": 5}, "num_attention_heads")])
def test_bad_hf_configs(tmp_path, capsys, cfg, needle):
    src = tmp_path / "config.json"
    src.write_text(json.dumps(cfg))
    out = tmp_path / "spec.json"
    assert main(["import-hf", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not out.exists()  # nothing written half-way
