"""Candidate constraints a user puts on the search (``--tp``, ``--pp``, ``--virtual-stages``/``--vpp``;
``--max-tp`` arrives folded into ``--tp`` by the CLI): checked against the model and the cluster with one line
naming the option and the fix, then applied to the space every search of a run shares (the uniform baseline, the
Megatron-LM search and the heterogeneous search all build their ``Space`` from the same training spec)."""

from __future__ import annotations

from ..errors import AcesoError


def _nums(values) -> str:
    return " ".join(map(str, values))


def tensor_sizes(model, cluster, training, usable: list[int]) -> tuple[int, ...]:
    """The usable tp degrees (powers of two dividing heads, query groups and FFN, within a node) kept by
    ``training.tensor_parallel_sizes``; AcesoError naming the first one that is not usable."""
    want = training.tensor_parallel_sizes
    if want is None:
        return tuple(usable)
    bad = [t for t in sorted(set(want)) if t not in usable]
    if bad:
        raise AcesoError(f"--tp {bad[0]}: not a usable tensor-parallel size for {model.name} on {cluster.label} "
                         f"(a power of two dividing the {model.num_attention_heads} heads, {model.groups} query "
                         f"groups and FFN {model.ffn_hidden_size}, at most an NVLink domain of {cluster.nvlink_size}); "
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
