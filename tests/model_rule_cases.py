"""Model settings megatron-core 0.16.1 refuses when it builds the model (``search.spec.model_rules``), as
``TransformerConfig`` keyword arguments: per rule the settings that break it and the same settings fixed. The unit
test (tests/unit/test_model_rules.py) checks aceso refuses the first and accepts the second; the runtime test
(tests/runtime/test_model_rules_megatron.py) builds both with megatron-core itself. ``MEGATRON_LM`` are the rules of
Megatron-LM's ``validate_args`` (megatron-core builds those configs): command lines, broken and fixed."""

from __future__ import annotations

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
MOE = dict(BASE, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
MLA = dict(BASE, multi_latent_attention=True)

# rule -> (config class, broken settings, fixed settings)
CORE = {
    "expert bias with softmax scoring": ("TransformerConfig", dict(MOE, moe_router_enable_expert_bias=True),
                                         dict(MOE, moe_router_enable_expert_bias=True,
                                              moe_router_score_function="sigmoid")),
    "capacity factor with sinkhorn": ("TransformerConfig", dict(MOE, moe_expert_capacity_factor=1.5,
                                                                moe_router_load_balancing_type="sinkhorn"),
                                      dict(MOE, moe_expert_capacity_factor=1.5,
                                           moe_router_load_balancing_type="aux_loss")),
    "padding without a capacity": ("TransformerConfig", dict(MOE, moe_pad_expert_input_to_capacity=True),
                                   dict(MOE, moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0)),
    "padding with a negative (dropless) capacity": ("TransformerConfig",
                                                    dict(MOE, moe_pad_expert_input_to_capacity=True,
                                                         moe_expert_capacity_factor=-1.0),
                                                    dict(MOE, moe_expert_capacity_factor=-1.0)),
    "top-1 softmax without pre-softmax": ("TransformerConfig", dict(MOE, moe_router_topk=1),
                                          dict(MOE, moe_router_topk=1, moe_router_pre_softmax=True)),
    "group top-k without groups": ("TransformerConfig", dict(MOE, moe_router_group_topk=2),
                                   dict(MOE, moe_router_group_topk=2, moe_router_num_groups=4)),
    "experts not a multiple of the groups": ("TransformerConfig",
                                             dict(MOE, moe_router_group_topk=1, moe_router_num_groups=3),
                                             dict(MOE, moe_router_group_topk=1, moe_router_num_groups=2)),
    "group top-k above the groups": ("TransformerConfig", dict(MOE, moe_router_group_topk=4, moe_router_num_groups=2),
                                     dict(MOE, moe_router_group_topk=2, moe_router_num_groups=2)),
    "MLA with interleaved rotary": ("MLATransformerConfig", dict(MLA, rotary_interleaved=True), dict(MLA)),
}

_LINE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 1 --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 128 "
         "--position-embedding-type rope ")
# rule -> (broken command line, fixed command line, the TransformerConfig fields aceso's rule reads of it)
MEGATRON_LM = {
    "MLA with query groups": (_LINE + "--multi-latent-attention --group-query-attention --num-query-groups 2",
                              _LINE + "--multi-latent-attention",
                              dict(MLA, group_query_attention=True, num_query_groups=2)),
    "MTP with learned absolute positions": (_LINE.replace("rope", "learned_absolute") + "--mtp-num-layers 1",
                                            _LINE + "--mtp-num-layers 1",
                                            dict(BASE, mtp_num_layers=1, position_embedding_type="learned_absolute")),
}
