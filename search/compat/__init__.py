"""Aceso-compatible mode: the reference's database, op-level configs and cost model, reproduced exactly.

- ``db.AcesoDB``: reader of the artifact database (op CSVs, collective tables, p2p bandwidth).
- ``refconfig``: the reference's op-level config JSON.
- ``evaluate.evaluate_ref_config``: time and memory of a reference config as the reference computes them.
- ``mapping``: our ``ParallelPlan`` <-> reference config (``aceso export`` / ``aceso import``).
- ``costmodel.CompatCostModel``: the same formulas behind the cost-model API, for our plans (and ``evaluate_ref``
  for op-level configs); ``costmodel.make_compat_cost_model`` builds it (imported lazily, not from here).
- ``recompute.greedy_recompute``: the reference's memory-driven recompute rule (§3.8).

See docs/compat.md for what is reproduced and which quirks are kept.
"""

from .db import AcesoDB
from .evaluate import RefResult, RefStage, evaluate_ref_config
from .refconfig import RefConfig, is_ref_config, load_ref_config, parse_ref_config

__all__ = ["AcesoDB", "RefConfig", "RefResult", "RefStage", "evaluate_ref_config", "is_ref_config",
           "load_ref_config", "parse_ref_config"]
