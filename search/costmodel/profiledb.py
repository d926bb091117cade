"""Profile-database cost source: measured per-unit times and memory, fitted communication curves.

The format (versioned JSON, one file; docs/profile-db.md) holds, for one GPU type and one model architecture:
per unit kind (stack, kind), sequence length, per-rank micro-batch and tp: forward/backward/recompute microseconds
and activation bytes per recompute choice; the same for the embedding and the head (final norm, logits, loss);
collective times by kind, group size, intra/inter node and bytes; p2p times by bytes, intra and inter node.

Lookups (all deterministic):
- unit times and bytes are piecewise-linear in the per-rank batch between measured batches; outside the measured
  range they extrapolate linearly from the two nearest points (proportionally from a single point) and the source
  records a warning. A tp that was not profiled scales from the nearest profiled tp by tp0/tp (ideal scaling,
  optimistic; warned). A missing unit kind or sequence length is an error naming what to profile.
- communication: within the measured sizes, piecewise-linear interpolation of the measured points; outside them
  the least-squares alpha-beta line ``t = alpha + bytes/beta`` fitted to all points (warned). A group size or link
  with no measurements falls back to the analytic ring model (``comm.CommModel``; warned). Never a penalty number.
The model check compares the architecture (everything but the depth: a DB profiled on a 2-layer model serves any
depth); the GPU check compares the GPU preset name. Mismatches are refused with one line saying what differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError, read_json
from search.io.files import write_output
from ..layers import kinds, resolve
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec
from .comm import CommModel
from .memory import MB, loss_transient_bytes, tied_copy_params_per_rank
from .profiledb_moe import check_kernels, ep_comm_us, missing, plan_shape, row_shape
from .types import N_RC, UNAVAILABLE_MS, UnitTable

FORMAT = "aceso-profile-db"
VERSION = 1
DB_FILE = "profile-db.json"
ARCH_FIELDS = ("family", "hidden_size", "num_attention_heads", "groups", "head_dim", "ffn_hidden_size",
               "padded_vocab_size", "activation", "normalization", "position_embedding", "add_bias_linear",
               "tied_embeddings", "layer_spec", "megatron")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


MOE_DEPTH_FIELDS = ("moe_layer_freq", "first_k_dense_layers")   # which layers are MoE: the depth, not the units


def model_fingerprint(model: ModelSpec) -> dict:
    """The architecture fields a profile depends on (not the depth). An MoE model adds its ``moe`` block but
    the layer pattern (units are per layer); a dense model's fingerprint has no ``moe`` key, as older databases."""
    out = {f: getattr(model, f) for f in ARCH_FIELDS}
    if model.moe is not None:
        out["moe"] = {k: v for k, v in model.moe.model_dump().items() if k not in MOE_DEPTH_FIELDS}
    return out


# ----- reading ------------------------------------------------------------------------------------------------------
def load_profile_db(path: str | Path) -> dict:
    """Read and check a profile DB (a file, or a folder holding ``profile-db.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / DB_FILE
    raw = read_json(p, label=f"--db {path}",
                    missing=f"no profile database at {p}; run `aceso profile` or give the right path",
                    corrupt="corrupt profile database, not valid JSON; re-run the profiler")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise AcesoError(f"--db {p}: not a profile database (format must be '{FORMAT}')")
    if raw.get("version") != VERSION:
        raise AcesoError(f"--db {p}: profile database version {raw.get('version')} is not supported (this version "
                         f"reads {VERSION}); re-run the profiler")
    for key in ("hardware", "model", "dtype", "units", "embedding", "head"):
        if key not in raw:
            raise AcesoError(f"--db {p}: corrupt profile database, field '{key}' is missing; re-run the profiler")
    from .profiledb_check import check_profile_db
    bad = check_profile_db(raw)
    if bad:
        raise AcesoError(f"--db {p}: corrupt profile database, {bad}; re-run the profiler")
    raw["_path"] = str(p)
    return raw


def _check_match(db: dict, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> None:
    src = db["_path"]
    gpu = db["hardware"].get("gpu")
    if gpu != cluster.gpu.name:
        raise AcesoError(f"--db {src}: profiled on gpu '{gpu}' but the cluster has '{cluster.gpu.name}'; profile "
                         "this GPU or use --cost-model analytic")
    want = model_fingerprint(model)
    have = db["model"]
    diff = [f"{k} {have.get(k)!r} vs {want.get(k)!r}" for k in {**have, **want}
            if k in ARCH_FIELDS + ("moe",) and have.get(k) != want.get(k)]
    if diff:
        raise AcesoError(f"--db {src}: profiled for another model ({'; '.join(diff[:3])}); profile {model.name}")
    if db["dtype"] != training.precision:
        raise AcesoError(f"--db {src}: profiled in {db['dtype']} but training uses {training.precision}; "
                         "profile that precision")


def _interp(xs: np.ndarray, ys: np.ndarray, x: float) -> tuple[float, bool]:
    """Piecewise-linear y(x); linear extrapolation outside [xs[0], xs[-1]] (proportional from one point)."""
    if len(xs) == 1:
        return float(ys[0] * x / xs[0]), x != xs[0]
    if xs[0] <= x <= xs[-1]:
        return float(np.interp(x, xs, ys)), False
    i = 0 if x < xs[0] else len(xs) - 2
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(max(ys[i] + slope * (x - xs[i]), 0.0)), True


def fit_alpha_beta(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Least-squares ``t = alpha + size * inv_beta`` (both clipped at 0); returns (alpha, inv_beta)."""
    if len(sizes) == 1:
        return 0.0, float(times[0] / sizes[0])
    a = np.vstack([np.ones_like(sizes), sizes]).T
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, times, rcond=None)
    return max(float(alpha), 0.0), max(float(inv_beta), 0.0)


class _Curve:
    """Measured (bytes, ms) points of one collective/p2p."""

    def __init__(self, points, where: str):
        pts = sorted((float(b), float(us) / 1e3) for b, us in points)
        if not pts or any(b <= 0 or t < 0 for b, t in pts):
            raise AcesoError(f"profile database: {where} needs points [bytes > 0, microseconds >= 0]")
        self.x = np.array([p[0] for p in pts])
        self.y = np.array([p[1] for p in pts])
        self.alpha, self.inv_beta = fit_alpha_beta(self.x, self.y)
        self.where = where

    def __call__(self, nbytes: float, warn) -> float:
        if nbytes <= 0:
            return 0.0
        if self.x[0] <= nbytes <= self.x[-1]:
            return float(np.interp(nbytes, self.x, self.y))
        warn(f"{self.where}: {nbytes / MB:.1f} MiB is outside the measured {self.x[0] / MB:.2f}-"
             f"{self.x[-1] / MB:.1f} MiB; extrapolated with the fitted alpha-beta line")
        return self.alpha + nbytes * self.inv_beta


class FittedComm(CommModel):
    """``CommModel`` whose collectives and p2p come from measured curves where the database has them."""

    def __init__(self, db: dict, cluster: ClusterSpec, warn):
        super().__init__(cluster)
        self._warn = warn
        self._coll: dict[tuple[str, int, bool], _Curve] = {}
        for i, c in enumerate(db.get("collectives", [])):
            kind, n, inter = c.get("kind"), int(c.get("group", 0)), bool(c.get("inter", False))
            if kind not in COLLECTIVES or n < 2:
                raise AcesoError(f"profile database: collectives[{i}] needs kind in {COLLECTIVES} and group >= 2")
            self._coll[(kind, n, inter)] = _Curve(c.get("points", []), f"{kind} on {n} GPUs "
                                                  f"{'inter' if inter else 'intra'}-node")
        self._p2p = {bool(c.get("inter", False)): _Curve(c.get("points", []),
                                                         f"p2p {'inter' if c.get('inter') else 'intra'}-node")
                     for c in db.get("p2p", [])}

    def _collective(self, kind: str, nbytes: float, n: int, inter: bool, domains: int | None = None) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        curve = self._coll.get((kind, n, inter))
        if curve is None:
            self._warn(f"{kind} on {n} GPUs {'inter' if inter else 'intra'}-node was not profiled; "
                       "used the analytic ring model")
            return getattr(super(), kind)(nbytes, n, inter, domains=domains)
        return curve(nbytes, self._warn)

    # the measured curves are the algorithm NCCL picked on the profiled machine: ``in_network`` changes nothing
    def all_reduce(self, nbytes: float, n: int, inter: bool = False, members: int = 1, domains: int | None = None,
                   in_network: bool = False) -> float:
        return self._collective("all_reduce", nbytes, n, inter, domains)

    def all_gather(self, nbytes: float, n: int, inter: bool = False, members: int = 1, domains: int | None = None,
                   in_network: bool = False) -> float:
        return self._collective("all_gather", nbytes, n, inter, domains)

    def reduce_scatter(self, nbytes: float, n: int, inter: bool = False, members: int = 1,
                       domains: int | None = None, in_network: bool = False) -> float:
        return self._collective("reduce_scatter", nbytes, n, inter, domains)

    def p2p(self, nbytes: float, inter: bool = False) -> float:
        curve = self._p2p.get(inter)
        if curve is None:
            self._warn(f"p2p {'inter' if inter else 'intra'}-node was not profiled; used the analytic model")
            return super().p2p(nbytes, inter)
        return curve(nbytes, self._warn)


_ENTRY_FIELDS = ("batch", "tp", "seq", "fwd_us", "bwd_us", "act_bytes")
_WEIGHTS = ("weight_bytes", "expert_weight_bytes")   # per rank, the same at every batch
_LOOKED_UP = ("fwd_us", "bwd_us", "recompute_us", "act_bytes", "peak_bytes", "ep_comm_us") + _WEIGHTS


def _choices_measured(part: str, kind: str) -> tuple[int, ...]:
    """Valid lengths of an entry's per-choice lists: embedding/head 1; units 3 (none, selective, full), the units
    whose kind takes attn_dropout (attention) also 4 (+ attn_dropout, newer profiles)."""
    if part != "units":
        return (1,)
    k = _kind(kind)
    return (3, 4) if k is None or "attn_dropout" in k.recompute else (3,)


def _kind(name: str):
    """The registered layer kind of a database row's ``kind``, None for a kind not registered (its rows are read
    and never looked up: no unit of the model has it)."""
    return next((k for k in kinds() if k.name == name and k.variant_of is None), None)


class ProfileSource:
    """Produces ``UnitTable``s from a checked profile database.

    What it prices (``features``): the measured units carry no sequence or context parallelism and no
    transformer-engine TP overlap, so none of those: the cost model refuses plans that use them and the search does
    not explore them. Interleaving, the distributed optimizer and DP / parameter-gather overlap are priced by
    ``CostModel`` from the measured unit times and the fitted collective curves (docs/profile-db.md).
    """

    name = "profile"
    features: tuple[str, ...] = ()

    def __init__(self, db: dict, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec):
        _check_match(db, model, cluster, training)
        self.db, self.model, self.cluster, self.training = db, model, cluster, training
        self.warnings: list[str] = []
        self.comm = FittedComm(db, cluster, self._warn)
        self.dt = 4.0 if training.dtype == "fp32" else 2.0
        self._groups = self._index(db)
        # optional block (written by `aceso profile`): the measured optimizer step + gradient clipping per parameter
        opt = db.get("optimizer")
        self.optimizer_ms_per_param = ((opt["us_per_param"] + opt.get("clip_us_per_param", 0.0)) / 1e3
                                       if isinstance(opt, dict) and "us_per_param" in opt else None)

    def _warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    def _index(self, db: dict) -> dict[tuple, list[dict]]:
        """(part, stack, kind, seq, tp, expert shape) -> entries sorted by batch (the shape: ``profiledb_moe``;
        () but for moe rows)."""
        groups: dict[tuple, list[dict]] = {}
        for part in ("units", "embedding", "head"):
            for i, e in enumerate(db[part]):
                miss = [f for f in _ENTRY_FIELDS if f not in e]
                kind = e.get("kind", part)
                if miss or len(e["act_bytes"]) not in _choices_measured(part, kind):
                    raise AcesoError(f"--db {db['_path']}: corrupt profile database, {part}[{i}] lacks "
                                     f"{', '.join(miss) or 'a valid act_bytes'}; re-run the profiler")
                key = (part, e.get("stack", "decoder"), kind, int(e["seq"]), int(e["tp"]), row_shape(e))
                if part == "units" and getattr(_kind(kind), "routed_experts", False):
                    e = {**e, "ep_comm_us": ep_comm_us(e)}
                groups.setdefault(key, []).append(e)
        for key, v in groups.items():
            v.sort(key=lambda e: e["batch"])
            if len({len(e["act_bytes"]) for e in v}) > 1:
                raise AcesoError(f"--db {db['_path']}: corrupt profile database, the {key[2]} rows at seq {key[3]}, "
                                 f"tp {key[4]} measure different recompute choices; re-run the profiler")
        return groups

    def expert_shapes(self) -> frozenset[tuple[int, int, int, str]] | None:
        """The (tp, ep, etp, dispatcher) of the database's moe rows at the model's sequence length: the only expert
        shapes this source prices (``profiledb_moe``), so the search's expert space (None: a dense model)."""
        if self.model.moe is None:
            return None
        seq = self.model.seq_length
        return frozenset((k[4], *k[5]) for k in self._groups if k[0] == "units" and k[2] == "moe" and k[3] == seq)

    def _lookup(self, part: str, stack: str, kind: str, seq: int, batch: float, tp: int,
                shape: tuple = ()) -> dict[str, np.ndarray]:
        tps = sorted(k[4] for k in self._groups if k[:4] == (part, stack, kind, seq) and k[5] == shape)
        what = f"{part} {stack} {kind} at seq {seq}" if part == "units" else f"{part} at seq {seq}"
        if shape and tp not in tps:     # an expert shape is never scaled from another (profiledb_moe)
            have = [(k[4], k[5]) for k in self._groups if k[:4] == (part, stack, kind, seq)]
            raise missing(self.db["_path"], seq, tp, shape, have)
        if not tps:
            raise AcesoError(f"--db {self.db['_path']}: no measurements for {what}; profile it")
        t0 = tp if tp in tps else min(tps, key=lambda t: (abs(np.log(t / tp)), t))
        entries = self._groups[(part, stack, kind, seq, t0, shape)]
        xs = np.array([float(e["batch"]) for e in entries])
        out = {}
        extrap = False
        for f in _LOOKED_UP:
            if f not in entries[0]:
                continue
            ys = np.array([np.atleast_1d(np.asarray(e[f], dtype=float)) for e in entries])
            vals = []
            for j in range(ys.shape[1]):
                v, x = _interp(xs, ys[:, j], batch) if f not in _WEIGHTS else (float(ys[0, j]), False)
                vals.append(v)
                extrap |= x
            out[f] = np.array(vals)
        if extrap:
            self._warn(f"{what}: per-rank batch {batch:g} is outside the measured {xs[0]:g}-{xs[-1]:g}; "
                       "extrapolated linearly")
        if t0 != tp:
            self._warn(f"{what}: tp {tp} was not profiled; scaled from tp {t0} by {t0}/{tp} (ideal, optimistic)")
            for f in ("fwd_us", "bwd_us", "recompute_us", "act_bytes", "peak_bytes", "weight_bytes"):
                if f in out:
                    out[f] = out[f] * t0 / tp
        return out

    def unit_table(self, batch: float, tp: int, cp: int = 1, sp: bool = False, tp_overlap: bool = False,
                   ep: int = 1, etp: int = 0, moe=None) -> UnitTable:
        """``ep``/``etp``/``moe``: the stage's expert shape and the plan's MoE settings (MoE models: the moe rows
        of that shape, ``profiledb_moe``); cp, sp and tp_overlap are never asked of this source (``features``)."""
        m = self.model
        s_enc = m.seq_length
        s_dec = m.decoder_seq_length if m.is_t5 else m.seq_length
        n = m.num_units
        fwd, bwd, params, eparams, epc = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        rec, act, peak = np.zeros((n, N_RC)), np.zeros((n, N_RC)), np.zeros((n, N_RC))
        rows: dict[tuple[str, str], dict] = {}
        shape = plan_shape(m, tp, ep, etp, moe) if m.moe is not None else ()
        for i, u in enumerate(m.units):
            key = (u.stack, u.kind)
            if key not in rows:
                x = shape if resolve(m, u.kind).routed_experts else ()
                rows[key] = self._lookup("units", u.stack, u.kind, s_enc if u.stack == "encoder" else s_dec,
                                         batch, tp, x)
                if x:
                    check_kernels(self.db["_path"], self._groups[("units", u.stack, "moe", s_dec, tp, x)][0], moe)
            r = rows[key]
            fwd[i], bwd[i] = r["fwd_us"][0] / 1e3, r["bwd_us"][0] / 1e3
            k = len(r["act_bytes"])     # 3, or 4 where attn_dropout was measured (attention units)
            act[i] = r["act_bytes"][0] / MB
            rec[i, k:] = UNAVAILABLE_MS
            act[i, :k] = r["act_bytes"] / MB
            rec[i, :k] = r["recompute_us"][:k] / 1e3 if "recompute_us" in r else (0.0, 0.0, fwd[i], fwd[i])[:k]
            peak[i, :k] = r["peak_bytes"][:k] / MB if "peak_bytes" in r else act[i, 0] - act[i, :k]
            params[i] = r["weight_bytes"][0] / self.dt if "weight_bytes" in r else 0.0
            eparams[i] = r["expert_weight_bytes"][0] / self.dt if "expert_weight_bytes" in r else 0.0
            epc[i] = r["ep_comm_us"][0] / 1e3 if "ep_comm_us" in r else 0.0
        emb = self._lookup("embedding", "decoder", "embedding", s_enc, batch, tp)
        head = self._lookup("head", "decoder", "head", s_dec, batch, tp)
        h = m.hidden_size
        boundary = np.full(n + 1, self.dt * s_dec * batch * h / MB)
        if m.is_t5:
            boundary[:m.num_encoder_units + 1] = self.dt * s_enc * batch * h / MB
            boundary[m.num_encoder_units + 1:] += self.dt * s_enc * batch * h / MB
        return UnitTable(
            batch=batch, tp=tp, fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, act_mb=act, peak_mb=peak,
            weight_params=params, boundary_mb=boundary,
            embed_fwd_ms=emb["fwd_us"][0] / 1e3, embed_bwd_ms=emb["bwd_us"][0] / 1e3,
            embed_params=emb.get("weight_bytes", [0.0])[0] / self.dt, embed_act_mb=emb["act_bytes"][0] / MB,
            head_fwd_ms=head["fwd_us"][0] / 1e3, head_bwd_ms=head["bwd_us"][0] / 1e3,
            head_params=head.get("weight_bytes", [0.0])[0] / self.dt, head_act_mb=head["act_bytes"][0] / MB,
            head_peak_mb=loss_transient_bytes(s_dec * batch * m.padded_vocab_size / tp, self.dt) / MB,  # formula
            word_embed_params=tied_copy_params_per_rank(m, tp),
            encoder_output_mb=self.dt * s_enc * batch * h / MB if m.is_t5 else 0.0,
            expert_params=eparams if eparams.any() else None,
            ep_comm_ms=epc if epc.any() else None, ep_hidden_ms=np.zeros(n) if epc.any() else None,
        )


# ----- writing ------------------------------------------------------------------------------------------------------
class ProfileDBWriter:
    """Builds a profile database (the profiler's output); ``save`` writes it atomically."""

    def __init__(self, model: ModelSpec, gpu: str, dtype: str, hardware: dict | None = None):
        self.data = {"format": FORMAT, "version": VERSION, "hardware": {"gpu": gpu, **(hardware or {})},
                     "model": model_fingerprint(model), "model_name": model.name, "dtype": dtype,
                     "units": [], "embedding": [], "head": [], "collectives": [], "p2p": []}

    def add_unit(self, stack: str, kind: str, seq: int, batch: float, tp: int, fwd_us: float, bwd_us: float,
                 recompute_us: tuple[float, ...], act_bytes: tuple[float, ...],
                 weight_bytes: float, peak_bytes: tuple[float, ...] | None = None) -> None:
        """One unit measurement; the per-choice tuples follow ``RECOMPUTE_CHOICES`` (3 entries, or 4 with
        attn_dropout for attention units)."""
        e = {"stack": stack, "kind": kind, "seq": seq, "batch": batch, "tp": tp, "fwd_us": fwd_us, "bwd_us": bwd_us,
             "recompute_us": list(recompute_us), "act_bytes": list(act_bytes), "weight_bytes": weight_bytes}
        if peak_bytes is not None:
            e["peak_bytes"] = list(peak_bytes)
        self.data["units"].append(e)

    def add_part(self, part: str, seq: int, batch: float, tp: int, fwd_us: float, bwd_us: float, act_bytes: float,
                 weight_bytes: float) -> None:
        """``part`` = embedding | head."""
        self.data[part].append({"seq": seq, "batch": batch, "tp": tp, "fwd_us": fwd_us, "bwd_us": bwd_us,
                                "act_bytes": [act_bytes], "weight_bytes": weight_bytes})

    def add_collective(self, kind: str, group: int, inter: bool, points: list[tuple[float, float]]) -> None:
        """``points`` = [(bytes, microseconds)]; bytes = the full tensor (all-gather: the gathered result)."""
        self.data["collectives"].append({"kind": kind, "group": group, "inter": inter,
                                         "points": [list(p) for p in points]})

    def add_p2p(self, inter: bool, points: list[tuple[float, float]]) -> None:
        self.data["p2p"].append({"inter": inter, "points": [list(p) for p in points]})

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        if p.is_dir():
            p = p / DB_FILE
        # the one writer: atomic, and with the permissions every other output gets (umask; a replaced file's own)
        write_output(json.dumps(self.data, indent=1), str(p))
        return p
