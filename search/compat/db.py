"""Reader of the Aceso artifact database (SPEC.md §1): op CSVs, collective tables, p2p bandwidth.

Files (one folder, e.g. ``../shared/aceso-reference-db/miniset``):

- ``{key}_mbs{m}_tp{t}_algo{a}.csv`` — one row per distinct op type: ``op_name, forward-compute,
  backward-compute`` (µs), ``input_size, output_size, weights, activations, fwd_reserved, bwd_reserved`` (MB).
- ``prim_{key}_{collective}_{n}gpus.csv`` — ``data_size(MB), time(ms)``, keyed by whole MB.
- ``p2p_intra_node.csv`` (and optionally ``p2p_inter_node.csv``) — row 1 sizes in MB, row 2 bandwidth in GB/s.

Unlike the reference (which fills missing cells with a silent 1e6), a lookup of a file that is not in the
database raises ``AcesoError``; a value the profiler wrote as 1e7 ("profile failed") is kept as the reference does.
A database may cover only some (per-GPU batch, tp) pairs (the artifact's T5-11B has no micro-batch 8):
``profiled()`` lists them, and the search keeps to them.

Some models read another model's files (``SHARED_PROFILES``): the reference profiles T5-22B as T5-11B, whose
layers are the same (only the depth differs; ``aceso_cost_model.read_profiled_time`` and
``model_ops_info.get_op_list``: "T5 22B and 11B share same op"), op rows and collective tables alike.
"""

from __future__ import annotations

import csv
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from search.io.errors import AcesoError

# Column order of the op CSVs after op_name; the index of each metric in an op row.
METRICS = ("fwd_us", "bwd_us", "in_mb", "out_mb", "weights_mb", "act_mb", "fwd_res_mb", "bwd_res_mb")
F, B, IN, OUT, W, A, RF, RB = range(8)
OP_HEADER = ["op_name", "forward-compute", "backward-compute", "input_size", "output_size", "weights",
             "activations", "fwd_reserved", "bwd_reserved"]
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
# model key -> the key whose files it reads (the reference's mapping, as data; SPEC §2.4)
SHARED_PROFILES = {"t5_22B": "t5_11B"}
_OP_FILE = re.compile(r"^(?P<key>.+)_mbs(?P<m>\d+)_tp(?P<t>\d+)_algo(?P<a>\d+)\.csv$")
_PRIM_FILE = re.compile(r"^prim_(?P<key>.+)_(?P<prim>all_gather|all_reduce|reduce_scatter|all_to_all)_"
                        r"(?P<n>\d+)gpus\.csv$")


def _read_rows(path: Path) -> list[list[str]]:
    try:
        with open(path, newline="") as f:
            return [row for row in csv.reader(f) if row]
    except FileNotFoundError:
        raise AcesoError(f"{path}: no such database file; check --db") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise AcesoError(f"{path}: unreadable database file ({e}); re-copy the database") from None


def _floats(path: Path, lineno: int, cells: list[str]) -> list[float]:
    try:
        return [float(c) for c in cells]
    except ValueError:
        raise AcesoError(f"{path}: line {lineno} has a non-numeric value ({','.join(cells)}); "
                         "the file is corrupt, re-copy the database") from None


def read_op_csv(path: Path) -> dict[str, np.ndarray]:
    """op name -> the 8 metrics of ``METRICS``."""
    rows = _read_rows(path)
    if not rows or [c.strip() for c in rows[0]] != OP_HEADER:
        raise AcesoError(f"{path}: header is not `{','.join(OP_HEADER)}`; not an Aceso op profile")
    table = {}
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(OP_HEADER):
            raise AcesoError(f"{path}: line {i} has {len(row)} columns, expected {len(OP_HEADER)}; the file "
                             "is corrupt, re-copy the database")
        table[row[0].strip()] = np.array(_floats(path, i, row[1:]))
    if not table:
        raise AcesoError(f"{path}: no op rows; the file is corrupt, re-copy the database")
    return table


def read_collective_csv(path: Path) -> dict[int, float]:
    """whole-MB size -> ms."""
    rows = _read_rows(path)
    if not rows or not rows[0][0].startswith("data_size"):
        raise AcesoError(f"{path}: header is not `data_size(MB),time(ms)`; not an Aceso collective profile")
    out = {}
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise AcesoError(f"{path}: line {i} has {len(row)} columns, expected 2; re-copy the database")
        size, ms = _floats(path, i, row)
        out[int(size)] = ms
    return out


def read_p2p_csv(path: Path) -> np.ndarray:
    """Bandwidth in GB/s for sizes 1, 2, 4, ... MB (row 2 of the file)."""
    rows = _read_rows(path)
    if len(rows) < 2 or len(rows[0]) != len(rows[1]):
        raise AcesoError(f"{path}: expected two rows of equal length (sizes, GB/s); re-copy the database")
    bw = np.array(_floats(path, 2, rows[1]))
    if np.any(bw <= 0):
        raise AcesoError(f"{path}: bandwidths must be positive; re-copy the database")
    return bw


class AcesoDB:
    """The profiled database of one model (``key`` such as ``gpt_1_3B``) in folder ``db_dir``."""

    def __init__(self, db_dir: str | Path, key: str):
        self.dir = Path(db_dir)
        self.key = key                                   # the model's key (configs carry it)
        self.profile_key = SHARED_PROFILES.get(key, key)   # the key of the files read
        if not self.dir.is_dir():
            raise AcesoError(f"--db {db_dir}: no such folder; point it at an Aceso database (e.g. .../miniset)")
        self._files: dict[tuple[int, int, int], Path] = {}
        keys = set()
        for p in self.dir.iterdir():
            m = _OP_FILE.match(p.name)
            if m:
                keys.add(m["key"])
                if m["key"] == self.profile_key:
                    self._files[(int(m["m"]), int(m["t"]), int(m["a"]))] = p
        if not self._files:
            held = ", ".join(sorted(keys)) or "none"
            raise AcesoError(f"--db {db_dir}: no op profiles for model {self._named()} (the database holds: "
                             f"{held}); use a database profiled for this model")
        self.family = "t5" if key.startswith("t5") else "gpt"
        self.mbs_list = sorted({m for m, _, _ in self._files})
        self.tp_list = sorted({t for _, t, _ in self._files})
        tmpl = (self.mbs_list[0], 1, 0)
        if tmpl not in self._files:
            raise AcesoError(f"--db {db_dir}: {self.profile_key}_mbs{tmpl[0]}_tp1_algo0.csv is missing; the "
                             "reference reads the op list from it")
        self.template = tuple(read_op_csv(self._files[tmpl]))
        from .ops import TEMPLATES
        if self.template != TEMPLATES[self.family]:
            raise AcesoError(f"{self._files[tmpl]}: its op list is not the reference's {self.family} op model "
                             "(SPEC §2); use a database of the Aceso artifact")
        self.p2p_intra = read_p2p_csv(self.dir / "p2p_intra_node.csv")
        inter = self.dir / "p2p_inter_node.csv"
        self.p2p_inter = read_p2p_csv(inter) if inter.exists() else self.p2p_intra  # reference fallback
        self._collectives: dict[tuple[str, int], dict[int, float]] = {}
        for p in self.dir.iterdir():
            m = _PRIM_FILE.match(p.name)
            if m and m["key"] == self.profile_key:
                self._collectives[(m["prim"], int(m["n"]))] = read_collective_csv(p)

    def _named(self) -> str:
        """The model key, with the key it reads when that is another one."""
        if self.profile_key == self.key:
            return self.key
        return f"{self.key} (read as {self.profile_key}, as the reference does)"

    # ----- op tables -----------------------------------------------------------------------------------------
    def has(self, mbs: int, tp: int, algo: int = 0) -> bool:
        return (mbs, tp, algo) in self._files

    def profiled(self, algo: int = 0) -> frozenset[tuple[int, int]]:
        """The (per-GPU batch, tp) pairs with an op profile at ``algo``."""
        return frozenset((m, t) for m, t, a in self._files if a == algo)

    @lru_cache(maxsize=None)
    def table(self, mbs: int, tp: int, algo: int = 0) -> dict[str, np.ndarray]:
        if (mbs, tp, algo) not in self._files:
            pairs = ", ".join(f"({m}, {t})" for m, t in sorted(self.profiled(algo)))
            alias = "" if self.profile_key == self.key else f" ({self.key} reads {self.profile_key}'s rows)"
            raise AcesoError(
                f"--db {self.dir}: no profile {self.profile_key}_mbs{mbs}_tp{tp}_algo{algo}.csv{alias} (profiled "
                f"per-GPU batch, tp at algo {algo}: {pairs or 'none'}); the reference would silently use its 1e6 "
                "placeholder — choose a profiled micro-batch/dp/tp")
        table = read_op_csv(self._files[(mbs, tp, algo)])
        missing = [n for n in self.template if n not in table]
        if missing:
            raise AcesoError(f"{self._files[(mbs, tp, algo)]}: op {missing[0]} is missing; the file is corrupt, "
                             "re-copy the database")
        return table

    def op(self, name: str, mbs: int, tp: int, algo: int = 0) -> np.ndarray:
        return self.table(mbs, tp, algo)[name]

    @lru_cache(maxsize=None)
    def op_matrix(self, names: tuple[str, ...], mbs: int, tp: int, algo: int = 0) -> np.ndarray:
        """(len(names), 8) metrics of a whole op list at one (per-GPU batch, tp, algo); read-only."""
        t = self.table(mbs, tp, algo)
        mat = np.stack([t[n] for n in names])
        mat.setflags(write=False)
        return mat

    # ----- communication -------------------------------------------------------------------------------------
    def collective_ms(self, prim: str, n: int, size_mb: float) -> float:
        """Reference lookup (SPEC §3.3): key round(size); else size-1; else the 100000 ms veto."""
        table = self._collectives.get((prim, n), {})
        size = int(round(size_mb))
        if size in table:
            return table[size]
        if size - 1 in table:
            return table[size - 1]
        return 100000.0
