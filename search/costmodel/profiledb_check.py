"""Input validation of a profile database (docs/profile-db.md), before any lookup: strict types and bounds, so a
hand-edited or truncated file is one line naming the field (``units[3].fwd_us: Input should be a valid number
(got 'fast')``), never a ``ValueError`` deep in the cost model or a negative prediction.

Times are microseconds, finite and >= 0 (at most ``MAX_US``, an hour); bytes finite and >= 0 (at most
``MAX_BYTES``, 1 PiB); ``batch`` > 0, ``tp``, ``seq`` and collective ``group`` positive integers; message sizes
> 0. Fields this version does not read are allowed (newer profilers may add some); booleans are not numbers.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

MAX_US = 3.6e9              # one hour
MAX_BYTES = float(1 << 50)  # 1 PiB
MAX_INT = 1 << 24

_US = Field(ge=0, le=MAX_US)
_BYTES = Field(ge=0, le=MAX_BYTES)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class _Entry(_Strict):
    batch: float = Field(gt=0, le=MAX_INT)
    tp: int = Field(ge=1, le=MAX_INT)
    seq: int = Field(ge=1, le=MAX_INT)
    fwd_us: float = _US
    bwd_us: float = _US
    act_bytes: list[float] = Field(min_length=1, max_length=8)
    recompute_us: list[float] | None = Field(None, max_length=8)
    peak_bytes: list[float] | None = Field(None, max_length=8)
    weight_bytes: float = _BYTES

    @pydantic.field_validator("act_bytes", "peak_bytes")
    @classmethod
    def _bytes(cls, v):
        if v is not None and any(not 0 <= x <= MAX_BYTES for x in v):
            raise ValueError(f"every entry must be bytes in [0, {MAX_BYTES:.0e}]")
        return v

    @pydantic.field_validator("recompute_us")
    @classmethod
    def _times(cls, v):
        if v is not None and any(not 0 <= x <= MAX_US for x in v):
            raise ValueError(f"every entry must be microseconds in [0, {MAX_US:.0e}]")
        return v


class _Unit(_Entry):
    stack: Literal["decoder", "encoder"] = "decoder"
    kind: Literal["attention", "cross_attention", "mlp", "moe"]
    # moe rows (docs/profile-db.md): the expert shape and dispatcher they were measured at, the routed experts' bytes
    ep: int = Field(1, ge=1, le=MAX_INT)
    etp: int | None = Field(None, ge=1, le=MAX_INT)
    dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    expert_weight_bytes: float = Field(0.0, ge=0, le=MAX_BYTES)
    parts_fwd_us: dict[str, float] | None = None

    @pydantic.field_validator("parts_fwd_us")
    @classmethod
    def _parts(cls, v):
        if v is not None and any(not 0 <= x <= MAX_US for x in v.values()):
            raise ValueError(f"every part must be microseconds in [0, {MAX_US:.0e}]")
        return v


class _Curve(_Strict):
    inter: bool = False
    points: list[list[float]] = Field(min_length=1, max_length=1 << 16)

    @pydantic.field_validator("points")
    @classmethod
    def _points(cls, v):
        for pt in v:
            if len(pt) != 2 or not 0 < pt[0] <= MAX_BYTES or not 0 <= pt[1] <= MAX_US:
                raise ValueError("points must be pairs [bytes > 0, microseconds >= 0]")
        return v


class _Collective(_Curve):
    kind: Literal["all_reduce", "all_gather", "reduce_scatter"]
    group: int = Field(ge=2, le=MAX_INT)


class _AllToAll(_Curve):
    group: int = Field(ge=2, le=MAX_INT)


class _Optimizer(_Strict):
    us_per_param: float = Field(ge=0, le=1e6)
    clip_us_per_param: float = Field(0.0, ge=0, le=1e6)


class _Hardware(_Strict):
    gpu: str = Field(min_length=1, max_length=64)


class ProfileDBFile(_Strict):
    """The checked shape of a version-1 profile database (format and version are checked before this)."""

    hardware: _Hardware
    model: dict
    dtype: Literal["bf16", "fp16", "fp32"]
    units: list[_Unit] = Field(max_length=1 << 20)
    embedding: list[_Entry] = Field(max_length=1 << 20)
    head: list[_Entry] = Field(max_length=1 << 20)
    collectives: list[_Collective] = Field([], max_length=1 << 20)
    p2p: list[_Curve] = Field([], max_length=64)
    all_to_all: list[_AllToAll] = Field([], max_length=1 << 20)
    optimizer: _Optimizer | None = None


def check_profile_db(raw: dict) -> str | None:
    """None if ``raw`` is a well-formed profile database, else one line naming the first bad field."""
    from search.io.errors import _loc_to_path, format_validation_error

    try:
        ProfileDBFile.model_validate(raw)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "missing" and len(first["loc"]) > 1:
            return f"{_loc_to_path(tuple(first['loc'][:-1]))} lacks {first['loc'][-1]}"
        return format_validation_error(e)
    return None
