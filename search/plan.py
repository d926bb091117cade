"""``ParallelPlan``: the contract between the search and the runtime.

A plan is an ordered list of pipeline stages. Stage ``s`` owns a contiguous block of ranks (stages in order);
inside a stage, TP groups are blocks of ``tp`` adjacent ranks and DP groups are strided by ``tp`` (as in Megatron
and Aceso). Each stage covers a contiguous span of sub-layer units (``search.model.Unit``), ``[start_unit,
end_unit)``, with one recompute choice per unit. ``micro_batch_size`` is the pipeline micro-batch: a stage with DP
``d`` runs ``micro_batch_size / d`` samples per rank, so stages of different DP exchange the same micro-batch.

The committed JSON Schema ``docs/plan.schema.json`` is generated from these classes (``python -m search.plan``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .cluster import ClusterSpec
from .errors import AcesoError, as_aceso_error, read_json
from .model import ModelSpec, Unit

SCHEMA_VERSION = 1
Recompute = Literal["none", "selective", "full", "attn_dropout"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full", "attn_dropout")
ATTENTION_ONLY: frozenset[str] = frozenset({"attn_dropout"})   # choices an MLP unit cannot take


def recompute_allowed(kind: str) -> tuple[Recompute, ...]:
    """The recompute choices a unit of this kind can take (``attn_dropout``: attention units only)."""
    return tuple(c for c in RECOMPUTE_CHOICES if kind != "mlp" or c not in ATTENTION_ONLY)


class StageSpec(BaseModel):
    """One pipeline stage."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: int = Field(gt=0, description="GPUs of this stage (= tp * dp).")
    tp: int = Field(gt=0, description="Tensor-parallel degree inside the stage.")
    dp: int = Field(gt=0, description="Data-parallel degree inside the stage.")
    start_unit: int = Field(ge=0, description="First sub-layer unit of the stage (inclusive).")
    end_unit: int = Field(ge=0, description="One past the last sub-layer unit (exclusive).")
    recompute: list[Recompute] = Field(
        description="Per unit of the span: none | selective (attention core and activation function recomputed) "
        "| full (only the unit input kept) | attn_dropout (attention units only: the attention-probability "
        "dropout and the probs x V product recomputed, freeing the dropout mask and the dropped probabilities)."
    )

    @model_validator(mode="after")
    def _check(self) -> "StageSpec":
        if self.tp * self.dp != self.num_gpus:
            raise ValueError(f"tp ({self.tp}) * dp ({self.dp}) must equal num_gpus ({self.num_gpus})")
        if self.end_unit <= self.start_unit:
            raise ValueError(
                f"span [{self.start_unit}, {self.end_unit}) is empty; end_unit must exceed start_unit"
            )
        if len(self.recompute) != self.end_unit - self.start_unit:
            raise ValueError(
                f"recompute has {len(self.recompute)} entries for {self.end_unit - self.start_unit} units; "
                "give one per unit"
            )
        return self

    @property
    def num_units(self) -> int:
        return self.end_unit - self.start_unit


class PlanPrediction(BaseModel):
    """What the cost model predicted for the plan (informational)."""

    model_config = ConfigDict(extra="forbid")

    cost_model: str = Field(description="analytic | profile | aceso-compat.")
    iteration_time_ms: float = Field(description="Predicted time of one optimizer step.")
    samples_per_s: float = Field(description="global_batch_size / iteration time.")
    stage_time_ms: list[float] = Field(description="Per stage: its 1F1B total time.")
    stage_memory_mb: list[float] = Field(description="Per stage: peak memory per GPU.")
    attention: Literal["flash", "unfused"] | None = Field(
        None, description="Attention kernel the prediction assumed (analytic model): flash = transformer-engine's "
        "fused attention, unfused = megatron-core's local attention. The runtime warns when it runs the other.")


class ParallelPlan(BaseModel):
    """A heterogeneous pipeline-parallel plan for one model."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="Plan format version.")
    model: ModelSpec = Field(description="The model the plan is for.")
    cluster: ClusterSpec | None = Field(None, description="The cluster the plan was made for, if known.")
    micro_batch_size: int = Field(gt=0, description="Pipeline micro-batch, samples (before a stage's DP split).")
    global_batch_size: int = Field(gt=0, description="Samples per optimizer step.")
    distributed_optimizer: bool = Field(False, description="Optimizer states sharded over each stage's DP group.")
    stages: list[StageSpec] = Field(min_length=1, description="Pipeline stages in order.")
    predicted: PlanPrediction | None = Field(None, description="Cost-model prediction, if any.")

    @model_validator(mode="after")
    def _check(self) -> "ParallelPlan":
        m = self.model
        expected = 0
        for i, st in enumerate(self.stages):
            if st.start_unit != expected:
                what = "overlaps the previous stage" if st.start_unit < expected else "leaves a gap"
                raise ValueError(
                    f"stages[{i}].start_unit ({st.start_unit}) {what}; it must be {expected} "
                    "(stages cover every unit once, in order)"
                )
            expected = st.end_unit
            for name, value in (("num_attention_heads", m.num_attention_heads),
                                ("num_query_groups", m.groups), ("ffn_hidden_size", m.ffn_hidden_size)):
                if value % st.tp:
                    raise ValueError(
                        f"stages[{i}].tp ({st.tp}) must divide {name} ({value}); use a tp that divides it"
                    )
            for k, (unit, rc) in enumerate(zip(m.units[st.start_unit:st.end_unit], st.recompute)):
                if rc not in recompute_allowed(unit.kind):
                    raise ValueError(
                        f"stages[{i}].recompute[{k}] is {rc!r} but unit {st.start_unit + k} is an MLP unit; "
                        f"{rc!r} applies to attention units only: use none, selective or full"
                    )
            if self.micro_batch_size % st.dp:
                raise ValueError(
                    f"stages[{i}].dp ({st.dp}) must divide micro_batch_size ({self.micro_batch_size}); "
                    "raise micro_batch_size or lower dp"
                )
        if expected != m.num_units:
            raise ValueError(
                f"stages[-1].end_unit ({expected}) must be {m.num_units}: the model {m.name} has "
                f"{m.num_units} units; stages must cover all of them"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if self.cluster is not None:
            check_fits_cluster(self, self.cluster)
        return self

    # ----- derived --------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return sum(s.num_gpus for s in self.stages)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def first_rank(self, stage: int) -> int:
        return sum(s.num_gpus for s in self.stages[:stage])

    def stage_of_rank(self, rank: int) -> int:
        for i, st in enumerate(self.stages):
            rank -= st.num_gpus
            if rank < 0:
                return i
        raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks")

    def stage_units(self, stage: int) -> tuple[Unit, ...]:
        st = self.stages[stage]
        return self.model.units[st.start_unit:st.end_unit]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=True) + "\n"


def check_fits_cluster(plan: ParallelPlan, cluster: ClusterSpec) -> None:
    """Raise ValueError if the plan's ranks do not fit the cluster (GPU count, TP groups inside a node)."""
    if plan.world_size != cluster.num_gpus:
        raise ValueError(
            f"stages use {plan.world_size} GPUs but the cluster {cluster.label} has {cluster.num_gpus}; "
            "make the stages' num_gpus add up to it"
        )
    for i, st in enumerate(plan.stages):
        if st.tp > cluster.gpus_per_node:
            raise ValueError(
                f"stages[{i}].tp ({st.tp}) exceeds gpus_per_node ({cluster.gpus_per_node}); TP stays inside a node"
            )
        first = plan.first_rank(i)
        for j in range(st.dp):
            lo = first + j * st.tp
            if cluster.node_of(lo) != cluster.node_of(lo + st.tp - 1):
                raise ValueError(
                    f"stages[{i}]: TP group of ranks {lo}..{lo + st.tp - 1} spans two nodes; "
                    "move the stage boundary so TP groups stay inside a node"
                )


def load_plan(path: str | Path, world_size: int | None = None) -> ParallelPlan:
    """Read and validate a plan file; every problem becomes one ``AcesoError`` line."""
    raw = read_json(path, missing="no such plan file")
    return parse_plan(raw, world_size=world_size, source=str(path))


def parse_plan(raw: object, world_size: int | None = None, source: str = "plan") -> ParallelPlan:
    if isinstance(raw, dict) and raw.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise AcesoError(
            f"{source}: schema_version {raw.get('schema_version')} is not supported (this version reads "
            f"{SCHEMA_VERSION}); regenerate the plan"
        )
    try:
        plan = ParallelPlan.model_validate(raw)
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + str(as_aceso_error(e))) from None
    if world_size is not None and world_size != plan.world_size:
        raise AcesoError(
            f"{source}: the plan needs {plan.world_size} processes (sum of stages[].num_gpus) but the launch has "
            f"{world_size}; launch {plan.world_size} processes or use a plan for {world_size} GPUs"
        )
    return plan


def plan_json_schema() -> str:
    return json.dumps(ParallelPlan.model_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # regenerate docs/plan.schema.json
    out = Path(__file__).resolve().parent.parent / "docs" / "plan.schema.json"
    out.write_text(plan_json_schema())
    print(f"wrote {out}")


def even_split(num_items: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` contiguous parts of ``num_items``, as even as possible (earlier parts larger)."""
    base, extra = divmod(num_items, num_parts)
    return [base + (1 if i < extra else 0) for i in range(num_parts)]


def uniform_plan(model: ModelSpec, num_stages: int, tp: int, dp: int, micro_batch_size: int,
                 global_batch_size: int, recompute: Recompute = "none",
                 cluster: ClusterSpec | None = None) -> ParallelPlan:
    """A Megatron-style plan: every stage tp x dp, whole layers split as evenly as possible.

    Units are grouped per layer (2 units; T5 decoder layers 3), so stage boundaries fall between layers.
    """
    starts = model.layer_starts
    num_layers = len(starts) - 1
    if num_stages > num_layers:
        raise AcesoError(f"num_stages ({num_stages}) exceeds the model's {num_layers} layers")
    stages, li = [], 0
    for n_layers in even_split(num_layers, num_stages):
        lo, hi = starts[li], starts[li + n_layers]
        li += n_layers
        stages.append(StageSpec(num_gpus=tp * dp, tp=tp, dp=dp, start_unit=lo, end_unit=hi,
                                recompute=[recompute] * (hi - lo)))
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=micro_batch_size,
                        global_batch_size=global_batch_size, stages=stages)
