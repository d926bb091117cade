"""Tiny model specs shared by the runtime and distributed tests (fp32, a few layers, seconds on CPU)."""

from search.spec.model import ModelSpec

GPT = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                ffn_hidden_size=64, seq_length=16, vocab_size=128, params_dtype="fp32")
LLAMA = ModelSpec(name="tiny-llama", family="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=48, seq_length=16, vocab_size=128, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", tied_embeddings=False,
                  add_bias_linear=False, params_dtype="fp32")
T5 = ModelSpec(name="tiny-t5", family="t5", num_layers=2, num_decoder_layers=2, hidden_size=32,
               num_attention_heads=4, ffn_hidden_size=64, seq_length=16, decoder_seq_length=8, vocab_size=128,
               params_dtype="fp32")  # units 0-3 encoder (attention, mlp), 4-9 decoder (attention, cross, mlp)
# a hybrid decoder (megatron-core 0.19's HybridModel): Mamba-2 (8 heads of 8, 2 groups, 2 SSD chunks of 8), attention,
# MoE and MLP layers as one pattern; tp 2 splits the Mamba heads and groups
HYBRID = ModelSpec.model_validate({**LLAMA.model_dump(),
    "name": "tiny-hybrid", "num_layers": 6, "hybrid_layer_pattern": "M*EM-E",
    "mamba": {"mamba_state_dim": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, "chunk_size": 8},
    "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}})
# the same layers and one MTP depth of attention + MoE (HybridModel's '/' part; the last main layer an MLP)
HYBRID_MTP = ModelSpec.model_validate({**HYBRID.model_dump(), "name": "tiny-hybrid-mtp",
                                       "hybrid_layer_pattern": "M*EME-/*E", "mtp_num_layers": 1})
# two MTP depths running one shared layer (megatron-core 0.19 mtp_use_repeated_layer, Nemotron-3 Super's recipe)
HYBRID_SHARED_MTP = ModelSpec.model_validate({**HYBRID.model_dump(), "name": "tiny-hybrid-shared-mtp",
                                              "hybrid_layer_pattern": "M*EME-/*E/*E", "mtp_num_layers": 2,
                                              "mtp_use_repeated_layer": True})
# Gated DeltaNet ('G', megatron-core 0.19's GatedDeltaNet: 2 key heads of 8, 4 value heads of 6, conv 4) with attention,
# MoE and MLP layers; tp 2 splits both head counts
HYBRID_GDN = ModelSpec.model_validate({**HYBRID.model_dump(), "name": "tiny-hybrid-gdn", "mamba": None,
                                       "hybrid_layer_pattern": "G*EG-E",
                                       "gdn": {"linear_key_head_dim": 8, "linear_value_head_dim": 6,
                                               "linear_num_key_heads": 2, "linear_num_value_heads": 4}})
