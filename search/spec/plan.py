"""``ParallelPlan``: the contract between the search and the runtime (schema version 4).

A plan is an ordered list of pipeline stages (pipeline ranks). Stage ``s`` owns a contiguous block of
``tp * cp * dp`` ranks (stages in order); inside a stage ranks are ordered as in Megatron (``tp-cp-dp``): TP groups
are blocks of ``tp`` adjacent ranks, CP groups are strided by ``tp``, DP groups by ``tp * cp``. A stage holds one or
more model chunks (``chunks``; more than one = the interleaved schedule, Megatron's virtual pipeline stages): with
``S`` stages and ``v`` chunks each, model chunk ``k`` of the ``S * v`` chunks is chunk ``k // S`` of stage
``k % S``, and the chunks cover the model's sub-layer units (``search.spec.model.Unit``) in order, each its own
contiguous span ``[start_unit, end_unit)`` with one recompute choice per unit; spans may be uneven.

``micro_batch_size`` is the pipeline micro-batch: a stage with DP ``d`` runs ``micro_batch_size / d`` samples per
rank (Megatron-LM's per-rank ``--micro-batch-size``), so stages of different DP exchange the same micro-batch.
Per stage: ``cp`` (context parallelism), ``sequence_parallel`` and, for MoE, an expert shape ``ep`` / ``etp``
folded over the same GPUs (``moe_plan.py``). Every plan-wide switch is in the one ``settings`` record
(``plan_settings.PlanSettings``): who runs the plan and its release, the precision recipe, the optimizer, the
gradient reduction dtype, ``distributed_optimizer``, ``overlap_grad_reduce``, ``overlap_param_gather``,
``tp_comm_overlap``, ``megatron_fsdp`` and ``activation_offload`` (``fsdp.py``), the MoE ``moe`` settings and the
``stack`` switches; the plan reads them back as properties (``plan.distributed_optimizer``). The prediction was
priced under them (``search/pricing/``).

Version 4 moved the switches into ``settings`` (version 3 kept them at the top level, version 3 added MoE). Version
1, 2 and 3 plans (v1: one span per stage, none of the v2 features; v2: dense) are read and converted
(``READS_VERSIONS``), and so is a dict without ``schema_version`` (a v3 plan; ``ParallelPlan(distributed_optimizer=
True, ...)`` too); a v4 plan with a switch at the top level is one line naming where it moved. A stage
may still be written in the v1 form (``start_unit``/``end_unit``/``recompute``), which means one chunk.
The committed JSON Schema ``docs/plan.schema.json`` is generated from these classes (``python -m search.spec.plan``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError, as_aceso_error, read_json
from search.settings.fsdp import ActivationOffload, MegatronFSDP, check_plan as _check_fsdp_offload
from search.spec.model import ModelSpec, Unit
from search.spec import query_groups
from search.settings.moe_plan import MoEPlanSettings, check_expert_shape, check_moe_settings, expert_shape_text
from search.settings.plan_settings import LEGACY_KEYS, PlanSettings
from search.settings.stack import StackSettings, refusal as stack_refusal
from search.io.units import mib_alias
from search import layers

SCHEMA_VERSION = 4
READS_VERSIONS = (1, 2, 3, 4)  # v1 (one span per stage, no SP/CP/overlap), v2 (no MoE), v3 (switches at the top
#                                level) are converted on read
Recompute = Literal["none", "selective", "full", "attn_dropout", "mla_up_proj"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full", "attn_dropout", "mla_up_proj")
MLA_ONLY: frozenset[str] = frozenset({"mla_up_proj"})   # choices of an MLA model's attention units only
_SPAN_KEYS = ("start_unit", "end_unit", "recompute")
# Upper bounds (docs/inputs.md): the model's and cluster's bounds carried over to the plan's fields
MAX_UNITS = 5 * 4096            # T5 with 4096 encoder (2 units) and 4096 decoder layers (3 units)
MAX_DEGREE = 1 << 20            # tp, cp, dp, num_gpus: no more than the GPUs of a cluster
MAX_BATCH = 1 << 24


def recompute_allowed(kind: str, model=None) -> tuple[Recompute, ...]:
    """The recompute choices a unit of this kind can take in ``model`` (None: the kind's own, no variant): its layer
    kind's ``recompute`` (``search.layers``; ``attn_dropout``: attention units only; ``mla_up_proj``: the attention
    units of an MLA model only, megatron-core's ``recompute_modules`` ["mla_up_proj"]; ``moe``: selective =
    megatron-core's ``recompute_modules`` ["moe_act"]; ``mtp``: none or full, its inner layer whole)."""
    return (layers.resolve(model, kind) if model is not None else layers.get(kind)).recompute


EndOnly = Literal["embedding", "loss"]


class ChunkSpec(BaseModel):
    """One model chunk (a virtual pipeline stage): a contiguous span of units and one recompute choice per unit.

    A chunk may hold no unit at all when it is one of the model's two end chunks, as megatron-core's
    ``--pipeline-model-parallel-layout`` allows (``E|...``, ``...|L``): ``holds_only: "embedding"`` (model chunk 0,
    span ``[0, 0)``: only the word / position embedding) or ``holds_only: "loss"`` (the last model chunk, span
    ``[num_units, num_units)``: only the final norm, the output layer and the loss). The marker is explicit so an
    empty span is never an accident: an empty span without it, or the marker on a chunk with units or anywhere
    else, is refused (``ParallelPlan`` checks the position).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    start_unit: int = Field(ge=0, le=MAX_UNITS, description="First sub-layer unit of the chunk (inclusive).")
    end_unit: int = Field(ge=0, le=MAX_UNITS, description="One past the last sub-layer unit (exclusive).")
    recompute: list[Recompute] = Field(
        description="Per unit of the span: none | selective (attention core and activation function recomputed) "
        "| full (only the unit input kept) | attn_dropout (attention units only: the attention-probability "
        "dropout and the probs x V product recomputed, freeing the dropout mask and the dropped probabilities) "
        "| mla_up_proj (MLA attention units only: megatron-core's recompute_modules mla_up_proj, the Q/K/V up "
        "projections and RoPE re-run in backward, freeing the core attention's Q, K and V)."
    )
    holds_only: EndOnly | None = Field(
        None, description="A chunk with no unit (empty span, recompute []): 'embedding' = model chunk 0 holding "
        "only the embedding (Megatron-LM layout 'E|...'), 'loss' = the last model chunk holding only the final "
        "norm, output layer and loss ('...|L'). Absent: the chunk holds its span's units.")

    @model_serializer(mode="wrap")
    def _plain_form(self, handler):
        """A chunk with units is written without ``holds_only`` (as before the field existed)."""
        out = handler(self)
        if isinstance(out, dict) and out.get("holds_only", 0) is None:
            out.pop("holds_only")
        return out

    @model_validator(mode="after")
    def _check(self) -> "ChunkSpec":
        if self.holds_only is not None and self.end_unit != self.start_unit:
            raise ValueError(f"holds_only is {self.holds_only!r} but the span [{self.start_unit}, {self.end_unit}) "
                             "holds units; give a chunk with only the embedding / loss an empty span "
                             "(start_unit = end_unit, recompute []), or drop holds_only")
        if self.end_unit < self.start_unit or self.end_unit == self.start_unit and self.holds_only is None:
            raise ValueError(
                f"span [{self.start_unit}, {self.end_unit}) is empty; end_unit must exceed start_unit (a chunk "
                "holding only the embedding or the loss says so: holds_only 'embedding' / 'loss')"
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


class StageSpec(BaseModel):
    """One pipeline stage (one pipeline rank): its GPUs, their parallel shape, and its model chunks.

    Ranks inside a stage are ordered as in Megatron (``tp-cp-dp``): TP groups are blocks of ``tp`` adjacent ranks,
    CP groups strided by ``tp``, DP groups strided by ``tp * cp``. A stage of an interleaved plan holds ``v``
    chunks: chunk ``j`` of stage ``s`` is model chunk ``j * num_stages + s``. A one-chunk stage may be written
    with ``start_unit``/``end_unit``/``recompute`` directly instead of ``chunks`` (the v1 form).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    num_gpus: int = Field(gt=0, le=MAX_DEGREE, description="GPUs of this stage (= tp * cp * dp).")
    tp: int = Field(gt=0, le=MAX_DEGREE, description="Tensor-parallel degree inside the stage.")
    cp: int = Field(1, gt=0, le=MAX_DEGREE,
                    description="Context-parallel degree: the sequence is split over cp ranks (ring "
                    "attention exchanges K/V).")
    dp: int = Field(gt=0, le=MAX_DEGREE, description="Data-parallel degree inside the stage.")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism over the TP group (tp > 1): "
                                    "norms, dropouts and residuals run on s/tp tokens; TP all-reduces become "
                                    "reduce-scatter + all-gather.")
    chunks: list[ChunkSpec] = Field(min_length=1, max_length=MAX_UNITS,
                                    description="The stage's model chunks (virtual stages) in "
                                    "order: one for a non-interleaved plan.")
    ep: int = Field(1, gt=0, le=MAX_DEGREE, description="MoE: expert-parallel degree (the stage's experts split over "
                    "ep ranks; moe_plan.py). 1 for a dense model.")
    etp: int | None = Field(None, gt=0, le=MAX_DEGREE, description="MoE: expert tensor-parallel degree; None = the "
                            "stage's tp (megatron-core's default). edp = num_gpus / (etp * ep).")

    @model_validator(mode="before")
    @classmethod
    def _one_chunk_form(cls, data):
        """``start_unit``/``end_unit``/``recompute`` at the stage level (v1 form) become its single chunk."""
        if isinstance(data, dict) and "chunks" not in data and any(k in data for k in _SPAN_KEYS):
            data = dict(data)
            data["chunks"] = [{k: data.pop(k) for k in _SPAN_KEYS if k in data}]
        return data

    @model_serializer(mode="wrap")
    def _dense_form(self, handler):
        """A stage without an expert shape is written as in v2 (no ``ep`` / ``etp`` keys)."""
        out = handler(self)
        if isinstance(out, dict) and out.get("ep") == 1 and out.get("etp") is None:
            out.pop("ep", None)
            out.pop("etp", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> "StageSpec":
        if self.tp * self.cp * self.dp != self.num_gpus:
            what = f"tp ({self.tp}) * cp ({self.cp}) * dp ({self.dp})" if self.cp > 1 else \
                f"tp ({self.tp}) * dp ({self.dp})"
            raise ValueError(f"{what} must equal num_gpus ({self.num_gpus})")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel needs tp > 1 (it splits the sequence over the TP group); "
                             "set it false or raise tp")
        return self

    # ----- the single-chunk view (non-interleaved plans) ----------------------------------------------------------
    def _single(self) -> ChunkSpec:
        if len(self.chunks) != 1:
            raise ValueError(f"the stage holds {len(self.chunks)} virtual chunks; iterate stage.chunks")
        return self.chunks[0]

    @property
    def start_unit(self) -> int:
        return self._single().start_unit

    @property
    def end_unit(self) -> int:
        return self._single().end_unit

    @property
    def recompute(self) -> list[Recompute]:
        return self._single().recompute

    @property
    def num_units(self) -> int:
        """Units of all the stage's chunks."""
        return sum(c.num_units for c in self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple((c.start_unit, c.end_unit) for c in self.chunks)

    @property
    def shape_text(self) -> str:
        """The stage's shape in short names, cp and SP only where on: ``tp2 cp2 dp1 sp``."""
        experts = expert_shape_text(self)
        return (f"tp{self.tp}" + (f" cp{self.cp}" if self.cp > 1 else "") + f" dp{self.dp}"
                + (" sp" if self.sequence_parallel else "") + (f" {experts}" if experts else ""))

    @property
    def all_recompute(self) -> list[Recompute]:
        """Recompute choices of all chunks, chunk after chunk."""
        return [r for c in self.chunks for r in c.recompute]


class PlanPrediction(BaseModel):
    """What the cost model predicted for the plan (informational)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    cost_model: str = Field(max_length=64, description="analytic | profile | aceso-compat.")
    iteration_time_ms: float = Field(gt=0, description="Predicted time of one optimizer step.")
    samples_per_s: float = Field(gt=0, description="global_batch_size / iteration time.")
    stage_time_ms: list[float] = Field(max_length=MAX_UNITS, description="Per stage: its pipeline total time "
                                       "(critical path through it).")
    stage_memory_mb: list[float] = Field(max_length=MAX_UNITS, description="Per stage: peak memory per GPU, MiB.",
                                         **mib_alias("stage_memory_mb"))
    attention: Literal["flash", "unfused"] | None = Field(
        None, description="Attention kernel the prediction assumed (analytic model): flash = transformer-engine's "
        "fused attention, unfused = megatron-core's local attention. The runtime warns when it runs the other.")


class ParallelPlan(BaseModel):
    """A heterogeneous pipeline-parallel plan for one model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    schema_version: Literal[4] = Field(SCHEMA_VERSION, description="Plan format version (v1 to v3 plans are "
                                       "converted on read).")
    model: ModelSpec = Field(description="The model the plan is for.")
    cluster: ClusterSpec | None = Field(None, description="The cluster the plan was made for, if known.")
    micro_batch_size: int = Field(gt=0, le=MAX_BATCH,
                                  description="Pipeline micro-batch, samples, before a stage's DP split: "
                                  "stage i runs micro_batch_size / dp_i samples per rank (Megatron's per-rank "
                                  "--micro-batch-size).")
    global_batch_size: int = Field(gt=0, le=MAX_BATCH, description="Samples per optimizer step.")
    stages: list[StageSpec] = Field(min_length=1, max_length=MAX_UNITS, description="Pipeline stages in order.")
    predicted: PlanPrediction | None = Field(None, description="Cost-model prediction, if any.")
    settings: PlanSettings = Field(default_factory=PlanSettings, description="What the plan runs with beyond its "
                                   "stages, every plan-wide switch once (plan_settings.py): who runs it, the release, "
                                   "precision recipe, optimizer, gradient reduction, distributed optimizer, overlaps, "
                                   "Megatron FSDP, offload, MoE and stack settings. The prediction was priced under "
                                   "them; aceso export writes the flags that run them.")

    @model_validator(mode="before")
    @classmethod
    def _from_v1(cls, data):
        """A v1 / v2 / v3 plan is the same plan with every later feature off (v1: the v2 features; v2: MoE) and its
        plan-wide switches at the top level (``LEGACY_KEYS``; a dict without a schema_version too): they move into
        ``settings``."""
        if not isinstance(data, dict):
            return data
        if data.get("schema_version", 3) not in (1, 2, 3):
            top = [k for k in LEGACY_KEYS if k in data]
            if top:
                raise ValueError(f"{top[0]}: a plan-wide switch, kept in settings since schema version "
                                 f"{SCHEMA_VERSION}; move it to settings.{top[0]}")
            return data
        data = {**data, "schema_version": SCHEMA_VERSION}
        moved = {k: data.pop(k) for k in LEGACY_KEYS if k in data}
        if moved:
            own = data.get("settings")
            own = own.model_dump(exclude_unset=True) if isinstance(own, PlanSettings) else dict(own or {})
            twice = sorted(set(moved) & set(own))
            if twice:
                raise ValueError(f"{twice[0]} is given twice, at the plan's top level (schema version 3) and in "
                                 f"settings; keep settings.{twice[0]}")
            data["settings"] = {**own, **moved}
        return data

    def model_copy(self, *, update=None, deep: bool = False):
        """``model_copy`` that also takes the switches by their plan-level names (``LEGACY_KEYS``, read through the
        properties below) into ``settings``, so an update never sets an attribute nothing reads."""
        moved = {k: update[k] for k in LEGACY_KEYS if update and k in update}
        if moved:
            update = {k: v for k, v in update.items() if k not in moved}
            update["settings"] = update.get("settings", self.settings).model_copy(update=moved)
        return super().model_copy(update=update, deep=deep)

    # ----- the plan-wide switches, read from ``settings`` (their one place) ---------------------------------------
    @property
    def distributed_optimizer(self) -> bool:
        return self.settings.distributed_optimizer

    @property
    def overlap_grad_reduce(self) -> bool:
        return self.settings.overlap_grad_reduce

    @property
    def overlap_param_gather(self) -> bool:
        return self.settings.overlap_param_gather

    @property
    def tp_comm_overlap(self) -> bool:
        return self.settings.tp_comm_overlap

    @property
    def megatron_fsdp(self) -> MegatronFSDP | None:
        return self.settings.megatron_fsdp

    @property
    def activation_offload(self) -> ActivationOffload | None:
        return self.settings.activation_offload

    @property
    def moe(self) -> MoEPlanSettings | None:
        return self.settings.moe

    @property
    def stack(self) -> StackSettings | None:
        return self.settings.stack

    @model_validator(mode="after")
    def _check(self) -> "ParallelPlan":
        m = self.model
        S, v = self.num_stages, self.num_virtual_stages
        for i, st in enumerate(self.stages):
            if st.num_chunks != v:
                raise ValueError(f"stages[{i}] has {st.num_chunks} chunks but stages[0] has {v}; every stage "
                                 "holds the same number of virtual chunks")
        expected = 0
        last = S * v - 1
        for s, j, ch in self.chunks_in_order():
            where = self.chunk_where(s, j)
            _check_end_only(m, where, j * S + s, last, ch)
            if ch.start_unit != expected:
                what = "overlaps the previous chunk" if ch.start_unit < expected else "leaves a gap"
                order = f" (model chunk {j * S + s} starts where chunk {j * S + s - 1} ends)" if v > 1 else ""
                raise ValueError(
                    f"{where}.start_unit ({ch.start_unit}) {what}; it must be {expected} "
                    f"(stages cover every unit once, in order{order})"
                )
            expected = ch.end_unit
            if expected > m.num_units:
                raise ValueError(f"{where}.end_unit ({expected}) is past the model's {m.num_units} units")
            for k, (unit, rc) in enumerate(zip(m.units[ch.start_unit:ch.end_unit], ch.recompute)):
                if rc in MLA_ONLY and rc not in recompute_allowed(unit.kind, m):
                    what = "the model has no MLA (mla)" if m.mla is None else f"unit {ch.start_unit + k} is {unit.kind}"
                    raise ValueError(
                        f"{where}.recompute[{k}] is {rc!r} but {what}; {rc!r} applies to the attention units of "
                        "an MLA model only: use none, selective or full"
                    )
                if rc not in recompute_allowed(unit.kind, m):
                    raise ValueError(
                        f"{where}.recompute[{k}] is {rc!r} but unit {ch.start_unit + k} is an MLP unit; "
                        f"{rc!r} applies to attention units only: use none, selective or full"
                    )
        if expected != m.num_units:
            raise ValueError(
                f"stages[-1].end_unit ({expected}) must be {m.num_units}: the model {m.name} has "
                f"{m.num_units} units; stages must cover all of them"
            )
        _check_mtp_in_last_chunk(self)
        for i, st in enumerate(self.stages):
            _check_stage_shape(m, i, st)
            check_expert_shape(m, i, st)
            if self.micro_batch_size % st.dp:
                raise ValueError(
                    f"stages[{i}].dp ({st.dp}) must divide micro_batch_size ({self.micro_batch_size}); "
                    "raise micro_batch_size or lower dp"
                )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if v > 1:
            _check_interleaving(self)
        if self.overlap_param_gather and not (self.distributed_optimizer or self.megatron_fsdp):
            raise ValueError("overlap_param_gather needs distributed_optimizer or megatron_fsdp (it overlaps their "
                             "parameter all-gather); set distributed_optimizer true or turn it off")
        _check_fsdp_offload(self)
        if self.tp_comm_overlap:
            bad = [i for i, st in enumerate(self.stages) if st.tp > 1 and not st.sequence_parallel]
            if bad or all(st.tp == 1 for st in self.stages):
                raise ValueError(
                    "tp_comm_overlap needs sequence_parallel on every stage with tp > 1"
                    + (f" (stages[{bad[0]}] has it off)" if bad else " and at least one such stage")
                    + "; turn sequence_parallel on or tp_comm_overlap off")
        check_moe_settings(self)
        if (why := stack_refusal(self)) is not None:
            raise ValueError(why)
        if self.cluster is not None:
            check_fits_cluster(self, self.cluster)
        return self

    # ----- derived --------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_virtual_stages(self) -> int:
        """Model chunks per stage (``v``; 1 = no interleaving). Megatron-LM's
        ``--num-virtual-stages-per-pipeline-rank``."""
        return self.stages[0].num_chunks

    def chunk_where(self, stage: int, chunk: int) -> str:
        """A chunk's place in messages: ``stages[1]``, or ``stages[1].chunks[2]`` with virtual stages."""
        return f"stages[{stage}]" + (f".chunks[{chunk}]" if self.num_virtual_stages > 1 else "")

    def chunks_in_order(self) -> list[tuple[int, int, ChunkSpec]]:
        """``(stage, chunk index in the stage, chunk)`` in model order: model chunk ``j * S + s``."""
        S = self.num_stages
        return [(s, j, self.stages[s].chunks[j]) for j in range(self.num_virtual_stages) for s in range(S)]

    @property
    def world_size(self) -> int:
        return sum(s.num_gpus for s in self.stages)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def micro_batch_per_rank(self, stage: int) -> int:
        """Samples per rank and micro-batch on ``stage`` (Megatron's ``--micro-batch-size``)."""
        return self.micro_batch_size // self.stages[stage].dp

    def first_rank(self, stage: int) -> int:
        return sum(s.num_gpus for s in self.stages[:stage])

    def stage_of_rank(self, rank: int) -> int:
        for i, st in enumerate(self.stages):
            rank -= st.num_gpus
            if rank < 0:
                return i
        raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks")

    def stage_units(self, stage: int) -> tuple[Unit, ...]:
        """The units of all the stage's chunks, chunk after chunk."""
        return tuple(u for c in self.stages[stage].chunks for u in self.model.units[c.start_unit:c.end_unit])

    def digest(self) -> str:
        """16 hex digits of the plan without its prediction: the identity its checkpoints and training logs carry."""
        import hashlib

        return hashlib.sha256(self.model_dump_json(exclude={"predicted"}).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=True) + "\n"


def span_text(a: int, b: int) -> str:
    """A chunk's span for text output: ``3-8``, or ``embed`` / ``loss`` for a unit-less end chunk (``holds_only``:
    an empty span is only ever model chunk 0, at unit 0, or the last one)."""
    return f"{a}-{b}" if a != b else ("embed" if a == 0 else "loss")


def _check_end_only(m: ModelSpec, where: str, k: int, last: int, ch: ChunkSpec) -> None:
    """A unit-less chunk is model chunk 0 holding the embedding or the last one holding the loss (megatron-core
    builds the embedding on the first and the loss on the last model chunk); GPT-style models only."""
    if ch.holds_only is None:
        return
    at = f"{where}.holds_only ({ch.holds_only!r})"
    if m.is_t5:
        raise ValueError(f"{at}: a chunk without units needs megatron-core's pipeline layout, which does not "
                         "support encoder-decoder (T5) models; give every chunk units")
    want = 0 if ch.holds_only == "embedding" else last
    if k != want:
        raise ValueError(f"{at}: this is model chunk {k}, but only model chunk {want} can hold only the "
                         f"{ch.holds_only} (the embedding is on the first model chunk, the loss on the last)")
    if last == 0:
        raise ValueError(f"{at}: the plan's only chunk must hold the model's units; drop holds_only")
    if ch.holds_only == "loss" and m.mtp_num_layers:
        raise ValueError(f"{at}: the model has {m.mtp_num_layers} MTP layer(s), which run with the loss in the last "
                         "chunk; a loss-only chunk after them is megatron-core's standalone MTP, which plans do not "
                         "express: move the MTP units into the last chunk")


def _check_mtp_in_last_chunk(plan: "ParallelPlan") -> None:
    """The MTP units (the model's last ``mtp_num_layers`` units) are all in the last model chunk: megatron-core
    builds the whole ``MultiTokenPredictionBlock`` there (with the loss), so a cut among them or before them and
    after the chunk's start cannot run."""
    m = plan.model
    if not m.mtp_num_layers:
        return
    first = m.num_units - m.mtp_num_layers
    s, j, ch = plan.chunks_in_order()[-1]
    if ch.start_unit > first:
        raise ValueError(f"{plan.chunk_where(s, j)}.start_unit ({ch.start_unit}) leaves MTP unit(s) "
                         f"{first}-{ch.start_unit - 1} on an earlier chunk; megatron-core builds the whole MTP block "
                         f"on the last model chunk: start it at unit {first} or before")


def _check_stage_shape(m: ModelSpec, i: int, st: StageSpec) -> None:
    """TP must split heads and FFN and divide or be a multiple of the query groups (megatron-core's rule,
    ``query_groups``); SP and CP must split the sequence(s)."""
    why = query_groups.tp_refusal(m.num_attention_heads, m.groups, m.ffn_hidden_size, st.tp)
    if why:
        raise ValueError(f"stages[{i}].{why}")
    seqs = [("seq_length", m.seq_length)] + ([("decoder_seq_length", m.decoder_seq_length)] if m.is_t5 else [])
    if m.hybrid_layer_pattern:       # whole heads (and Mamba groups) per TP and CP rank: each kind's rule
        from search.layers.kind import shape_refusal
        why = shape_refusal(m, st.tp, st.cp)
        if why:
            raise ValueError(f"stages[{i}] (tp {st.tp}, cp {st.cp}): {why}")
    if st.cp > 1:
        if m.is_t5:
            raise ValueError(f"stages[{i}].cp ({st.cp}): megatron-core's T5Model has no context parallelism; "
                             "use cp 1")
        split = 2 * st.cp    # causal masking: megatron-core balances the load over 2*cp sequence chunks
        if m.seq_length % split:
            raise ValueError(f"stages[{i}].cp ({st.cp}): with causal masking 2*cp ({split}) must divide "
                             f"seq_length ({m.seq_length}); use a cp that does")
    if st.sequence_parallel:
        for name, s in seqs:
            if (s // st.cp) % st.tp:
                per = f"seq_length / cp ({s // st.cp})" if st.cp > 1 else f"{name} ({s})"
                raise ValueError(f"stages[{i}].sequence_parallel: tp ({st.tp}) must divide {per}; "
                                 "turn sequence_parallel off or use another tp")


def _check_interleaving(plan: ParallelPlan) -> None:
    """megatron-core's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``, 0.16)."""
    S, v, M = plan.num_stages, plan.num_virtual_stages, plan.num_micro_batches
    if plan.model.is_t5:
        raise ValueError(f"stages[0].chunks: {v} virtual chunks per stage, but megatron-core's interleaved "
                         "schedule does not run encoder-decoder (T5) models; use one chunk per stage")
    if S < 2:
        raise ValueError(f"stages[0].chunks: {v} virtual chunks need at least 2 pipeline stages (there is 1); "
                         "use one chunk")
    if M % S:
        raise ValueError(f"{v} virtual chunks per stage: the number of micro-batches (global_batch_size / "
                         f"micro_batch_size = {M}) must be a multiple of the {S} stages (megatron-core's "
                         "interleaved schedule runs them in groups of num_stages); change the batch sizes")


def check_fits_cluster(plan: ParallelPlan, cluster: ClusterSpec) -> None:
    """Raise ValueError if the plan's ranks do not fit the cluster (GPU count, TP groups inside a node)."""
    if plan.world_size != cluster.num_gpus:
        raise ValueError(
            f"stages use {plan.world_size} GPUs but the cluster {cluster.label} has {cluster.num_gpus}; "
            "make the stages' num_gpus add up to it"
        )
    for i, st in enumerate(plan.stages):
        if st.tp > cluster.nvlink_size:
            where = (f"gpus_per_node ({cluster.gpus_per_node})" if cluster.nvlink_domain is None
                     else f"nvlink_domain ({cluster.nvlink_domain})")
            raise ValueError(f"stages[{i}].tp ({st.tp}) exceeds {where}; TP stays inside an NVLink domain")
        first = plan.first_rank(i)
        for j in range(st.cp * st.dp):
            lo = first + j * st.tp
            if cluster.domain_of(lo) != cluster.domain_of(lo + st.tp - 1):
                raise ValueError(
                    f"stages[{i}]: TP group of ranks {lo}..{lo + st.tp - 1} spans two "
                    f"{'nodes' if cluster.nvlink_domain is None else 'NVLink domains'}; move the stage boundary so "
                    "TP groups stay inside one"
                )


def recompute_text(counts: dict[str, int]) -> str:
    """One notation for a stage's recompute choices (``aceso search`` and ``aceso explain``): the choice when every
    unit has it, else counts in ``RECOMPUTE_CHOICES`` order: ``"full"``, ``"none 3, selective 2"``."""
    order = {c: i for i, c in enumerate(RECOMPUTE_CHOICES)}
    items = sorted(((c, n) for c, n in counts.items() if n), key=lambda cn: order.get(cn[0], len(order)))
    if len(items) == 1 and items[0][0] in order:
        return items[0][0]
    return ", ".join(f"{c} {n}" for c, n in items)


def check_recompute_applies(plan: ParallelPlan, flash: bool | None = None, why_flash: str = "") -> None:
    """Refuse ``attn_dropout`` where it frees nothing (``AcesoError`` with the reason): it frees the dropout mask and
    the dropped attention probabilities, so it needs attention dropout in the model and unfused attention (flash
    attention keeps neither). ``flash``: the cost model's assumption (None: unknown); the plan's own
    ``predicted.attention`` counts too. The runtime runs such a plan (as ``none``); the cost models cannot price
    it, so the planner's commands (validate, explain) check this."""
    where = next(((s, j, k) for s, j, ch in plan.chunks_in_order() for k, rc in enumerate(ch.recompute)
                  if rc == "attn_dropout"), None)
    if where is None:
        return
    s, j, k = where
    at = f"{plan.chunk_where(s, j)}.recompute[{k}]"
    fix = "use none, selective or full there"
    if plan.model.attention_dropout == 0:
        raise AcesoError(f"{at} is 'attn_dropout' but the model has no attention dropout (attention_dropout 0): "
                         f"it frees nothing; {fix}")
    if plan.predicted is not None and plan.predicted.attention == "flash":
        flash, why_flash = True, "the plan's prediction assumed flash attention (predicted.attention)"
    if flash:
        raise AcesoError(f"{at} is 'attn_dropout' but {why_flash or 'the attention is flash'}, which keeps no "
                         f"dropout mask or probabilities: it frees nothing; {fix}, or plan for --attention unfused")


def load_plan(path: str | Path, world_size: int | None = None) -> ParallelPlan:
    """Read and validate a plan file; every problem becomes one ``AcesoError`` line."""
    raw = read_json(path, missing="no such plan file")
    return parse_plan(raw, world_size=world_size, source=str(path))


def parse_plan(raw: object, world_size: int | None = None, source: str = "plan") -> ParallelPlan:
    if isinstance(raw, dict) and raw.get("schema_version", SCHEMA_VERSION) not in READS_VERSIONS:
        raise AcesoError(
            f"{source}: schema_version {raw.get('schema_version')!r} is not supported (this version reads "
            f"{', '.join(map(str, READS_VERSIONS))}); regenerate the plan"
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
    out = Path(__file__).resolve().parents[2] / "docs" / "plan.schema.json"
    out.write_text(plan_json_schema())
    print(f"wrote {out}")


def even_split(num_items: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` contiguous parts of ``num_items``, as even as possible (earlier parts larger)."""
    base, extra = divmod(num_items, num_parts)
    return [base + (1 if i < extra else 0) for i in range(num_parts)]


def uniform_plan(model: ModelSpec, num_stages: int, tp: int, dp: int, micro_batch_size: int,
                 global_batch_size: int, recompute: Recompute = "none",
                 cluster: ClusterSpec | None = None, cp: int = 1, sequence_parallel: bool = False,
                 num_virtual_stages: int = 1, **features) -> ParallelPlan:
    """A Megatron-style plan: every stage tp x cp x dp, whole layers split as evenly as possible over the
    ``num_stages * num_virtual_stages`` model chunks; ``features``: ``PlanSettings`` fields (``distributed_optimizer``,
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``tp_comm_overlap``, ...).

    Units are grouped per layer (2 units; T5 decoder layers 3), so chunk boundaries fall between layers.
    """
    starts = model.layer_starts
    num_layers = len(starts) - 1
    num_chunks = num_stages * num_virtual_stages
    if num_chunks > num_layers:
        raise AcesoError(f"num_stages * num_virtual_stages ({num_chunks}) exceeds the model's {num_layers} layers")
    spans, li = [], 0
    for n_layers in even_split(num_layers, num_chunks):
        spans.append((starts[li], starts[li + n_layers]))
        li += n_layers
    stages = [StageSpec(num_gpus=tp * cp * dp, tp=tp, cp=cp, dp=dp, sequence_parallel=sequence_parallel,
                        chunks=[ChunkSpec(start_unit=lo, end_unit=hi, recompute=[recompute] * (hi - lo))
                                for lo, hi in spans[s::num_stages]])
              for s in range(num_stages)]
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=micro_batch_size,
                        global_batch_size=global_batch_size, stages=stages, settings=PlanSettings(**features))
