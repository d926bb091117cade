"""The moe rows of a profile database (docs/profile-db.md "MoE rows"): which row prices a stage's moe units.

A moe unit's time depends on the stage's expert shape and the plan's MoE settings, not only on (tp, batch): its
dispatch and combine all-to-alls span the EP group, its experts hold ``num_experts / ep`` local experts split over
``etp``. So a moe row is keyed by (tp, ep, etp, dispatcher) besides the batch, and a plan is priced only at a
measured key: an expert shape is not scaled from another (the all-to-all and the local experts change in
different directions), and an unmeasured one is refused with one line naming it and the shapes the database has.
Within a key, batches interpolate as for every unit (``ProfileSource._lookup``).

The settings the profiler did not measure are refused too: ``overlap_ep_comm`` and, on a model with a shared
expert, ``shared_expert_overlap`` (the probe runs both off), and grouped GEMM / permute fusion turned off in a plan
where the rows were measured with them on (the runtime would run other kernels; a row measured without them is
what runs wherever the device lacks them: the runtime picks them from the environment).

``ep_comm_ms``: the measured forward dispatch + combine parts (``parts_fwd_us``), twice (the backward's
all-to-alls move the same volumes); reported in ``StageCost.ep_comm_ms``, already inside the unit's time.
"""

from __future__ import annotations

from search.io.errors import AcesoError

Shape = tuple   # () for a non-moe row, else (ep, etp, dispatcher)


def row_shape(entry: dict) -> Shape:
    """The expert key of a database row (moe rows: etp defaults to the row's tp, as megatron-core's)."""
    if entry.get("kind") != "moe":
        return ()
    return (int(entry.get("ep", 1)), int(entry.get("etp") or entry["tp"]), entry.get("dispatcher", "alltoall"))


def plan_shape(model, tp: int, ep: int, etp: int, moe) -> Shape:
    """The expert key a stage's moe units run at; refuses the settings no moe row measures (one line)."""
    from search.settings.moe_plan import MoEPlanSettings

    s = moe or MoEPlanSettings()
    if s.overlap_ep_comm:
        raise AcesoError("moe.overlap_ep_comm: the profiler measures the moe unit without the EP overlap, so the "
                         "profile cost model cannot price it; turn it off or use --cost-model analytic")
    if s.shared_expert_overlap and model.moe.moe_shared_expert_intermediate_size:
        raise AcesoError("moe.shared_expert_overlap: the profiler measures the shared expert without the overlap, "
                         "so the profile cost model cannot price it; turn it off or use --cost-model analytic")
    return (int(ep), int(etp or tp), s.token_dispatcher)


def shape_text(tp: int, shape: Shape) -> str:
    ep, etp, disp = shape
    return f"tp{tp} ep{ep} etp{etp} {disp}"


def missing(path: str, seq: int, tp: int, shape: Shape, measured: list[tuple[int, Shape]]) -> AcesoError:
    have = ", ".join(shape_text(t, x) for t, x in sorted(measured)) or "none"
    return AcesoError(f"--db {path}: no measurements for the moe unit at seq {seq}, {shape_text(tp, shape)} "
                      f"(measured: {have}); profile it (aceso profile --tp {tp} --ep {shape[0]}) or use "
                      "--cost-model analytic")


def check_kernels(path: str, entry: dict, moe) -> None:
    """A plan that turns off a fast path the moe rows ran with would run other kernels than were measured."""
    from search.settings.moe_plan import MoEPlanSettings

    s = moe or MoEPlanSettings()
    for field in ("grouped_gemm", "permute_fusion"):
        if entry.get(field) and not getattr(s, field):
            raise AcesoError(f"moe.{field} false: the moe rows of --db {path} were measured with {field} on; "
                             f"set it true or use --cost-model analytic")


def ep_comm_us(entry: dict) -> float:
    """Dispatch + combine of one forward and one backward, from the measured forward parts (0 without them)."""
    parts = entry.get("parts_fwd_us") or {}
    return 2.0 * (parts.get("dispatch", 0.0) + parts.get("combine", 0.0))
