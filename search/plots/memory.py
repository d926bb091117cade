"""Memory per stage: stacked bars of the cost model's ``StageCost.memory_breakdown`` against the GPU limit.

Data (``segments``, no matplotlib): per stage the breakdown's terms in a fixed order, with the activations split by
recompute choice where the cost model has per-unit tables (analytic, profile): unit ``u`` of model chunk ``j`` with
choice ``c`` keeps ``act_mb[u, c]`` (``UnitTable`` at the stage's per-rank batch and tp) for each of the chunk's
in-flight micro-batches (``memory.in_flight_per_chunk``), times the allocator slack ``1 + FRAGMENTATION`` -- the
terms ``CostModel.stage_cost`` adds up. What the breakdown's activations hold beyond the units (the embedding's
dropout mask, the last stage's logits, a T5 decoder's copy of the encoder output) is the remainder, "embedding /
head". Every stage's segments sum to its ``memory_mb`` exactly; a breakdown that does not (a cost model's own
rounding) gets an "unattributed" segment rather than a silently wrong bar.
"""

from __future__ import annotations

from ..costmodel.memory import FRAGMENTATION, in_flight_per_chunk
from ..costmodel.types import RC_CODE, StageCost
from search.settings.moe_plan import moe_settings
from search.spec.plan import RECOMPUTE_CHOICES

MB_PER_GB = 1024.0
ORDER = ("params", "grads", "optimizer", "activations", "recompute_peak", "p2p_buffers", "dispatch_buffers",
         "cuda_graphs", "moe_capacity", "reserve")
LABELS = {"params": "weights", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activations", "act_other": "activations: embedding / head",
          "recompute_peak": "peak transient (recompute / loss)", "p2p_buffers": "p2p buffers",
          "reserve": "reserve (CUDA context, workspaces)", "unattributed": "unattributed",
          "grad_copy": "fp32 gradient copy (optimizer step)",
          "dispatch_buffers": "MoE dispatch buffers (DeepEP / HybridEP)", "cuda_graphs": "CUDA graph static buffers",
          "moe_capacity": "MoE per-rank capacity / paged stash", "fsdp_main_params": "FSDP main weights (dtype)",
          "fsdp_main_grads": "FSDP main gradients (dtype)"}
LABELS.update({f"act_{c}": f"activations, recompute {c}" for c in RECOMPUTE_CHOICES})
COLORS = {"params": "#4e79a7", "grads": "#a0cbe8", "optimizer": "#d4a6c8", "act_none": "#59a14f",
          "act_selective": "#8cd17d", "act_full": "#b6992d", "act_attn_dropout": "#f1ce63", "activations": "#59a14f",
          "act_other": "#86bcb6", "recompute_peak": "#e15759", "p2p_buffers": "#ff9d9a", "reserve": "#bab0ac",
          "grad_copy": "#9d7660", "unattributed": "#000000", "act_mla_up_proj": "#499894",
          "dispatch_buffers": "#d37295", "cuda_graphs": "#fabfd2", "moe_capacity": "#b07aa1",
          "fsdp_main_params": "#2f5d8a", "fsdp_main_grads": "#7fa7c9"}
STACK = ("params", "grads", "optimizer", *(f"act_{c}" for c in RECOMPUTE_CHOICES), "activations", "act_other",
         "recompute_peak", "p2p_buffers", "dispatch_buffers", "cuda_graphs", "moe_capacity", "grad_copy",
         "reserve")   # bottom to top, every bar
# a stack feature's negative memory term (``stack_cost.STACK_MEMORY``) and the term it reduces
NET_OF = {"fine_grained_offload": "activations", "fsdp_main_params": "optimizer", "fsdp_main_grads": "grads"}
TOLERANCE_MB = 1e-6
OFF_SCALE = 0.3         # bars below this share of the limit are drawn to their own scale (limit stated in words)


def segments(cm, plan, stage_costs: list[StageCost]) -> list[list[tuple[str, float]]]:
    """Per stage, ``(key, MiB)`` bottom to top; they sum to the stage's ``memory_mb``. ``plan`` may be None (a
    reference config): then the activations stay one segment."""
    out = []
    for i, s in enumerate(stage_costs):
        bd = dict(s.memory_breakdown)
        for k in [k for k, v in bd.items() if v < 0 and k in NET_OF]:    # what a feature takes off the GPU: the
            bd[NET_OF[k]] = bd.get(NET_OF[k], 0.0) + bd.pop(k)              # term it reduces is drawn net
        keys = [k for k in ORDER if k in bd] + sorted(set(bd) - set(ORDER))
        segs: list[tuple[str, float]] = []
        for k in keys:
            if k == "activations" and plan is not None:
                segs += _activations(cm, plan, i, bd[k])
            else:
                segs.append((k, bd[k]))
        rest = s.memory_mb - sum(v for _, v in segs)
        if abs(rest) > TOLERANCE_MB * max(1.0, s.memory_mb):
            segs.append(("unattributed", rest))
        out.append(segs)
    return out


def _activations(cm, plan, i: int, total: float) -> list[tuple[str, float]]:
    """Stage i's activations by recompute choice, plus the embedding / head remainder (or one segment)."""
    unit_table = getattr(cm, "unit_table", None)
    st = plan.stages[i]
    try:
        experts = {"ep": st.ep, "etp": st.etp or 0, "moe": moe_settings(plan)} if plan.model.moe else {}
        t = unit_table(plan.micro_batch_size / st.dp, st.tp, st.cp, st.sequence_parallel, **experts) \
            if unit_table else None          # the stage's expert shape, as stage_cost prices it
    except (NotImplementedError, TypeError):
        t = None
    if t is None:
        return [("activations", total)]
    in_flight = in_flight_per_chunk(i, plan.num_stages, st.num_chunks, plan.num_micro_batches)
    per = dict.fromkeys(RECOMPUTE_CHOICES, 0.0)
    for chunk, n in zip(st.chunks, in_flight):
        for u, c in zip(range(chunk.start_unit, chunk.end_unit), chunk.recompute):
            per[c] += float(t.act_mb[u, RC_CODE[c]]) * n * (1 + FRAGMENTATION)
    other = total - sum(per.values())
    if other < -TOLERANCE_MB * max(1.0, total):    # the cost model assembles activations differently: do not guess
        return [("activations", total)]
    segs = [(f"act_{c}", v) for c, v in per.items() if v > 0]
    if other > TOLERANCE_MB * max(1.0, total):
        segs.append(("act_other", other))
    return segs or [("activations", total)]


def recompute_text(stage) -> str:
    """``none 12, full 4`` for a plan's stage (counts of each choice, all chunks)."""
    rc = stage.all_recompute
    return ", ".join(f"{c} {rc.count(c)}" for c in RECOMPUTE_CHOICES if rc.count(c))


def draw(ax, segs: list[list[tuple[str, float]]], limit_mb: float, tick_labels: list[str], fits: list[bool],
         bottleneck: int) -> list:
    """Stacked bars (GiB) per stage with the limit line; returns the legend handles."""
    from matplotlib.patches import Patch

    import numpy as np
    S = len(segs)
    present: list[str] = []
    for stage in segs:
        present += [k for k, v in stage if k not in present and v != 0]   # zero everywhere: no bar, no legend
    keys = [k for k in STACK if k in present] + [k for k in present if k not in STACK and k != "unattributed"]
    keys += ["unattributed"] if "unattributed" in present else []
    row = {k: j for j, k in enumerate(keys)}
    gb = np.zeros((len(keys), S))
    for i, stage in enumerate(segs):
        for k, mb in stage:
            if k in row:
                gb[row[k], i] += mb / MB_PER_GB
    bottom = np.zeros(S)
    x = np.arange(S)
    over = np.array([not f for f in fits])
    for j, k in enumerate(keys):    # one bar call per category; order within a stage follows ``keys``
        ax.bar(x, gb[j], bottom=bottom, width=0.7, color=COLORS.get(k, "#76b7b2"), edgecolor="white",
               linewidth=0.3)
        bottom += gb[j]
    if over.any():          # the whole bar of a stage over the limit outlined
        ax.bar(x[over], bottom[over], width=0.7, fill=False, edgecolor="#c00000", linewidth=1.6)
    if S <= 24:
        for i in range(S):
            ax.text(i, bottom[i], f"{bottom[i]:.1f}", ha="center", va="bottom", fontsize=7,
                    fontweight="bold" if i == bottleneck else "normal",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
    limit = limit_mb / MB_PER_GB
    tall = float(bottom.max()) if S else 0.0
    if tall >= OFF_SCALE * limit:
        line = ax.axhline(limit, color="#c00000", linestyle="--", linewidth=1.2)
        line.set_label(f"GPU memory limit {limit:.1f} GiB")
        ax.set_ylim(0, max(tall, limit) * 1.12)
        extra = [line]
    else:   # far below the limit: scale to the bars (readable segments) and state the limit in words
        ax.set_ylim(0, tall * 1.18)
        ax.text(0.995, 0.97, f"GPU memory limit {limit:.1f} GiB is off this scale: the fullest stage uses "
                f"{100 * tall / limit:.0f}% of it", transform=ax.transAxes, ha="right", va="top", fontsize=8,
                color="#c00000")
        extra = []
    ax.set_xlim(-0.6, S - 0.4)
    rotate = S > 8
    ax.set_xticks(range(S), tick_labels, fontsize=7 if S <= 16 else 5.5, rotation=90 if rotate else 0,
                  linespacing=1.1)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("memory per stage (cost model)", fontsize=10, loc="left")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=COLORS.get(k, "#76b7b2"), label=LABELS.get(k, k.replace("_", " "))) for k in keys]
    if not all(fits):
        handles.append(Patch(facecolor="white", edgecolor="#c00000", linewidth=1.6, label="stage over the limit"))
    return handles + extra
