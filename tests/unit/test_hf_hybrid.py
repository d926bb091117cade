"""`aceso import-hf` of a Nemotron-H / Nemotron-3 config.json (transformers' NemotronHConfig field names): the
imported spec is the preset built from the Megatron-LM / Megatron-Bridge sources (model_specs/hybrid/*.json), and
what aceso cannot hold is refused in one line naming the field, nothing written."""

import json

import pytest

from search.cli import main
from search.spec.presets import load_model

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json fields (the values model_specs/hybrid/nemotron-3-nano.json
# cites from Megatron-Bridge's NemotronH bridge test fixture and the model card)
NANO = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 262144,
        "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mamba_num_heads": 64, "mamba_head_dim": 64,
        "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
        "use_conv_bias": True, "mamba_hidden_act": "silu", "n_routed_experts": 128, "n_shared_experts": 1,
        "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "num_experts_per_tok": 6,
        "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "use_bias": False, "mlp_bias": False,
        "attention_bias": False, "residual_in_fp32": False, "rescale_prenorm_residual": True,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "use_mamba_kernels": True}
_BLOCK = {"M": "mamba", "*": "attention", "-": "mlp"}     # the older layers_block_type spelling
H8B = {"model_type": "nemotron_h", "torch_dtype": "bfloat16", "vocab_size": 131072, "hidden_size": 4096,
       "layers_block_type": [_BLOCK[c] for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"],
       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
       "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64,
       "ssm_state_size": 128, "mamba_n_groups": 8, "mamba_d_conv": 4, "expand": 2, "mamba_chunk_size": 128,
       "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}


def convert(tmp_path, cfg, *extra):
    src = tmp_path / "hf" / "config.json"
    src.parent.mkdir(exist_ok=True)
    src.write_text(json.dumps(cfg))
    out = tmp_path / "spec.json"
    assert main(["import-hf", str(src), "-o", str(out), "--seq-length", "8192", *extra]) == 0
    return load_model(str(out))


def test_nano_config_is_the_preset(tmp_path):
    m, p = convert(tmp_path, NANO), load_model("nemotron-3-nano")
    # a config.json carries no training coefficient: the aux-loss coefficient (1e-4) and type (seq_aux_loss) are the
    # recipe's, and so is the init std (0.0173: the Nano recipes' and Megatron-LM's example's; the import does not
    # read initializer_range, which Bridge's NemotronH bridge test copies as 0.02)
    block = {k: v for k, v in p.megatron.items() if k != "init_method_std"}
    want = p.model_copy(update={"name": m.name, "nominal_params_b": None, "megatron": block,
                                "moe": {**p.moe.model_dump(), "moe_aux_loss_coeff": 0.0,
                                        "moe_router_load_balancing_type": "aux_loss"}})
    assert m == want
    assert m.num_parameters == p.num_parameters


def test_nemotron_h_8b_config_with_the_list_spelling_is_the_preset(tmp_path):
    m, p = convert(tmp_path, H8B), load_model("nemotron-h-8b")
    assert m == p.model_copy(update={"name": m.name, "nominal_params_b": None})


# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16's config.json fields (model_specs/hybrid/nemotron-3-super.json's
# sources: the Megatron-LM release test and Megatron-Bridge's NemotronH bridge tests: moe_latent_size 1024,
# num_nextn_predict_layers 1, mtp_hybrid_override_pattern '*E')
SUPER = {**NANO, "hidden_size": 4096, "num_hidden_layers": 88,
         "hybrid_override_pattern": load_model("nemotron-3-super").hybrid_layer_pattern.split("/")[0],
         "intermediate_size": 2688, "mamba_num_heads": 128, "n_routed_experts": 512, "num_experts_per_tok": 22,
         "moe_intermediate_size": 2688, "moe_shared_expert_intermediate_size": 5376, "moe_latent_size": 1024,
         "routed_scaling_factor": 5.0, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}


def test_super_config_is_the_preset_with_its_one_stored_mtp_block(tmp_path):
    """The checkpoint's architecture: LatentMoE at 1024 and one MTP block; the preset is the recipe's run of that
    block at 2 depths (mtp_use_repeated_layer), so both count the same parameters: the checkpoint's 123,611,033,088
    elements less its 41 x 512 router-bias buffers."""
    m, p = convert(tmp_path, SUPER), load_model("nemotron-3-super")
    assert m.moe.moe_latent_size == 1024 and m.mtp_num_layers == 1 and not m.mtp_use_repeated_layer
    want = p.model_copy(update={"name": m.name, "nominal_params_b": None, "mtp_num_layers": 1,
                                "mtp_use_repeated_layer": False, "hybrid_layer_pattern": SUPER[
                                    "hybrid_override_pattern"] + "/*E",
                                "moe": {**p.moe.model_dump(), "moe_aux_loss_coeff": 0.0,      # (the recipe's)
                                        "moe_router_load_balancing_type": "aux_loss",        # (the recipe's)
                                        "moe_router_num_groups": 1, "moe_router_group_topk": 1},  # one group
                                # the init std and the MTP loss weight are the training run's (Megatron-LM's release
                                # test), which an import of the config does not read
                                "megatron": {"moe_router_topk_scaling_factor": 5.0}})
    assert m == want
    assert m.num_parameters == p.num_parameters == 123_611_033_088 - 41 * 512


@pytest.mark.parametrize("cfg, needle", [
    ({**NANO, "moe_latent_size": 0}, "moe_latent_size"),
    ({**NANO, "mlp_hidden_act": "silu"}, 'mlp_hidden_act "silu": megatron-core\'s Nemotron MLP is squared ReLU'),
    ({**NANO, "num_hidden_layers": 50}, "num_hidden_layers 50: the layer pattern has 52 layers"),
    ({**NANO, "hybrid_override_pattern": "MGM*E" * 10}, "hybrid_override_pattern is"),
    ({**NANO, "n_groups": 3}, "mamba_num_heads (64) must be a multiple of mamba_num_groups (3)"),
    ({**NANO, "mamba_new_field": 1}, "mamba_new_field"),
])
def test_refused_in_one_line(tmp_path, capsys, cfg, needle):
    src = tmp_path / "config.json"
    src.write_text(json.dumps(cfg))
    out = tmp_path / "spec.json"
    assert main(["import-hf", str(src), "-o", str(out), "--seq-length", "8192"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not out.exists()
