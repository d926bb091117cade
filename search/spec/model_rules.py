"""The model settings megatron-core refuses when it builds the model, checked where a model enters aceso.

A spec file, a preset, a Hugging Face import and a Megatron-LM command line all become a ``ModelSpec``, whose
validator calls ``check_model``; the Megatron-LM importer also calls ``refusal`` with the flags a spec cannot
hold (the load-balancing type, ``--moe-router-pre-softmax``). Both read one table, ``RULES``: megatron-core
0.16.1's ``TransformerConfig.__post_init__`` (transformer_config.py in site-packages, cited by line) and Megatron-LM
core_v0.16.1's ``validate_args`` (megatron/training/arguments.py) for what the model build would refuse, over the
``TransformerConfig`` names of the fields (``config_fields``), so a spec file, a preset, an HF config and a command
line are refused by the same rule; each caller words the fields its way (``spec_name``, or flags).
tests/runtime/test_model_rules_megatron.py builds each refused config with megatron-core (and Megatron-LM's parser) and
shows it refuses it too.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

CAPACITY_LB_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


class Rule(NamedTuple):
    broken: Callable[[dict], bool]   # over TransformerConfig names (``config_fields``)
    text: str                        # what is wrong and the fix; {field} is the caller's name of a field
    source: str                      # where megatron-core / Megatron-LM refuses it


def _lb_types(c: dict) -> list[str]:
    t = c.get("moe_router_load_balancing_type") or "aux_loss"
    return t if isinstance(t, list) else [t]


def _capacity(c: dict) -> float | None:
    """The capacity factor megatron-core keeps: a negative one is None, dropless (transformer_config.py:1105-1107)."""
    f = c.get("moe_expert_capacity_factor")
    return None if f is None or f < 0 else f


RULES: tuple[Rule, ...] = (
    Rule(lambda c: bool(c.get("moe_router_enable_expert_bias")) and c.get("moe_router_score_function",
                                                                          "softmax") != "sigmoid",
         "{moe_router_enable_expert_bias} (aux-loss-free routing) needs {moe_router_score_function} sigmoid; set it "
         "sigmoid or turn the expert bias off",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1593-1598"),
    Rule(lambda c: _capacity(c) is not None and any(t not in CAPACITY_LB_TYPES for t in _lb_types(c)),
         "{moe_expert_capacity_factor} works with the aux_loss, seq_aux_loss, global_aux_loss or none load "
         "balancing, not {moe_router_load_balancing_type} sinkhorn; drop the capacity factor or change the type",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1105-1128"),
    Rule(lambda c: bool(c.get("moe_pad_expert_input_to_capacity")) and _capacity(c) is None,
         "{moe_pad_expert_input_to_capacity} needs {moe_expert_capacity_factor} (it pads to a capacity); set a "
         "capacity factor or turn padding off",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1131-1135"),
    Rule(lambda c: c.get("num_moe_experts") is not None and c.get("moe_router_topk") == 1
         and c.get("moe_router_score_function", "softmax") == "softmax" and not c.get("moe_router_pre_softmax")
         and "sinkhorn" not in _lb_types(c),
         "{moe_router_topk} 1 with the softmax router needs {moe_router_pre_softmax} (a softmax over one score "
         "has no gradient)",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1634-1641"),
    Rule(lambda c: bool(c.get("moe_router_group_topk")) and not c.get("moe_router_num_groups"),
         "{moe_router_group_topk} needs {moe_router_num_groups} (group-limited routing); set both or neither",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1643-1652"),
    Rule(lambda c: bool(c.get("moe_router_group_topk")) and bool(c.get("moe_router_num_groups"))
         and c["num_moe_experts"] % c["moe_router_num_groups"] != 0,
         "{num_moe_experts} must be a multiple of {moe_router_num_groups}",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1654-1657"),
    Rule(lambda c: bool(c.get("moe_router_group_topk")) and bool(c.get("moe_router_num_groups"))
         and c["moe_router_group_topk"] > c["moe_router_num_groups"],
         "{moe_router_group_topk} must be at most {moe_router_num_groups}",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1658-1661"),
    Rule(lambda c: bool(c.get("multi_latent_attention")) and bool(c.get("rotary_interleaved")),
         "{rotary_interleaved} does not work with {multi_latent_attention}; remove it",
         "megatron-core 0.16.1 TransformerConfig.__post_init__, transformer_config.py:1558-1559"),
    # megatron-core's MLA never reads num_query_groups (multi_latent_attention.py: its K/V heads are
    # num_attention_heads), so GQA there would be priced but not built; Megatron-LM refuses the pair
    Rule(lambda c: bool(c.get("multi_latent_attention")) and bool(c.get("group_query_attention")),
         "{multi_latent_attention} and {group_query_attention} (grouped-query attention) are mutually exclusive: "
         "MLA has one latent K/V per head and megatron-core's MLA never reads num_query_groups; remove the query "
         "groups",
         "Megatron-LM core_v0.16.1 validate_args, megatron/training/arguments.py:1265-1266"),
    Rule(lambda c: bool(c.get("mtp_num_layers")) and c.get("position_embedding_type", "learned_absolute")
         not in ("rope", "none"),
         "{mtp_num_layers} with learned absolute positions ({position_embedding_type}): multi-token prediction "
         "works with rope (or no) position embeddings; use rope or remove the MTP layers",
         "Megatron-LM core_v0.16.1 validate_args, megatron/training/arguments.py:1229-1234"),
)


def refusal(cfg: dict, name: Callable[[str], str]) -> str | None:
    """The first rule ``cfg`` (TransformerConfig names) breaks, worded with ``name(field)``; None when it builds."""
    for rule in RULES:
        if rule.broken(cfg):
            fields = {k: name(k) for k in _placeholders(rule.text)}
            return f"{rule.text.format(**fields)} ({rule.source})"
    return None


def _placeholders(text: str) -> list[str]:
    import string
    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def pre_softmax(moe) -> bool:
    """Whether the router runs megatron-core's ``moe_router_pre_softmax``: the spec's (a softmax router that does
    not renormalize its top-k weights), and always for top-1 softmax routing, which megatron-core requires it for (a
    softmax over one score is 1; same cost). A sigmoid router ignores it (``topk_routing_with_score_function``)."""
    softmax = moe.moe_router_score_function == "softmax"
    return softmax and (moe.moe_router_pre_softmax or moe.moe_router_topk == 1)


def moe_config(model) -> dict:
    """The MoE ``TransformerConfig`` fields of ``model`` (empty for a dense model), as the runtime builds them
    (``model_specs.builders.moe_kwargs``) and the export writes them: the load-balancing type (``none`` for an
    aux-loss type at coefficient 0), the pre-softmax router (``pre_softmax``)."""
    moe = model.moe
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.moe_router_topk,
        "moe_ffn_hidden_size": moe.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": moe.moe_shared_expert_gate,
        "moe_layer_freq": _moe_layers(model),
        "moe_router_score_function": moe.moe_router_score_function,
        "moe_router_num_groups": moe.moe_router_num_groups,
        "moe_router_group_topk": moe.moe_router_group_topk,
        "moe_router_enable_expert_bias": moe.moe_router_enable_expert_bias,
        "moe_router_bias_update_rate": moe.moe_router_bias_update_rate,
        "moe_router_pre_softmax": pre_softmax(moe),
        "moe_aux_loss_coeff": moe.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": moe.lb_type,
        "moe_expert_capacity_factor": moe.moe_expert_capacity_factor,
        "moe_pad_expert_input_to_capacity": moe.moe_pad_expert_input_to_capacity,
        "moe_router_force_load_balancing": moe.moe_router_force_load_balancing,
    }


def _moe_layers(model) -> list[int]:
    """Which decoder layers are MoE, megatron-core's 0/1 list: a hybrid model's ``E`` layers of its main pattern
    (``hybrid_layer_pattern`` says which layers are MoE, ``moe_layer_freq`` may not), else ``MoESpec``'s."""
    if model.hybrid_layer_pattern:
        from search.layers.hybrid import parse_pattern
        return [int(c == "E") for c in parse_pattern(model.hybrid_layer_pattern).layers]
    return [int(model.moe.is_moe_layer(i)) for i in range(model.num_layers)]


def config_fields(model) -> dict:
    """What the rules read of a ``ModelSpec``, under TransformerConfig names (and Megatron-LM's
    ``group_query_attention``: query groups other than one per head): its ``megatron`` block, attention,
    positions, MLA, MTP and MoE fields."""
    return {**(model.megatron or {}), "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups, "multi_latent_attention": model.mla is not None,
            "group_query_attention": model.num_query_groups not in (None, model.num_attention_heads),
            "mtp_num_layers": model.mtp_num_layers,
            "position_embedding_type": {"rope": "rope", "none": "none"}.get(model.position_embedding,
                                                                            "learned_absolute"),
            **moe_config(model)}


SPEC_NAMES = {"num_moe_experts": "moe.num_experts", "multi_latent_attention": "mla",
              "group_query_attention": "num_query_groups",
              "position_embedding_type": "position_embedding", "moe_router_pre_softmax": "a pre-softmax router"}


def spec_name(field: str) -> str:
    """A TransformerConfig field as a spec file names it."""
    if field in SPEC_NAMES:
        return SPEC_NAMES[field]
    return f"moe.{field}" if field.startswith("moe_") else field


def check_model(model) -> None:
    """``ModelSpec``'s check (ValueError, one line naming the spec's fields)."""
    why = refusal(config_fields(model), spec_name)
    if why:
        raise ValueError(why)


def flag_name(field: str) -> str:
    """A TransformerConfig field (or Megatron-LM argument) as Megatron-LM core_v0.16.1's flag."""
    return "--num-experts" if field == "num_moe_experts" else "--" + field.replace("_", "-")
