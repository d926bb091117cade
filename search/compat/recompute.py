"""The reference's greedy, memory-driven recompute rule (SPEC §3.8, ``check_recompute``).

Our search chooses recompute itself and ``CompatCostModel`` evaluates exactly the recompute a plan states; this
rule is kept to reproduce reference searches. For one stage:

1. no recompute; if memory (+ ``peak_mem_in_backward``) fits the limit, stop;
2. group the stage's ops by name; a group's size is Σ A'(op) x (behind + 1); never ``enc-1st-layernorm``,
   ``*-conv1``, ``*-relu``, embeddings or post-process;
3. take the largest group not yet marked; mark it and the group of the op after its first occurrence; recompute
   every occurrence if the group is smaller than the excess, else the first occurrences until the excess is
   covered; each chosen op k sets rc_k = rc_{k+1} = 1; re-evaluate; stop when it fits or no group is left.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np

from .db import A
from .evaluate import layout_for, stage_memory_of, stage_rows
from .formulas import shared_space_factors

NEVER = ("encoder-embedding", "decoder-embedding", "gpt-post-process", "t5-post-process", "enc-1st-layernorm")


def _excluded(name: str) -> bool:
    return name in NEVER or name.endswith("-conv1") or name.endswith("-relu")


def greedy_recompute(names: tuple[str, ...], act: np.ndarray, behind: int, limit_mb: float,
                     memory_of: Callable[[np.ndarray], float], peak_mem_in_backward: float = 0.0) -> np.ndarray:
    """Op flags (int8) for one stage. ``act``: per-op A' (MB); ``memory_of(flags)``: the stage's total MB."""
    n = len(names)
    flags = np.zeros(n, dtype=np.int8)
    mem = memory_of(flags) + peak_mem_in_backward
    if mem <= limit_mb:
        return flags
    groups: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        groups.setdefault(name, []).append(k)
    size = {name: float(sum(act[k] for k in idx)) * (behind + 1) for name, idx in groups.items()}
    marked = {name for name in groups if _excluded(name)}
    while mem > limit_mb:
        left = [name for name in groups if name not in marked]
        if not left:
            break
        best = max(left, key=lambda nm: size[nm])  # first in op order on ties
        marked.add(best)
        first = groups[best][0]
        if first + 1 < n:
            marked.add(names[first + 1])
        excess = mem - limit_mb
        chosen = groups[best]
        if size[best] >= excess:
            chosen, covered = [], 0.0
            for k in groups[best]:
                chosen.append(k)
                covered += act[k] * (behind + 1)
                if covered >= excess:
                    break
        for k in chosen:
            flags[k] = 1
            if k + 1 < n:
                flags[k + 1] = 1
        mem = memory_of(flags) + peak_mem_in_backward
    return flags


def apply_greedy_recompute(cfg, db, limit_mb: float, peak_mem_in_backward: float = 0.0):
    """A copy of reference config ``cfg`` with every stage's recompute flags re-derived by the greedy rule."""
    layout = layout_for(cfg, db)
    out = copy.deepcopy(cfg)
    for i in range(cfg.num_stages):
        names, _, rows = stage_rows(cfg, db, layout, i)
        flags = greedy_recompute(names, rows[:, A] * shared_space_factors(names), cfg.num_stages - 1 - i, limit_mb,
                                 lambda f, i=i: stage_memory_of(cfg, db, layout, i, f)["total"],
                                 peak_mem_in_backward)
        out.recompute[i] = [int(f) for f in flags]
    out.raw["recompute_ops"] = out.recompute
    return out
