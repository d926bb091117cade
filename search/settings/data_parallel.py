"""How a plan's data-parallel synchronization runs (``PlanSettings.data_parallel``): the settings beyond the plan's
own overlaps that change where the gradient reduce-scatter / all-reduce and the parameter all-gather run, and on
which links. Each is a Megatron-LM flag (core_v0.16.1 ``arguments.py``), read by the importer, written by the
exporters, and mapped to the cost model's ``RunSettings`` in one place (``run_fields``):

    bucket_size          ``--ddp-bucket-size``: parameters per DDP bucket (None: megatron-core's default
                         ``max(40M, 1M x dp)``, ``distributed_data_parallel.py``)
    num_buckets          ``--ddp-num-buckets N``: the bucket size is the rank's parameter count // N (all its model
                         chunks, experts included: Megatron-LM core_v0.16.1 training.py:1236, 1298-1303; core_v0.19.0
                         training.py:1552-1567 ``resolve_ddp_bucket_size``), so it differs per pipeline stage;
                         megatron-core asserts it is positive and not given with ``bucket_size``
    align_grad_reduce    ``training.py`` sets ``config.grad_sync_func`` and the interleaved schedule launches each
                         model chunk's reduction itself, at the same time on every pipeline rank
                         (``--no-align-grad-reduce`` turns it off)
    align_param_gather   ``config.param_sync_func``: the interleaved schedule gathers chunk j+1's parameters at chunk
                         j's first forward (``--no-align-param-gather`` turns it off)
                         Both None: the framework's default: Megatron-LM core_v0.16.1 on (its flags are the
                         ``--no-`` ones), Megatron-Bridge v0.3.1 aligns gradients and not parameters (its
                         ``ddp.align_param_gather`` is megatron-core's default, off), our runtime neither
                         (its engine sets only ``no_sync_func``: bucket hooks)
    rank_order           ``--use-tp-pp-dp-mapping``: megatron-core order ``tp-cp-ep-pp-dp`` instead of the default
                         ``tp-cp-ep-dp-pp``: the pipeline stages of a DP replica sit side by side and every DP group
                         spans the cluster (NVIDIA's MLPerf runs on GB200 / GB300 racks use it); priced for
                         uniform plans only and run by Megatron-LM only (the runtime builds the default order)
    sharp                ``--use-sharp``: megatron-core creates the DP x CP group with ``NCCL_COLLNET_ENABLE=1``
                         (InfiniBand SHARP in-switch reduction, ``parallel_state.py``)
    nvls                 NCCL's NVLink SHARP (``NCCL_NVLS_ENABLE``, an environment variable, no Megatron-LM flag:
                         kept in the plan, not exported); NVIDIA's NeMo executors and MLPerf configs set it to 0

``search/costmodel/dp_timeline.py`` prices the timeline, ``search/costmodel/comm.py`` the algorithms.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
TP_PP_DP = RANK_ORDERS[1]
RankOrder = Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]


class DataParallelSettings(BaseModel):
    """The data-parallel synchronization a plan runs with beyond its overlaps (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    bucket_size: int | None = Field(None, gt=0, description="--ddp-bucket-size: parameters per DDP bucket; None: "
                                    "megatron-core's default max(40M, 1M x dp).")
    num_buckets: int | None = Field(None, gt=0, description="--ddp-num-buckets: each rank's bucket size is its "
                                    "parameter count // num_buckets (not with bucket_size); None: bucket_size.")
    align_grad_reduce: bool | None = Field(None, description="The schedule launches each chunk's gradient "
                                           "reduction (--no-align-grad-reduce: off); None: the framework's default.")
    align_param_gather: bool | None = Field(None, description="The interleaved schedule gathers chunk j+1's "
                                            "parameters at chunk j's first forward (--no-align-param-gather: off); "
                                            "None: the framework's default.")
    rank_order: RankOrder = Field("tp-cp-ep-dp-pp", description="megatron-core's rank order; tp-cp-ep-pp-dp is "
                                  "--use-tp-pp-dp-mapping (uniform plans, Megatron-LM only).")
    sharp: bool = Field(False, description="--use-sharp: InfiniBand SHARP for the DP x CP group.")
    nvls: bool = Field(False, description="NCCL_NVLS_ENABLE=1: NVLink SHARP for the DP collectives inside an NVLink "
                       "domain (an environment variable; not exported).")

    @model_validator(mode="after")
    def _one_bucket_rule(self) -> "DataParallelSettings":
        if self.num_buckets is not None and self.bucket_size is not None:
            raise ValueError("settings.data_parallel: give bucket_size or num_buckets, not both (megatron-core: "
                             "\"Cannot specify both num_buckets and bucket_size\")")
        return self


ALIGN_DEFAULTS = {"runtime": (False, False), "megatron-lm": (True, True), "megatron-bridge": (True, False)}


def run_fields(dps: DataParallelSettings | None, framework: str) -> dict:
    """The ``RunSettings`` fields of these settings under ``framework`` (its default alignment when unset)."""
    d = dps or DataParallelSettings()
    grad, param = ALIGN_DEFAULTS[framework]
    return {"ddp_bucket_size": d.bucket_size, "ddp_num_buckets": d.num_buckets,
            "align_grad_reduce": grad if d.align_grad_reduce is None else d.align_grad_reduce,
            "align_param_gather": param if d.align_param_gather is None else d.align_param_gather,
            "rank_order": d.rank_order, "sharp": d.sharp, "nvls": d.nvls}


def for_target(dps: DataParallelSettings | None, framework: str, target: str, grad_used: bool,
               param_used: bool) -> DataParallelSettings | None:
    """``dps`` as an export for ``target`` must say it so that ``target`` runs the alignment ``framework`` priced:
    an alignment left to ``framework``'s default is written out where ``target``'s default differs and the
    schedule uses it (``grad_used``: the gradient reduction overlapped on pp > 1 or interleaved; ``param_used``:
    the parameter all-gather overlapped and interleaved; ``dp_timeline.py``). None when all is the default."""
    d = dps or DataParallelSettings()
    (fg, fp), (tg, tp) = ALIGN_DEFAULTS[framework], ALIGN_DEFAULTS[target]
    update = {}
    if d.align_grad_reduce is None and grad_used and fg != tg:
        update["align_grad_reduce"] = fg
    if d.align_param_gather is None and param_used and fp != tp:
        update["align_param_gather"] = fp
    d = d.model_copy(update=update)
    return None if d == DataParallelSettings() else d


def from_flags(bucket_size: int | None, no_align_grad_reduce: bool, no_align_param_gather: bool, tp_pp_dp: bool,
               sharp: bool, num_buckets: int | None = None) -> DataParallelSettings | None:
    """The settings of a Megatron-LM command line; None when every flag is at its default."""
    d = DataParallelSettings(bucket_size=bucket_size, num_buckets=num_buckets,
                             align_grad_reduce=False if no_align_grad_reduce else None,
                             align_param_gather=False if no_align_param_gather else None,
                             rank_order=TP_PP_DP if tp_pp_dp else RANK_ORDERS[0], sharp=sharp)
    return None if d == DataParallelSettings() else d


# field -> the Megatron-LM flag that says it (``to_flags``; ``aceso search`` takes the same flags: ``from_args``)
FLAGS: dict[str, str] = {"bucket_size": "--ddp-bucket-size", "num_buckets": "--ddp-num-buckets",
                         "align_grad_reduce": "--no-align-grad-reduce", "align_param_gather": "--no-align-param-gather",
                         "rank_order": "--use-tp-pp-dp-mapping", "sharp": "--use-sharp"}


def to_flags(d: DataParallelSettings | None) -> list[str]:
    """The Megatron-LM arguments that say ``d`` (``nvls`` has none: NCCL_NVLS_ENABLE is the environment's)."""
    if d is None:
        return []
    out = [FLAGS["bucket_size"], str(d.bucket_size)] if d.bucket_size else []
    out += [FLAGS["num_buckets"], str(d.num_buckets)] if d.num_buckets else []
    out += [FLAGS["align_grad_reduce"]] if d.align_grad_reduce is False else []
    out += [FLAGS["align_param_gather"]] if d.align_param_gather is False else []
    out += [FLAGS["rank_order"]] if d.rank_order == TP_PP_DP else []
    out += [FLAGS["sharp"]] if d.sharp else []
    return out


def runtime_refusal(d: DataParallelSettings | None) -> tuple[str, str] | None:
    """The first field of ``d`` the aceso runtime does not run and why, or None: its engine's DDP config takes a
    bucket size, not a bucket count, and it builds megatron-core's default rank order without SHARP groups."""
    if d is None:
        return None
    if d.num_buckets is not None:
        return "num_buckets", "the aceso runtime sizes DDP buckets by bucket_size only"
    for name, off in (("rank_order", d.rank_order == RANK_ORDERS[0]), ("sharp", not d.sharp)):
        if not off:
            return name, ("the aceso runtime builds megatron-core's default rank order (tp-cp-ep-dp-pp) without "
                          "SHARP groups")
    return None
