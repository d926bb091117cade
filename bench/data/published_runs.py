"""Loader for ``published_runs.json``: published, measured throughput of Megatron(-like) training runs.

Torch-free. ``load_published_runs(set=None)`` reads and validates the file and returns its runs (dicts, as stored),
optionally only the ``"calibration"`` or the ``"check"`` set. A malformed row raises ``PublishedRunsError`` naming the
row id and the field. The FLOP-counting conventions the sources use are in ``flop_formulas()`` (by id) and
``flops_per_iteration(row)`` evaluates a row's own convention, so that a predicted iteration time can be converted into
the source's metric (TFLOP/s per GPU, MFU). Field meanings and every source: ``bench/data/README.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent / "published_runs.json"

SETS = ("calibration", "check")
GPUS = ("v100", "a100", "h100", "h200", "b200", "gb200", "gb300", "b300")
PRECISIONS = ("fp16", "bf16", "fp8", "16bit-unspecified")
RECOMPUTE = ("none", "selective", "full")
MEASURED_METRICS = ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "hfu", "fraction_of_peak", "aggregate_pflops",
                    "iteration_time_s", "tokens_per_s_per_gpu", "training_days_300b_tokens")
MODEL_KEYS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length", "vocab_size", "activation", "normalization", "position_embedding", "tied_embeddings",
              "bias", "stated_params_billion")
MODEL_INTS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length", "vocab_size")
MODEL_REQUIRED = ("family", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
PARALLEL_KEYS = ("tp", "pp", "dp", "cp", "vpp", "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce",
                 "overlap_param_gather", "tp_comm_overlap", "recompute", "recompute_method", "recompute_num_layers",
                 "micro_batch_size", "global_batch_size")
PARALLEL_BOOLS = ("sequence_parallel", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                  "tp_comm_overlap")
PARALLEL_REQUIRED_INTS = ("tp", "pp", "dp", "cp", "global_batch_size")
PARALLEL_OPTIONAL_INTS = ("vpp", "recompute_num_layers", "micro_batch_size")


class PublishedRunsError(ValueError):
    """The data file is malformed; the message names the row id and the field."""


def _fail(row_id: str, field: str, msg: str) -> None:
    raise PublishedRunsError(f"published_runs.json: row {row_id!r}: field {field!r}: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_type(row_id: str, field: str, value: Any, kind: str, nullable: bool = False) -> None:
    if value is None:
        if not nullable:
            _fail(row_id, field, "missing or null")
        return
    ok = {"str": isinstance(value, str) and value != "", "int": _is_int(value), "num": _is_num(value),
          "bool": isinstance(value, bool), "dict": isinstance(value, dict), "list": isinstance(value, list)}[kind]
    if not ok:
        _fail(row_id, field, f"expected {kind}{' or null' if nullable else ''}, got {value!r}")


def _validate_row(row: Any, index: int, formulas: dict) -> None:
    if not isinstance(row, dict):
        raise PublishedRunsError(f"published_runs.json: runs[{index}] is not an object")
    rid = row.get("id")
    if not isinstance(rid, str) or not rid:
        raise PublishedRunsError(f"published_runs.json: runs[{index}]: field 'id': missing or not a string")
    for field, kind in (("set", "str"), ("stock_megatron", "bool"), ("framework", "str"), ("source", "dict"),
                        ("measured", "dict"), ("flop_formula", "str"), ("gpu", "str"), ("gpu_variant", "str"),
                        ("num_gpus", "int"), ("precision", "str"), ("fp8", "bool"), ("model", "dict"),
                        ("parallel", "dict"), ("unknown", "list"), ("notes", "str")):
        if field == "notes":
            if not isinstance(row.get(field), str):
                _fail(rid, field, "missing or not a string")
            continue
        _check_type(rid, field, row.get(field), kind)
    _check_type(rid, "gpu_memory_gb", row.get("gpu_memory_gb"), "num", nullable=True)
    if row["set"] not in SETS:
        _fail(rid, "set", f"{row['set']!r} not in {SETS}")
    if row["gpu"] not in GPUS:
        _fail(rid, "gpu", f"{row['gpu']!r} not in {GPUS}")
    if row["precision"] not in PRECISIONS:
        _fail(rid, "precision", f"{row['precision']!r} not in {PRECISIONS}")
    if row["fp8"] != (row["precision"] == "fp8"):
        _fail(rid, "fp8", "must be true exactly when precision is 'fp8'")
    if row["num_gpus"] <= 0:
        _fail(rid, "num_gpus", "must be positive")
    if row["flop_formula"] not in formulas:
        _fail(rid, "flop_formula", f"{row['flop_formula']!r} is not an id in flop_formulas")

    src = row["source"]
    for f in ("title", "where", "quote"):
        _check_type(rid, f"source.{f}", src.get(f), "str")
    if not src.get("url") and not all(src.get(k) for k in ("repo", "path", "commit")):
        _fail(rid, "source", "needs 'url' or 'repo' + 'path' + 'commit'")
    for i, cs in enumerate(row.get("config_sources", [])):
        for f in ("repo", "path", "commit", "where", "quote"):
            _check_type(rid, f"config_sources[{i}].{f}", cs.get(f) if isinstance(cs, dict) else None, "str")

    if not row["measured"]:
        _fail(rid, "measured", "empty")
    for k, v in row["measured"].items():
        if k not in MEASURED_METRICS:
            _fail(rid, f"measured.{k}", f"unknown metric (known: {MEASURED_METRICS})")
        if not _is_num(v) or v <= 0:
            _fail(rid, f"measured.{k}", f"expected a positive number, got {v!r}")

    m = row["model"]
    for k in MODEL_KEYS:
        if k not in m:
            _fail(rid, f"model.{k}", "missing (use null when the source does not state it)")
    for k in MODEL_REQUIRED:
        _check_type(rid, f"model.{k}", m[k], "str" if k == "family" else "int")
    for k in MODEL_INTS:
        _check_type(rid, f"model.{k}", m[k], "int", nullable=True)
    for k in ("activation", "normalization", "position_embedding"):
        _check_type(rid, f"model.{k}", m[k], "str", nullable=True)
    for k in ("tied_embeddings", "bias"):
        _check_type(rid, f"model.{k}", m[k], "bool", nullable=True)
    _check_type(rid, "model.stated_params_billion", m["stated_params_billion"], "num", nullable=True)

    p = row["parallel"]
    for k in PARALLEL_KEYS:
        if k not in p:
            _fail(rid, f"parallel.{k}", "missing (use null when the source does not state it)")
    for k in PARALLEL_REQUIRED_INTS:
        _check_type(rid, f"parallel.{k}", p[k], "int")
        if p[k] <= 0:
            _fail(rid, f"parallel.{k}", "must be positive")
    for k in PARALLEL_OPTIONAL_INTS:
        _check_type(rid, f"parallel.{k}", p[k], "int", nullable=True)
    for k in PARALLEL_BOOLS:
        _check_type(rid, f"parallel.{k}", p[k], "bool", nullable=True)
    if p["recompute"] is not None and p["recompute"] not in RECOMPUTE:
        _fail(rid, "parallel.recompute", f"{p['recompute']!r} not in {RECOMPUTE} (or null)")
    _check_type(rid, "parallel.recompute_method", p["recompute_method"], "str", nullable=True)

    for u in row["unknown"]:
        if not isinstance(u, str):
            _fail(rid, "unknown", f"entries must be field names, got {u!r}")
        for section in ("model", "parallel"):
            if u in row[section] and row[section][u] is not None:
                _fail(rid, f"{section}.{u}", "listed in 'unknown' but has a value")
    if "consistency_exempt" in row:
        _check_type(rid, "consistency_exempt", row["consistency_exempt"], "dict")


def _load_document(path: Path | str | None = None) -> dict:
    path = Path(path) if path is not None else DATA_FILE
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or not isinstance(
            doc.get("flop_formulas"), dict):
        raise PublishedRunsError(f"{path}: expected an object with 'runs' (list) and 'flop_formulas' (object)")
    for fid, f in doc["flop_formulas"].items():
        for k in ("id", "text", "where"):
            if not isinstance(f.get(k), str) or not f.get(k):
                raise PublishedRunsError(f"{path}: flop_formulas[{fid!r}]: field {k!r}: missing or not a string")
        if f["id"] != fid:
            raise PublishedRunsError(f"{path}: flop_formulas[{fid!r}]: field 'id' is {f['id']!r}")
    seen = set()
    for i, row in enumerate(doc["runs"]):
        _validate_row(row, i, doc["flop_formulas"])
        if row["id"] in seen:
            _fail(row["id"], "id", "duplicate id")
        seen.add(row["id"])
    return doc


def load_published_runs(set: str | None = None, path: Path | str | None = None) -> list[dict]:  # noqa: A002
    """The validated runs, all of them or only ``set`` ("calibration" or "check")."""
    if set is not None and set not in SETS:
        raise ValueError(f"set must be one of {SETS} or None, got {set!r}")
    runs = _load_document(path)["runs"]
    return [r for r in runs if set is None or r["set"] == set]


def flop_formulas(path: Path | str | None = None) -> dict[str, dict]:
    """The FLOP-counting conventions by id (text, whether recompute FLOPs are counted, the peak the source uses)."""
    return _load_document(path)["flop_formulas"]


# ---------------------------------------------------------------------------------------------- FLOP conventions

def _megatron_core_r08(m: dict, batch: int) -> float:
    """Megatron-LM ``num_floating_point_operations`` at core_r0.8.0 (dense; gated MLP only for swiglu)."""
    h, l, s, a = m["hidden_size"], m["num_layers"], m["seq_length"], m["num_attention_heads"]
    g = m["num_query_groups"] or a
    f = m["ffn_hidden_size"] or 4 * h
    gated = 1.5 if m["activation"] == "swiglu" else 1.0
    return 12 * batch * s * l * h * h * ((1 + g / a + s / h) + (f / h) * gated + m["vocab_size"] / (2 * l * h))


def _sc21_eq3(m: dict, batch: int) -> float:
    h, l, s, v = m["hidden_size"], m["num_layers"], m["seq_length"], m["vocab_size"]
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _korthikanti(m: dict, batch: int, hardware: bool) -> float:
    h, l, s, v = m["hidden_size"], m["num_layers"], m["seq_length"], m["vocab_size"]
    return 72 * batch * l * s * h * h * (1 + s / ((3 if hardware else 6) * h) + v / (12 * h * l))


def _dgxc(m: dict, batch: int) -> float:
    """DGXC Benchmarking READMEs' 'Notes': B s [12 l h^2 (1 + g/a + s/h) + 6 k l f h + 6 V h]; the Llama 3.1 notes
    count GQA and the gated MLP (k = 3), the GPT-3/Nemotron-4 notes neither (g = a, k = 2)."""
    h, l, s, a, v = m["hidden_size"], m["num_layers"], m["seq_length"], m["num_attention_heads"], m["vocab_size"]
    f = m["ffn_hidden_size"] or 4 * h
    llama = m["family"] == "llama"
    g, k = (m["num_query_groups"] or a, 3) if llama else (a, 2)
    return batch * s * (12 * l * h * h * (1 + g / a + s / h) + 6 * k * l * f * h + 6 * v * h)


_EVALUATORS = {
    "megatron-core-r0.8": lambda m, b: _megatron_core_r08(m, b),
    "nemotron4-mfu": lambda m, b: _megatron_core_r08(m, b),
    "sc21-eq3": _sc21_eq3,
    "korthikanti-eq7": lambda m, b: _korthikanti(m, b, hardware=False),
    "korthikanti-eq8": lambda m, b: _korthikanti(m, b, hardware=True),
    "dgxc-model-flops": _dgxc,
}


def flops_per_iteration(row: dict, formula: str | None = None) -> float:
    """FLOPs of one iteration (global batch) of ``row`` under ``formula`` (default: the row's own convention).

    Supported: ``megatron-core-r0.8`` (also used for ``nemotron4-mfu``), ``sc21-eq3``, ``korthikanti-eq7``,
    ``korthikanti-eq8`` (hardware FLOPs with selective recompute) and ``dgxc-model-flops``. Raises ``KeyError`` for
    conventions the sources do not write out (``llama3-paper``, ``megatron-bridge-flop-utils``).
    """
    fid = formula or row["flop_formula"]
    return _EVALUATORS[fid](row["model"], row["parallel"]["global_batch_size"])


def sc21_params(model: dict) -> float:
    """Parameter count of SC'21 eq. (2): P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) (tied embeddings, 4h MLP)."""
    h, l, s, v = model["hidden_size"], model["num_layers"], model["seq_length"], model["vocab_size"]
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
