"""The measurements of a profiling run, in the order every rank executes them, and their database rows.

A measurement is named by a key (``unit/decoder/attention/tp2/b1``, ``embedding/tp1/b2``, ``head/tp1/b2``,
``coll/all_reduce/g4/1048576``, ``p2p/intra/1048576``): the resumable partial file stores results by key and
the database is assembled from the keys' results (``assemble``) with the cost model's writer
(``search.costmodel.profiledb.ProfileDBWriter``), the passes of a measurement merged by median. Pure (no
torch): testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from search.costmodel.profiledb import ProfileDBWriter
from search.spec.model import ModelSpec

from .comm_plan import KINDS, group_key, group_plan, message_sizes


@dataclass(frozen=True)
class Task:
    key: str
    what: str                # unit | embedding | head | coll | p2p
    tp: int = 0
    batch: int = 0
    stack: str = ""
    kind: str = ""
    group: str = ""
    nbytes: int = 0
    inter: bool = False
    ep: int = 1              # the moe unit's expert-parallel degree (MoE models; the other units at the first --ep)


def unit_kinds(model: ModelSpec) -> list[tuple[str, str]]:
    out = []
    for u in model.units:
        if (u.stack, u.kind) not in out:
            out.append((u.stack, u.kind))
    return out


def unit_tasks(model: ModelSpec, tps: list[int], batches: list[int], passes: int = 1,
               eps: list[int] | tuple[int, ...] = (1,)) -> list[Task]:
    """Every unit kind, the embedding and the head at each (tp, batch), then the optimizer; ``passes`` times
    over the whole grid (pass p > 0 adds ``#p`` to the keys), so a slow spell of a shared machine hits one pass
    of a measurement, which the median over passes then discards. An MoE model's moe unit is measured at every
    (tp, ep, batch) (key ``unit/decoder/moe/tp1/ep2/b1``), the other units once per (tp, batch), at the first ep."""
    out = []
    for p in range(passes):
        sfx = f"#{p}" if p else ""
        for tp in tps:
            for ep in (eps if model.moe is not None else (1,)):
                first = ep == eps[0] or model.moe is None
                for b in batches:
                    for stack, kind in unit_kinds(model):
                        if kind == "moe":
                            out.append(Task(f"unit/{stack}/{kind}/tp{tp}/ep{ep}/b{b}{sfx}", "unit", tp, b, stack,
                                            kind, ep=ep))
                        elif first:
                            out.append(Task(f"unit/{stack}/{kind}/tp{tp}/b{b}{sfx}", "unit", tp, b, stack, kind,
                                            ep=ep))
                    if first:
                        out.append(Task(f"embedding/tp{tp}/b{b}{sfx}", "embedding", tp, b, ep=ep))
                        out.append(Task(f"head/tp{tp}/b{b}{sfx}", "head", tp, b, ep=ep))
        out.append(Task(f"optimizer{sfx}", "optimizer"))
    return out


_TIMES = ("fwd_us", "bwd_us", "recompute_us", "step_us", "clip_us", "us_per_param", "clip_us_per_param")


def merge_passes(results: list[dict]) -> dict:
    """One result from the passes of a measurement: the median of each time (element-wise), the rest (bytes,
    deterministic) from the first pass."""
    out = dict(results[0])
    if len(results) > 1:
        for f in _TIMES:
            if f in out:
                out[f] = np.median(np.array([r[f] for r in results], dtype=float), axis=0).tolist()
        out["passes"] = len(results)
    return out


def comm_tasks(world: int, per_node: int, lo: int, hi: int) -> list[Task]:
    sizes = message_sizes(lo, hi)
    out = []
    for ranks, inter in group_plan(world, per_node):
        g = group_key(ranks, inter)
        for kind in KINDS:
            out += [Task(f"coll/{kind}/{g}/{n}", "coll", kind=kind, group=g, nbytes=n, inter=inter) for n in sizes]
    for inter in (False, True):
        peer = per_node if inter else 1
        if peer < world and (inter or per_node >= 2):
            where = "inter" if inter else "intra"
            out += [Task(f"p2p/{where}/{n}", "p2p", nbytes=n, inter=inter) for n in sizes]
    return out


_EXTRA = ("spread", "saved_bytes", "workspace_bytes", "passes")
# the moe unit's columns (profiler/moe.py; docs/profile-db.md), parts_fwd_us merged over passes by median
_MOE = ("ep", "etp", "dispatcher", "grouped_gemm", "permute_fusion", "expert_weight_bytes", "parts_fwd_us")


def assemble(writer: ProfileDBWriter, model: ModelSpec, tasks: list[Task], done: dict[str, dict]) -> None:
    """Add every finished task's result to ``writer`` (collectives and p2p as curves of points)."""
    s_enc = model.seq_length
    s_dec = model.decoder_seq_length if model.is_t5 else model.seq_length
    curves: dict[tuple, list] = {}
    passes: dict[str, list[dict]] = {}
    for t in tasks:
        if t.key in done:
            passes.setdefault(t.key.split("#")[0], []).append(done[t.key])
    for t in tasks:
        if "#" in t.key or t.key not in passes:
            continue
        r = merge_passes(passes[t.key])
        if "parts_fwd_us" in r and len(passes[t.key]) > 1:
            r["parts_fwd_us"] = {k: float(np.median([p["parts_fwd_us"][k] for p in passes[t.key]]))
                                 for k in r["parts_fwd_us"]}
        if t.what == "unit":
            writer.add_unit(t.stack, t.kind, seq=s_enc if t.stack == "encoder" else s_dec, batch=t.batch, tp=t.tp,
                            fwd_us=r["fwd_us"], bwd_us=r["bwd_us"], recompute_us=tuple(r["recompute_us"]),
                            act_bytes=tuple(r["act_bytes"]), weight_bytes=r["weight_bytes"],
                            peak_bytes=tuple(r["peak_bytes"]) if "peak_bytes" in r else None)
            writer.data["units"][-1].update({k: r[k] for k in _EXTRA + _MOE if k in r})
        elif t.what in ("embedding", "head"):
            writer.add_part(t.what, seq=s_enc if t.what == "embedding" else s_dec, batch=t.batch, tp=t.tp,
                            fwd_us=r["fwd_us"], bwd_us=r["bwd_us"], act_bytes=r["act_bytes"],
                            weight_bytes=r["weight_bytes"])
            writer.data[t.what][-1].update({k: r[k] for k in _EXTRA if k in r})
        elif t.what == "optimizer":   # not in format version 1: an extra block (see docs/profiler.md)
            writer.data["optimizer"] = r
        elif t.what == "coll":
            n = int(t.group[1:].rstrip("xs"))
            curves.setdefault(("coll", t.kind, n, t.inter), []).append((t.nbytes, r["us"]))
        else:
            curves.setdefault(("p2p", t.inter), []).append((t.nbytes, r["us"]))
    for key, pts in curves.items():
        if key[0] == "p2p":
            writer.add_p2p(inter=key[1], points=pts)
        elif key[1] == "all_to_all":   # not in the format's collectives (the reader refuses unknown kinds)
            writer.data.setdefault("all_to_all", []).append(
                {"group": key[2], "inter": key[3], "points": [list(p) for p in pts]})
        else:
            writer.add_collective(key[1], group=key[2], inter=key[3], points=pts)
