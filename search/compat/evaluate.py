"""Evaluate a reference op-level config exactly as the Aceso reference does (SPEC §3.2-3.7).

Per op k of stage i the database row is looked up at (micro_bs / dp_k, tp_k, algo_k). Quirks kept: the
out-comm looks the last op up with the **first** op's tp (§3.2); p2p uses the off-by-one bandwidth index (§3.4);
resharding between differently laid-out ops of a stage (GPT only, §3.3); the name-based shared-space memory
rules and reserved space (§3.7); no DP all-reduce. Cross-node boundaries use the inter-node table (the intra
table when the database has none) as in the reference's full breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from search.io.errors import AcesoError
from .db import IN, OUT, RB, RF, AcesoDB, A, B, F, W
from .formulas import p2p_us, pipeline_1f1b, shared_space_factors, stage_memory
from .ops import OpLayout, build_layout
from .refconfig import RefConfig
from .reshard import reshard_us


@dataclass
class RefStage:
    """One stage of a reference config: per-micro-batch times (ms) and memory (MB per GPU)."""

    time_ms: float            # the stage's 1F1B total (the golden CSV's "time")
    t_ms: float               # per micro-batch: fwd + bwd + recompute + in + out
    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    in_ms: float
    out_ms: float
    memory_mb: float          # total = normal + reserved
    normal_mb: float
    reserved_mb: float
    memory: dict[str, float] = field(default_factory=dict)


@dataclass
class RefResult:
    iteration_ms: float
    stages: list[RefStage]


def layout_for(cfg: RefConfig, db: AcesoDB) -> OpLayout:
    if cfg.key != db.key:
        raise AcesoError(f"the config is for {cfg.key} but the database is for {db.key}; use the matching --db")
    layout = build_layout(db.template, db.family, cfg.num_layers, cfg.num_layers if db.family == "t5" else 0)
    if sum(cfg.num_ops) != layout.num_ops:
        raise AcesoError(f"num_ops_in_each_stage adds up to {sum(cfg.num_ops)} ops, but {cfg.key} with "
                         f"{cfg.num_layers} layers has {layout.num_ops}; fix the config's op counts")
    return layout


def evaluate_ref_config(cfg: RefConfig, db: AcesoDB, gpus_per_node: int | None = None,
                        resharding: bool | None = None) -> RefResult:
    """Iteration time and per-stage time/memory of a reference config; ``resharding`` None = GPT on, T5 off."""
    layout = layout_for(cfg, db)
    if resharding is None:
        resharding = db.family == "gpt"
    times, parts, first_gpu = [], [], 0
    for i in range(cfg.num_stages):
        st = _stage(cfg, db, layout, i, first_gpu, gpus_per_node, resharding)
        times.append(st.t_ms)
        parts.append(st)
        first_gpu += cfg.num_gpus[i]
    totals = pipeline_1f1b(times, cfg.num_micro_batches)
    for st, total in zip(parts, totals):
        st.time_ms = total
    return RefResult(iteration_ms=max(totals), stages=parts)


def stage_rows(cfg: RefConfig, db: AcesoDB, layout: OpLayout, i: int) -> tuple[tuple, list[tuple], np.ndarray]:
    """Stage i's op names, (name, tp, dp, algo) per op, and database rows (n, 8) at each op's own batch/tp/algo."""
    s0, n = cfg.stage_op_start(i), cfg.num_ops[i]
    names = layout.names[s0:s0 + n]
    ops = [(names[k], cfg.tp[i][k], cfg.dp[i][k], cfg.algo[i][k]) for k in range(n)]
    rows = np.stack([db.op(name, cfg.micro_batch_size // d, t, a) for name, t, d, a in ops])
    return names, ops, rows


def stage_memory_of(cfg: RefConfig, db: AcesoDB, layout: OpLayout, i: int, flags) -> dict[str, float]:
    """The memory of stage i under op recompute ``flags`` (used by the greedy recompute rule)."""
    names, _, rows = stage_rows(cfg, db, layout, i)
    s0 = cfg.stage_op_start(i)
    return stage_memory(float(rows[:, W].sum()), float(rows[0, IN]), rows[:, A] * shared_space_factors(names),
                        rows[:, RF], rows[:, RB], flags, layout.segment_start[s0:s0 + len(names)],
                        cfg.num_stages - 1 - i)


def _stage(cfg: RefConfig, db: AcesoDB, layout: OpLayout, i: int, first_gpu: int, gpn: int | None,
           resharding: bool) -> RefStage:
    s0, n = cfg.stage_op_start(i), cfg.num_ops[i]
    names, ops, rows = stage_rows(cfg, db, layout, i)
    mbs = cfg.micro_batch_size
    flags = np.array(cfg.recompute[i], dtype=bool)
    fwd, bwd = rows[:, F].sum(), rows[:, B].sum()
    rc = rows[flags, F].sum()
    fwd_rs = bwd_rs = 0.0
    if resharding:
        for k in range(1, n):
            f, b = reshard_us(db, ops[k - 1], ops[k], rows[k, IN])
            fwd_rs, bwd_rs = fwd_rs + f, bwd_rs + b
    in_cross = gpn is not None and first_gpu > 0 and first_gpu % gpn == 0
    out_cross = gpn is not None and (first_gpu + cfg.num_gpus[i]) % gpn == 0
    out_size = db.op(names[-1], mbs // cfg.dp[i][-1], cfg.tp[i][0], cfg.algo[i][-1])[OUT]  # tp of op 0 (quirk)
    in_us = p2p_us(rows[0, IN], db.p2p_inter if in_cross else db.p2p_intra) + fwd_rs
    out_us = p2p_us(out_size, db.p2p_inter if out_cross else db.p2p_intra) + bwd_rs
    act = rows[:, A] * shared_space_factors(names)
    mem = stage_memory(float(rows[:, W].sum()), float(rows[0, IN]), act, rows[:, RF], rows[:, RB], flags,
                       layout.segment_start[s0:s0 + n], cfg.num_stages - 1 - i)
    t_us = fwd + bwd + rc + in_us + out_us
    return RefStage(time_ms=0.0, t_ms=t_us / 1000, fwd_ms=fwd / 1000, bwd_ms=bwd / 1000, recompute_ms=rc / 1000,
                    in_ms=in_us / 1000, out_ms=out_us / 1000, memory_mb=mem["total"], normal_mb=mem["normal"],
                    reserved_mb=mem["reserved"], memory=mem)
