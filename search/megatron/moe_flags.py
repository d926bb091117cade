"""MoE, MLA and MTP both ways with Megatron-LM core_v0.16.1 (flags) and Megatron-Bridge v0.3.1 (provider fields).

Import (``moe_model_fields``, ``moe_plan_fields``): the model flags become ``ModelSpec.moe`` / ``mla`` /
``mtp_num_layers`` (and ``megatron.qk_layernorm``), the expert shape ``--expert-model-parallel-size`` /
``--expert-tensor-parallel-size`` every stage's ``ep`` / ``etp`` (Megatron-LM has one folding), the dispatcher and
overlap flags ``ParallelPlan.moe``, all with Megatron-LM's defaults (``--moe-router-topk`` 2, the ``allgather``
dispatcher, grouped GEMM and permute fusion off, ``--kv-lora-rank`` 32, ``--qk-head-dim`` 128 ...) and the checks of
``validate_args`` / ``TransformerConfig`` a plan depends on. Export (``moe_args``, ``moe_parallel_args``,
``moe_bridge_fields``) writes the same fields back, so export -> import gives the same plan.

``--moe-layer-freq`` is an int N or Megatron-LM's list expression (``"[0]*3+[1]*58"``, evaluated on the characters
``_eval_pattern`` allows); a list of the form "the first k dense, then every N-th" becomes ``moe_layer_freq N`` with
``first_k_dense_layers k`` (the presets' form), any other list stays a list. Aux losses: the plan keeps one
coefficient (``moe_aux_loss_coeff``) and one type (``moe_router_load_balancing_type``); ``none`` is coefficient 0,
several aux-loss types with coefficients are one ``aux_loss`` of their sum (a note). What the plan cannot say (the flex backend, router dtype /
scaling, YaRN) is listed in the importer's one warning, as every unpriced flag.
"""

from __future__ import annotations

import ast
import re

from search.spec import model_rules
from search.io.errors import AcesoError
from search.layers.moe_spec import AUX_LOSS_TYPES, LB_TYPES
from search.settings.moe_plan import MoEPlanSettings

DISPATCHERS = ("allgather", "alltoall", "flex")

# ModelSpec.moe field <-> Megatron-LM flag (Bridge: the same TransformerConfig name, num_experts: num_moe_experts)
MOE_FLAGS = (("num_experts", "--num-experts"), ("moe_router_topk", "--moe-router-topk"),
             ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
             ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
             ("moe_router_score_function", "--moe-router-score-function"),
             ("moe_router_num_groups", "--moe-router-num-groups"), ("moe_router_group_topk", "--moe-router-group-topk"),
             ("moe_expert_capacity_factor", "--moe-expert-capacity-factor"),
             ("moe_latent_size", "--moe-latent-size"))      # LatentMoE (Nemotron-3 Super, Ultra)
MOE_BOOLS = (("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
             ("moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity"),
             ("moe_router_force_load_balancing", "--moe-router-force-load-balancing"),
             ("moe_shared_expert_gate", "--moe-shared-expert-gate"))    # read with a shared expert only
MLA_FLAGS = (("q_lora_rank", "--q-lora-rank", None), ("kv_lora_rank", "--kv-lora-rank", 32),
             ("qk_head_dim", "--qk-head-dim", 128), ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", 64),
             ("v_head_dim", "--v-head-dim", 128))
# MoEPlanSettings bool field <-> Megatron-LM flag <-> Bridge model field (all off by default in Megatron-LM)
# Bridge fields of megatron-core 0.19 (not in Megatron-Bridge v0.3.1's TransformerConfig): written only where set
NEWER_FIELDS = frozenset({"moe_paged_stash", "use_fused_weighted_squared_relu"})   # (the second: only where set)
SETTING_FLAGS = (("grouped_gemm", "--moe-grouped-gemm", "moe_grouped_gemm"),
                 ("permute_fusion", "--moe-permute-fusion", "moe_permute_fusion"),
                 ("shared_expert_overlap", "--moe-shared-expert-overlap", "moe_shared_expert_overlap"),
                 ("overlap_ep_comm", "--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
                 ("delay_wgrad", "--delay-wgrad-compute", "delay_wgrad_compute"),
                 ("router_fusion", "--moe-router-fusion", "moe_router_fusion"),
                 ("paged_stash", "--moe-paged-stash", "moe_paged_stash"),     # megatron-core 0.19
                 ("fused_weighted_squared_relu", "--use-fused-weighted-squared-relu",
                  "use_fused_weighted_squared_relu"))
# MoEPlanSettings value field <-> Megatron-LM flag <-> Bridge model field (the capacity: megatron-core 0.19)
VALUE_FLAGS = (("router_dtype", "--moe-router-dtype", "moe_router_dtype"),
               ("rank_capacity_factor", "--moe-expert-rank-capacity-factor", "moe_expert_rank_capacity_factor"),
               ("hybridep_num_sms", "--moe-hybridep-num-sms", "moe_hybridep_num_sms"))
ROUTER_DTYPES = ("fp32", "fp64")
BIAS_UPDATE_RATE = 1e-3         # --moe-router-bias-update-rate's default (megatron-core's, every release)
MODEL_ONLY = ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
              "--moe-layer-freq", "--moe-router-score-function", "--moe-router-num-groups", "--moe-router-group-topk",
              "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "--moe-expert-capacity-factor",
              "--moe-pad-expert-input-to-capacity", "--moe-router-force-load-balancing",
              "--moe-router-load-balancing-type", "--moe-shared-expert-gate")


# ----- import -------------------------------------------------------------------------------------------------
def layer_freq(text: str, num_layers: int) -> dict:
    """``--moe-layer-freq`` as MoESpec fields: ``{moe_layer_freq: N}`` (+ ``first_k_dense_layers``) or a 0/1 list."""
    where = f"--moe-layer-freq {text!r}"
    if "[" not in text:
        try:
            return {"moe_layer_freq": int(text)}
        except ValueError:
            raise AcesoError(f"{where}: expected an integer or a list expression such as [0]*3+[1]*58") from None
    if re.search(r"[^,\d\[\]()+*\s]", text):      # Megatron-LM's _eval_pattern allows these characters only
        raise AcesoError(f"{where}: only digits, [ ] ( ) + * and commas are allowed (Megatron-LM's pattern)")
    try:
        pattern = _eval(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise AcesoError(f"{where}: not a list expression such as [0]*3+[1]*58") from None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        raise AcesoError(f"{where}: the pattern must be a list of 0s (dense) and 1s (MoE)")
    if len(pattern) != num_layers:
        raise AcesoError(f"{where}: the pattern has {len(pattern)} entries but --num-layers is {num_layers} "
                         "(Megatron-LM asserts one per layer)")
    return _compact(pattern)


def _eval(node):
    """The list expression of ``--moe-layer-freq`` without ``eval``: list literals, ints, ``+`` and ``*``."""
    if isinstance(node, ast.List):
        return [_eval(x) for x in node.elts]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and max(len(x) if isinstance(x, list) else x for x in (a, b)) > 1 << 16:
            raise ValueError("too long")
        return a + b if isinstance(node.op, ast.Add) else a * b
    raise ValueError("not a list expression")


def _compact(pattern: list[int]) -> dict:
    """``[0]*k + every N-th`` as ``{moe_layer_freq: N, first_k_dense_layers: k}``, else the list itself."""
    if 1 in pattern:
        k = pattern.index(1)
        for n in range(1, len(pattern) + 1):
            if [int(i >= k and i % n == 0) for i in range(len(pattern))] == pattern:
                return {"moe_layer_freq": n, **({"first_k_dense_layers": k} if k else {})}
    return {"moe_layer_freq": pattern}


def _aux_loss(f, notes: list[str]) -> dict:
    """``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` as ``moe_router_load_balancing_type`` and
    ``moe_aux_loss_coeff`` (megatron-core takes one coefficient per type in a list)."""
    types = f.get("--moe-router-load-balancing-type") or ["aux_loss"]
    coeffs = f.get("--moe-aux-loss-coeff") or ["0.0"]
    bad = [t for t in types if t not in LB_TYPES]
    if bad:
        raise AcesoError(f"--moe-router-load-balancing-type {bad[0]}: use one of {', '.join(LB_TYPES)}")
    try:
        values = [float(x) for x in coeffs]
    except ValueError:
        raise AcesoError(f"--moe-aux-loss-coeff {' '.join(coeffs)}: expected numbers") from None
    if len(types) != len(values) and len(values) != 1:
        raise AcesoError(f"--moe-aux-loss-coeff gives {len(values)} values for {len(types)} load-balancing types; "
                         "give one per type")
    values = values * len(types) if len(values) == 1 else values
    used = {t: v for t, v in zip(types, values) if t in AUX_LOSS_TYPES and v}
    total = sum(used.values())
    if len(used) == 1:
        return {"moe_router_load_balancing_type": next(iter(used)), "moe_aux_loss_coeff": total}
    if len(used) > 1:
        notes.append(f"--moe-router-load-balancing-type {' '.join(types)}: priced as one aux_loss of coefficient "
                     f"{total:g}")
        return {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": total}
    if "sinkhorn" in types:
        if values[types.index("sinkhorn")]:
            raise AcesoError("--moe-router-load-balancing-type sinkhorn with --moe-aux-loss-coeff: megatron-core "
                             "asserts sinkhorn routing takes no aux loss; drop the coefficient")
        notes.append("--moe-router-load-balancing-type sinkhorn: priced as top-k routing (its Sinkhorn iterations "
                     "are not priced)")
        return {"moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.0}
    return {"moe_aux_loss_coeff": 0.0}     # no aux loss: runs as none whatever the type (MoESpec.lb_type)


def moe_model_fields(f, num_layers: int, ffn: int, pos: str, notes: list[str]) -> dict:
    """The ModelSpec fields of the MoE / MLA / MTP / q-k norm flags (empty for a dense model)."""
    out: dict = {}
    experts = f.get("--num-experts")
    if experts:                                     # Megatron-LM: 0 is None (no MoE)
        moe = {"num_experts": experts, "moe_router_topk": f.value("--moe-router-topk"),
               "moe_ffn_hidden_size": f.get("--moe-ffn-hidden-size", ffn)}
        for name, flag in MOE_FLAGS[3:]:
            if f.has(flag):
                moe[name] = f.get(flag)
        for name, flag in MOE_BOOLS:
            moe[name] = f.has(flag)
        if moe["moe_shared_expert_gate"] and not moe.get("moe_shared_expert_intermediate_size"):
            moe["moe_shared_expert_gate"] = False       # megatron-core builds the gate in the shared expert only
            notes.append("--moe-shared-expert-gate without --moe-shared-expert-intermediate-size: megatron-core "
                         "builds no gate")
        moe["moe_router_pre_softmax"] = pre_softmax_read(f.has("--moe-router-pre-softmax"), moe)
        if f.has("--moe-router-bias-update-rate"):
            moe["moe_router_bias_update_rate"] = f.get("--moe-router-bias-update-rate")
        moe.update(layer_freq(f.get("--moe-layer-freq", "1"), num_layers))
        moe.update(_aux_loss(f, notes))
        out["moe"] = moe
    else:
        given = [x for x in MODEL_ONLY if f.has(x)]
        if given:
            notes.append(f"{' '.join(given)} without --num-experts: Megatron-LM builds a dense model")
    why = model_rules.refusal(_rule_fields(f, out.get("moe"), pos), model_rules.flag_name)
    if why:             # the rules the model check applies again, here with the flags the spec cannot hold
        raise AcesoError(why)
    if f.has("--multi-latent-attention"):
        if f.has("--group-query-attention"):
            raise AcesoError("--multi-latent-attention with --group-query-attention: Megatron-LM asserts they are "
                             "mutually exclusive")
        out["mla"] = {name: f.value(flag) for name, flag, _ in MLA_FLAGS}
    mtp = f.get("--mtp-num-layers")
    if mtp:
        out["mtp_num_layers"] = mtp
        if f.has("--mtp-use-repeated-layer"):
            out["mtp_use_repeated_layer"] = True
    elif f.has("--mtp-use-repeated-layer"):
        notes.append("--mtp-use-repeated-layer without --mtp-num-layers: Megatron-LM builds no MTP layer")
    if f.has("--qk-layernorm"):
        out["megatron"] = {"qk_layernorm": True}
    return out


def _rule_fields(f, moe: dict | None, pos: str) -> dict:
    """What ``search.spec.model_rules`` reads, from the flags: the MoE fields as read, and what a spec cannot hold (the
    load-balancing types, --moe-router-pre-softmax, --group-query-attention, --rotary-interleaved)."""
    return {**({"num_moe_experts": moe["num_experts"], **{k: v for k, v in moe.items() if k != "num_experts"},
                "moe_router_pre_softmax": f.has("--moe-router-pre-softmax"),
                "moe_router_load_balancing_type": f.get("--moe-router-load-balancing-type") or ["aux_loss"]}
               if moe else {}),
            "multi_latent_attention": f.has("--multi-latent-attention"),
            "group_query_attention": f.has("--group-query-attention"),
            "rotary_interleaved": "--rotary-interleaved" in f.ignored,     # read by nothing else
            "mtp_num_layers": f.get("--mtp-num-layers"), "position_embedding_type": pos}


def moe_plan_fields(f, model, notes: list[str]) -> tuple[int, int | None, MoEPlanSettings | None]:
    """``(ep, etp, settings)`` of every stage / the plan (``etp`` None: not given, megatron-core's default tp)."""
    ep, etp = f.value("--expert-model-parallel-size"), f.get("--expert-tensor-parallel-size")
    if ep < 1 or (etp is not None and etp < 1):
        raise AcesoError("--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1")
    dispatcher = f.value("--moe-token-dispatcher-type")
    backend = f.value("--moe-flex-dispatcher-backend")
    if model.moe is None:
        if ep > 1:
            raise AcesoError(f"--expert-model-parallel-size {ep} without --num-experts: Megatron-LM asserts "
                             "num_experts is set to use expert model parallelism")
        return 1, None, None
    if dispatcher not in DISPATCHERS:
        raise AcesoError(f"--moe-token-dispatcher-type {dispatcher}: use one of {', '.join(DISPATCHERS)}")
    if backend not in ("deepep", "hybridep"):
        raise AcesoError(f"--moe-flex-dispatcher-backend {backend}: use deepep or hybridep")
    if f.has("--moe-enable-deepep") and (dispatcher != "flex" or backend == "hybridep"):
        raise AcesoError("--moe-enable-deepep needs --moe-token-dispatcher-type flex and no hybridep backend "
                         "(megatron-core's TransformerConfig raises)")
    settings = {"token_dispatcher": dispatcher, **{name: f.has(flag) for name, flag, _ in SETTING_FLAGS}}
    if dispatcher == "flex":
        settings["flex_backend"] = backend
    dtype = f.get("--moe-router-dtype")
    if dtype is not None and dtype not in ROUTER_DTYPES:
        raise AcesoError(f"--moe-router-dtype {dtype}: use fp32 or fp64 (or leave it out: the model's dtype)")
    settings["router_dtype"] = dtype
    settings["rank_capacity_factor"] = f.get("--moe-expert-rank-capacity-factor")
    settings["hybridep_num_sms"] = hybridep_num_sms(f, dispatcher, backend, notes)
    from search.settings.moe_plan import settings_refusal
    why = settings_refusal(MoEPlanSettings(**settings), model)
    if why:
        raise AcesoError(f"{why.split(';')[0]} (megatron-core refuses it)".replace("moe.", "", 1))
    from search.settings.moe_plan import shared_overlap_dispatchers
    ok = shared_overlap_dispatchers(f.release.version)      # the release the line is read under
    if settings["shared_expert_overlap"] and dispatcher not in ok:
        raise AcesoError(f"--moe-shared-expert-overlap with the {dispatcher} dispatcher: megatron-core "
                         f"{f.release.series} supports it with {' or '.join(ok)} only")
    return ep, etp, MoEPlanSettings(**settings)


SMS_FLAG, FLEX_SMS_FLAG, DEEPEP_SMS_FLAG = "--moe-hybridep-num-sms", "--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms"


def hybridep_num_sms(f, dispatcher: str, backend: str, notes: list[str]) -> int | None:
    """HybridEP's SM count as given (``settings.moe.hybridep_num_sms``; None where no flag gives it: the release's
    default, 16 in core_v0.16.1's TransformerConfig, None = HybridEP's own 32 from core_v0.17.1). core_v0.16.1 to
    core_v0.18.2 pass ``moe_hybridep_num_sms`` to ``hybrid_ep_dispatch`` (token_dispatcher.py); core_v0.19.0 passes
    ``moe_flex_dispatcher_num_sms`` to every flex backend, set from the deprecated ``moe_hybridep_num_sms`` /
    ``moe_deepep_num_sms`` when not given (transformer_config.py:1616-1635, which raises on two different ones).
    Priced at 16 and 32 SMs only (HybridEP's published benchmarks, costmodel/moe_primitives.py)."""
    unified = f.release.has(FLEX_SMS_FLAG)
    if unified and f.has(FLEX_SMS_FLAG):
        given, sms = FLEX_SMS_FLAG, f.get(FLEX_SMS_FLAG)
    elif unified and (old := {x: f.get(x) for x in (DEEPEP_SMS_FLAG, SMS_FLAG) if f.has(x)}):
        if len(set(old.values())) > 1:
            raise AcesoError(f"{' and '.join(f'{k} {v}' for k, v in old.items())}: megatron-core's TransformerConfig "
                             f"raises on conflicting SM counts; give one {FLEX_SMS_FLAG}")
        given, sms = next(iter(old.items()))
        if given == DEEPEP_SMS_FLAG and dispatcher == "flex" and backend == "hybridep" and given in f.ignored:
            f.ignored.remove(given)          # routed to HybridEP by 0.19: read here, not unpriced
    elif f.has(SMS_FLAG):
        given, sms = SMS_FLAG, f.get(SMS_FLAG)
    else:
        return None
    if dispatcher != "flex" or backend != "hybridep":
        if unified and dispatcher == "flex" and given != DEEPEP_SMS_FLAG:
            raise AcesoError(f"{given} {sms} with the {backend} backend: megatron-core {f.release.series} sizes "
                             f"{backend}'s kernels with it, which aceso does not price; drop it")
        if given != DEEPEP_SMS_FLAG:
            notes.append(f"{given} without the flex dispatcher's hybridep backend does nothing")
        return None
    if sms not in (16, 32):
        raise AcesoError(f"{given} {sms}: HybridEP is priced at 16 or 32 SMs only (its published GB200 NVL72 "
                         "benchmarks); give 16 or 32, or drop it")
    return sms


# ----- export -------------------------------------------------------------------------------------------------
def freq_list(moe, num_layers: int) -> list[int]:
    """One 0/1 per layer (1 = MoE)."""
    if isinstance(moe.moe_layer_freq, list):
        return list(moe.moe_layer_freq)
    return [int(moe.is_moe_layer(i)) for i in range(num_layers)]


def pre_softmax_read(flag: bool, moe: dict) -> bool:
    """The spec's ``moe_router_pre_softmax`` of ``--moe-router-pre-softmax``: only where it changes the model (a
    softmax router above top-1; a sigmoid router ignores it, top-1 softmax needs it: the export writes it there)."""
    return flag and moe.get("moe_router_score_function", "softmax") == "softmax" and moe["moe_router_topk"] > 1


def moe_args(m) -> list[str]:
    """The Megatron-LM model flags of the MoE / MLA / MTP / q-k norm fields."""
    out: list[str] = []
    if (m.megatron or {}).get("qk_layernorm"):
        out.append("--qk-layernorm")
    if m.moe is not None:
        moe = m.moe
        for name, flag in MOE_FLAGS:
            v = getattr(moe, name)
            if v is not None:
                out += [flag, str(v)]
        out += [flag for name, flag in MOE_BOOLS if getattr(moe, name)]
        if moe.moe_router_bias_update_rate != BIAS_UPDATE_RATE:     # Megatron-LM's default otherwise
            out += ["--moe-router-bias-update-rate", repr(moe.moe_router_bias_update_rate)]
        if model_rules.pre_softmax(moe):
            out.append("--moe-router-pre-softmax")
        out += ["--moe-layer-freq", _freq_of(m)]
        out += ["--moe-router-load-balancing-type", moe.lb_type]
        out += ["--moe-aux-loss-coeff", repr(moe.moe_aux_loss_coeff)] if moe.lb_type in AUX_LOSS_TYPES else []
    if m.mla is not None:
        out.append("--multi-latent-attention")
        for name, flag, _ in MLA_FLAGS:
            v = getattr(m.mla, name)
            if v is not None:
                out += [flag, str(v)]
    if m.mtp_num_layers:
        out += ["--mtp-num-layers", str(m.mtp_num_layers)]
        out += ["--mtp-use-repeated-layer"] if m.mtp_use_repeated_layer else []     # Megatron-LM 0.17 on
    return out


def _freq_of(m) -> str:
    """``--moe-layer-freq``'s value: N, or the run-length list expression ``[0]*3+[1]*58``."""
    moe = m.moe
    if isinstance(moe.moe_layer_freq, int) and not moe.first_k_dense_layers:
        return str(moe.moe_layer_freq)
    runs: list[list[int]] = []
    for v in freq_list(moe, m.num_layers):
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "+".join(f"[{v}]*{n}" for v, n in runs)


def moe_parallel_args(c) -> list[str]:
    """The expert shape and the MoE run settings as Megatron-LM flags (empty for a dense model)."""
    if c.model.moe is None:
        return []
    s = c.settings.moe or MoEPlanSettings()
    out = ["--expert-model-parallel-size", str(c.ep)]
    out += ["--expert-tensor-parallel-size", str(c.etp)] if c.etp is not None else []
    out += ["--moe-token-dispatcher-type", s.token_dispatcher]
    if s.token_dispatcher == "flex":
        out += ["--moe-flex-dispatcher-backend", s.flex_backend]
    out += [flag for name, flag, _ in SETTING_FLAGS if getattr(s, name)]
    for name, flag, _ in VALUE_FLAGS:
        v = getattr(s, name)
        out += [flag, f"{v:g}" if isinstance(v, float) else str(v)] if v is not None else []
    return out


def moe_bridge_fields(c) -> dict[str, object]:
    """The Bridge ``model`` fields (GPTModelProvider / MLAModelProvider = megatron-core TransformerConfig names)."""
    m = c.model
    if m.moe is None and m.mla is None and not m.mtp_num_layers:
        return {}                                   # a dense model: as before (the recipe is a dense one)
    out: dict[str, object] = {"qk_layernorm": bool((m.megatron or {}).get("qk_layernorm")),
                              "mtp_num_layers": m.mtp_num_layers, "multi_latent_attention": m.mla is not None}
    if m.mtp_use_repeated_layer:                    # a megatron-core 0.19 field: only where set
        out["mtp_use_repeated_layer"] = True
    if m.moe is None:
        return {**out, "num_moe_experts": None, **(_mla(m) if m.mla is not None else {})}
    moe, s = m.moe, c.settings.moe or MoEPlanSettings()
    out["num_moe_experts"] = moe.num_experts
    out.update({name: getattr(moe, name) for name, _ in MOE_FLAGS[1:] + MOE_BOOLS
                if name != "moe_latent_size" or moe.moe_latent_size})      # LatentMoE only where set
    out["moe_layer_freq"] = moe.moe_layer_freq if isinstance(moe.moe_layer_freq, int) and not \
        moe.first_k_dense_layers else freq_list(moe, m.num_layers)
    out["moe_router_load_balancing_type"] = moe.lb_type
    # always written: a recipe's own (DeepSeek-V3's true) never stands in for the model's
    out["moe_router_pre_softmax"] = model_rules.pre_softmax(moe)
    out["moe_router_bias_update_rate"] = moe.moe_router_bias_update_rate    # a recipe's own never stands in
    out["moe_aux_loss_coeff"] = moe.moe_aux_loss_coeff
    # always written (null: no scaling), so the recipe's own factor (Nemotron-3 Nano's and DeepSeek-V3's 2.5, Kimi-K2's
    # 2.827) never stands in for the model's (HF routed_scaling_factor: the megatron block's)
    out["moe_router_topk_scaling_factor"] = (m.megatron or {}).get("moe_router_topk_scaling_factor")
    out["expert_model_parallel_size"] = c.ep
    out["expert_tensor_parallel_size"] = c.tp if c.etp is None else c.etp
    out["moe_token_dispatcher_type"] = s.token_dispatcher
    out["moe_flex_dispatcher_backend"] = s.flex_backend
    out.update({field: getattr(s, name) for name, _, field in SETTING_FLAGS
                if getattr(s, name) or field not in NEWER_FIELDS})     # a 0.19 field only where set
    # the router's dtype always (null: the model's dtype, as priced), so a recipe's own (every Nemotron-3, DeepSeek
    # and Qwen3 recipe sets fp32) never stands in for the plan's; the rank capacity (megatron-core 0.19) where set
    out.update({field: getattr(s, name) for name, _, field in VALUE_FLAGS
                if getattr(s, name) is not None or name == "router_dtype"})
    return {**out, **(_mla(m) if m.mla is not None else {})}


def _mla(m) -> dict[str, object]:
    return {"multi_latent_attention": True, **{name: getattr(m.mla, name) for name, _, _ in MLA_FLAGS}}
