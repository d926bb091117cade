"""Candidate constraints a user puts on the search (``--tp``, ``--pp``, ``--virtual-stages``/``--vpp``;
``--max-tp`` arrives folded into ``--tp`` by the CLI): checked against the model and the cluster with one line
naming the option and the fix, then applied to the space every search of a run shares (the uniform baseline, the
Megatron-LM search and the heterogeneous search all build their ``Space`` from the same training spec)."""

from __future__ import annotations

from search.io.errors import AcesoError


def _nums(values) -> str:
    return " ".join(map(str, values))


def tensor_sizes(model, cluster, training, usable: list[int]) -> tuple[int, ...]:
    """The usable tp degrees (powers of two dividing heads and FFN, dividing the query groups or a multiple of them
    as megatron-core allows (``search.spec.query_groups``), within a node) kept by
    ``training.tensor_parallel_sizes``; AcesoError naming the first one that is not usable."""
    want = training.tensor_parallel_sizes
    if want is None:
        return tuple(usable)
    bad = [t for t in sorted(set(want)) if t not in usable]
    if bad:
        raise AcesoError(f"--tp {bad[0]}: not a usable tensor-parallel size for {model.name} on {cluster.label} "
                         f"(a power of two dividing the {model.num_attention_heads} heads and FFN "
                         f"{model.ffn_hidden_size}, dividing or a multiple of the {model.groups} query groups, at "
                         f"most an NVLink domain of {cluster.nvlink_size}); "
                         f"choose from {_nums(usable)}")
    return tuple(t for t in usable if t in want)


def pipeline_sizes(model, cluster, training) -> frozenset[int] | None:
    """``training.pipeline_parallel_sizes`` as a set (None: any); AcesoError when one cannot hold a stage."""
    want = training.pipeline_parallel_sizes
    if want is None:
        return None
    layers = len(model.layer_starts) - 1
    for pp in sorted(set(want)):
        if pp > cluster.num_gpus:
            raise AcesoError(f"--pp {pp}: more pipeline stages than the {cluster.num_gpus} GPUs of {cluster.label}; "
                             f"choose at most {cluster.num_gpus}")
        if pp > model.num_units:
            raise AcesoError(f"--pp {pp}: more pipeline stages than {model.name}'s {layers} layers can fill; "
                             f"choose at most {min(model.num_units, cluster.num_gpus)}")
    return frozenset(want)


def check_virtual(model, vs) -> None:
    """Some requested chunk count must fit on two stages (one unit per chunk), else no plan can use any."""
    top = max(model.num_units // 2, 1)
    bad = [v for v in vs if v > top]
    if bad and len(bad) == len(vs):
        raise AcesoError(f"--virtual-stages {bad[0]}: {model.name} has {model.num_units} units (half layers), at "
                         f"most {top} model chunks per stage on two stages; choose at most {top}")


MOE_OPTIONS = (("expert_parallel_sizes", "--ep"), ("max_expert_parallel", "--max-ep"),
               ("expert_tensor_parallel_sizes", "--etp"), ("token_dispatchers", "--dispatcher"),
               ("moe_router_dtype", "--moe-router-dtype"), ("moe_hybridep_num_sms", "--moe-hybridep-num-sms"))


def expert_limits(model, cluster, training, tps) -> dict:
    """``--ep`` / ``--max-ep`` / ``--etp`` as ``ExpertSpace`` filters (``eps``, ``max_ep``, ``etps``), each
    checked against megatron-core's folding rules (``moe_plan.check_expert_shape``) with one line naming the option
    and what is allowed; ``--dispatcher`` is checked here too (flex needs CUDA). A dense model takes none."""
    given = [(name, flag) for name, flag in MOE_OPTIONS if getattr(training, name) is not None]
    if model.moe is None:
        if given:
            raise AcesoError(f"{given[0][1]}: {model.name} is a dense model (no experts); drop {given[0][1]}")
        return {}
    moe, n = model.moe, cluster.num_gpus
    eps = training.expert_parallel_sizes
    divisors = [e for e in range(1, min(moe.num_experts, n) + 1) if moe.num_experts % e == 0 and n % e == 0]
    for e in sorted(set(eps or ())):
        if moe.num_experts % e or e > n:
            why = (f"must divide num_experts ({moe.num_experts})" if moe.num_experts % e
                   else f"more than the {n} GPUs of {cluster.label}")
            raise AcesoError(f"--ep {e}: {why} of {model.name}; choose from {_nums(divisors)}")
    top = training.max_expert_parallel
    if top is not None and not [e for e in (eps or divisors) if e <= top]:
        raise AcesoError(f"--max-ep {top}: no expert-parallel degree of {_nums(eps or divisors)} is left; raise it")
    widths = [moe.moe_ffn_hidden_size] + ([moe.moe_shared_expert_intermediate_size]
                                          if moe.moe_shared_expert_intermediate_size else [])
    for x in sorted(set(training.expert_tensor_parallel_sizes or ())):
        if x > 1 and model.add_bias_linear:
            raise AcesoError(f"--etp {x}: megatron-core runs {model.name}'s linear biases with expert tp 1 only "
                             "(TransformerConfig: 'Bias in Moe is only supported when ETP==1'); use --etp 1")
        if x != 1 and (x not in tps or any(w % x for w in widths)):
            ok = [t for t in tps if t == 1 or all(w % t == 0 for w in widths)]
            raise AcesoError(f"--etp {x}: a stage's expert tp is 1 or its tp, dividing the expert width "
                             f"{_nums(widths)}; choose from {_nums(ok)}")
    if "flex" in (training.token_dispatchers or ()) and cluster.gpu.name == "cpu":
        raise AcesoError(f"--dispatcher flex: DeepEP / HybridEP need CUDA GPUs, which {cluster.label} has not; use "
                         "alltoall or allgather")
    return {"eps": None if eps is None else frozenset(eps), "max_ep": top,
            "etps": None if training.expert_tensor_parallel_sizes is None
            else frozenset(training.expert_tensor_parallel_sizes)}
