"""The reference's op-level config JSON (SPEC §4.8 / §5.1): read, check and write.

Fields: ``model_name, model_size, num_layers, ...model dims, global_batch_size, micro_batch_size, num_stages,
num_gpus[stage], checkpoint_activations[stage], resharding_stages[stage], num_ops_in_each_stage[stage]`` and the
per-op lists ``model_parallel_size_of_each_op, data_parallel_size_of_each_op, recompute_ops, algo_of_each_op``
(``[stage][op]``). The reference's checks (§5.1) are applied: world size, ``micro_batch_size % dp_op == 0``,
``global % micro == 0``, ``tp_op * dp_op == num_gpus[stage]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from search.io.errors import AcesoError, read_json

PER_OP = ("model_parallel_size_of_each_op", "data_parallel_size_of_each_op", "recompute_ops", "algo_of_each_op")
PER_STAGE = ("num_gpus", "checkpoint_activations", "resharding_stages", "num_ops_in_each_stage")


@dataclass
class RefConfig:
    """A reference config, with the per-op lists as ``[stage][op]`` ints."""

    raw: dict
    model_name: str
    model_size: str
    num_layers: int
    micro_batch_size: int
    global_batch_size: int
    num_gpus: list[int]
    num_ops: list[int]
    tp: list[list[int]]
    dp: list[list[int]]
    recompute: list[list[int]]
    algo: list[list[int]]
    resharding_stages: list[bool]

    @property
    def key(self) -> str:
        return f"{self.model_name}_{self.model_size}"

    @property
    def num_stages(self) -> int:
        return len(self.num_ops)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def stage_op_start(self, i: int) -> int:
        return sum(self.num_ops[:i])

    def to_json(self) -> str:
        """One field per line, each list on one line (the per-op lists are long)."""
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in self.raw.items()) + "\n}\n"


def _int(raw: dict, name: str, src: str) -> int:
    v = raw.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise AcesoError(f"{src}: {name} must be a positive integer, got {v!r}")
    return v


def parse_ref_config(raw: object, src: str = "config") -> RefConfig:
    if not isinstance(raw, dict):
        raise AcesoError(f"{src}: a reference config is a JSON object; this is not one")
    for name in ("model_name", "model_size", *PER_STAGE, *PER_OP):
        if name not in raw:
            raise AcesoError(f"{src}: {name} is missing; not an Aceso reference config (see docs/compat.md)")
    num_layers = _int(raw, "num_layers", src)
    mbs, gbs = _int(raw, "micro_batch_size", src), _int(raw, "global_batch_size", src)
    for name in ("num_ops_in_each_stage", "num_gpus"):
        v = raw[name]
        if not isinstance(v, list) or not v or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v):
            raise AcesoError(f"{src}: {name} must be a non-empty list of positive integers, got {str(v)[:40]}")
    num_ops = list(raw["num_ops_in_each_stage"])
    s = len(num_ops)
    if raw.get("num_stages", s) != s:
        raise AcesoError(f"{src}: num_stages ({raw['num_stages']}) != len(num_ops_in_each_stage) ({s})")
    for name in (*PER_STAGE, *PER_OP):
        if not isinstance(raw[name], list) or len(raw[name]) != s:
            raise AcesoError(f"{src}: {name} must be a list with one entry per stage ({s})")
    lists = {}
    for name in PER_OP:
        for i, row in enumerate(raw[name]):
            if not isinstance(row, list) or len(row) != num_ops[i] or not all(isinstance(x, int) for x in row):
                raise AcesoError(f"{src}: {name}[{i}] must list {num_ops[i]} integers (one per op of stage {i})")
        lists[name] = [list(r) for r in raw[name]]
    cfg = RefConfig(raw=raw, model_name=str(raw["model_name"]), model_size=str(raw["model_size"]),
                    num_layers=num_layers, micro_batch_size=mbs, global_batch_size=gbs,
                    num_gpus=list(raw["num_gpus"]), num_ops=num_ops,
                    tp=lists["model_parallel_size_of_each_op"], dp=lists["data_parallel_size_of_each_op"],
                    recompute=lists["recompute_ops"], algo=lists["algo_of_each_op"],
                    resharding_stages=[bool(x) for x in raw["resharding_stages"]])
    _check(cfg, src)
    return cfg


def _check(cfg: RefConfig, src: str) -> None:
    if cfg.global_batch_size % cfg.micro_batch_size:
        raise AcesoError(f"{src}: global_batch_size ({cfg.global_batch_size}) must be a multiple of "
                         f"micro_batch_size ({cfg.micro_batch_size})")
    for i in range(cfg.num_stages):
        if cfg.num_ops[i] < 1:
            raise AcesoError(f"{src}: num_ops_in_each_stage[{i}] must be at least 1")
        for k in range(cfg.num_ops[i]):
            t, d = cfg.tp[i][k], cfg.dp[i][k]
            if t < 1 or d < 1 or t * d != cfg.num_gpus[i]:
                raise AcesoError(f"{src}: stage {i} op {k}: tp ({t}) * dp ({d}) must equal num_gpus[{i}] "
                                 f"({cfg.num_gpus[i]})")
            if cfg.micro_batch_size % d:
                raise AcesoError(f"{src}: stage {i} op {k}: dp ({d}) must divide micro_batch_size "
                                 f"({cfg.micro_batch_size})")
            if cfg.recompute[i][k] not in (0, 1) or cfg.algo[i][k] not in (0, 1):
                raise AcesoError(f"{src}: stage {i} op {k}: recompute_ops and algo_of_each_op take 0 or 1")


def load_ref_config(path: str | Path) -> RefConfig:
    path = Path(path)
    raw = read_json(path, missing="no such reference config file")
    return parse_ref_config(raw, src=str(path))


def is_ref_config(raw: object) -> bool:
    """True if a parsed JSON object looks like a reference config (for commands that accept either format)."""
    return isinstance(raw, dict) and "num_ops_in_each_stage" in raw and "recompute_ops" in raw
