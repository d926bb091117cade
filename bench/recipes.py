"""Which of a published Megatron-Bridge row's stack flags ran.

The shared tables' ``args`` carry the CUDA-graph (``--cuda-graph-impl`` / ``--cuda-graph-scope``), MoE-overlap
(``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``) and TP-overlap (``--tp-comm-overlap``) flags "as the
matched Megatron-Bridge recipe sets them" (the file's ``about``); ``recipe`` names that recipe and its tag, which for
some rows is a later release's. The args are priced as they are, with one exception that has its own evidence: a
combination megatron-core refuses cannot have run. The 25.09 Qwen3-30B-A3B B200 FP8 row is the one case: its
(later) recipe's ``moe_router moe_preprocess`` CUDA graphs with the row's own drop-and-pad alltoall dispatcher are
refused by megatron-core 0.16.1's ``TransformerConfig`` ("moe_preprocess cuda graph is not supported when there are
DtoH copies and synchronizations in the preprocess step"), so ``own_args`` drops the CUDA-graph flags there (the
table's own columns stay) and says so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from search.io.errors import AcesoError  # noqa: E402

GRAPH_FLAGS = ("--cuda-graph-impl", "--cuda-graph-scope")


def drop_flags(args: str, flags) -> tuple[str, list[str]]:
    """``args`` without ``flags`` (each with its values); the flags removed."""
    removed = []
    for flag in flags:
        pat = re.compile(rf"\s{re.escape(flag)}(\s+(?!--)\S+)*")
        if pat.search(" " + args):
            removed.append(flag)
            args = pat.sub("", " " + args).strip()
    return args, removed


def own_args(row: dict) -> tuple[str, list[str]]:
    """(the row's args as they ran, the flags removed because megatron-core refuses them with the rest)."""
    from search.megatron.importer import read_megatron
    args = row["args"] or ""
    if "--cuda-graph-impl" not in args:
        return args, []
    try:
        from search.spec.cluster import parse_cluster
        gpus = row.get("gpus") or parse_cluster(row["cluster"]).num_gpus
        read_megatron(args, world_size=gpus, version="core_v0.16.1")      # the rows' args: core_v0.16.1 lines
    except AcesoError as e:
        if "stack.cuda_graphs" in str(e):
            return drop_flags(args, GRAPH_FLAGS)
    return args, []
