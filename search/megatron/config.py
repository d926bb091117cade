"""``MegatronConfig``: a plan as stock Megatron-LM runs it (short names), and the way back to a ``ParallelPlan``.

Megatron-LM runs one shape on every pipeline rank (tp, cp, dp, sequence parallelism), spreads whole layers over
the ``pp * vpp`` model chunks (``chunk_layers``, model order: chunk ``k`` is virtual stage ``k // pp`` of pipeline
rank ``k % pp``, as ``ParallelPlan.chunks_in_order``) and applies one recompute setting to every transformer block
(``Recompute``). MoE: one expert shape ``ep`` / ``etp`` for every stage; the MTP block runs in the last model
chunk. Everything plan-wide (the distributed optimizer, overlaps, Megatron FSDP, offload, the precision recipe,
the optimizer, the MoE and stack settings, the DP flags) is the plan's one ``settings`` record
(``search/settings/plan_settings.py``). ``micro_batch_size`` here is Megatron-LM's
per-rank ``--micro-batch-size``: the plan's pipeline
micro-batch divided by dp. ``vocab_divisor`` is ``--make-vocab-size-divisible-by``: Megatron-LM pads the vocabulary
to a multiple of it times tp, so ``ModelSpec.make_vocab_size_divisible_by = vocab_divisor * tp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.settings.plan_settings import PlanSettings

Granularity = Literal["full", "selective"]


@dataclass(frozen=True)
class Recompute:
    """Megatron-LM's activation recompute settings (megatron-core ``TransformerConfig.recompute_*``).

    ``selective`` recomputes the modules in ``modules`` (only ``core_attn`` maps onto a plan) in every layer;
    ``full`` with ``method`` ``uniform`` recomputes every layer of a transformer block in groups of ``num_layers``,
    with ``block`` the first ``num_layers`` layers of each block (each model chunk; a T5 chunk has an encoder and a
    decoder block) and none of the others.
    """

    granularity: Granularity | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.granularity is None:
            return "none"
        if self.granularity == "selective":
            return "selective (" + ", ".join(self.modules) + ")"
        return f"full ({self.method}, {self.num_layers} layer{'s' if self.num_layers != 1 else ''})"


NO_RECOMPUTE = Recompute()


@dataclass(frozen=True)
class MegatronConfig:
    """Everything of a plan that a Megatron-LM command line sets."""

    model: ModelSpec
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int                            # model chunks per pipeline rank (1: no interleaving)
    sequence_parallel: bool
    chunk_layers: tuple[int, ...]       # transformer layers per model chunk, model order (pp * vpp entries)
    recompute: Recompute
    micro_batch_size: int               # per rank (Megatron-LM's --micro-batch-size)
    global_batch_size: int
    attention: Literal["flash", "unfused"] | None = None   # transformer_engine / local
    ep: int = 1                         # MoE: --expert-model-parallel-size (every stage)
    etp: int | None = None              # MoE: --expert-tensor-parallel-size (None: not given, = tp)
    settings: PlanSettings = field(default_factory=lambda: PlanSettings(framework="megatron-lm"))   # the plan's

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def precision(self) -> str:
        return self.model.params_dtype

    @property
    def fsdp(self) -> str | None:
        """``--data-parallel-sharding-strategy`` of the plan's Megatron FSDP (None: DDP)."""
        f = self.settings.megatron_fsdp
        return f.data_parallel_sharding_strategy if f is not None else None

    @property
    def transformer_impl(self) -> str:
        return "local" if self.attention == "unfused" else "transformer_engine"

    @property
    def vocab_divisor(self) -> int:
        """``--make-vocab-size-divisible-by``: Megatron-LM pads to a multiple of this x tp (exporter checked)."""
        m, tp = self.model.make_vocab_size_divisible_by, self.tp
        return m // tp if m % tp == 0 else self.model.padded_vocab_size // tp

    def stage_layers(self) -> list[int]:
        """Layers per pipeline rank (all its chunks)."""
        return [sum(self.chunk_layers[s::self.pp]) for s in range(self.pp)]


def num_layers(model: ModelSpec) -> int:
    """Transformer layers a Megatron-LM layout places (T5: encoder + decoder; the MTP block is not one of them)."""
    return model.num_layers + (model.num_decoder_layers if model.is_t5 else 0)


def layer_bounds(model: ModelSpec) -> list[int]:
    """Where each transformer layer starts, plus where the last one ends: ``model.layer_starts`` without the MTP
    units after the last layer (which ``layer_starts`` may count in the last layer's span)."""
    mtp = sum(u.kind == "mtp" for u in model.units)
    return model.layer_starts[:num_layers(model)] + [model.num_units - mtp]


class NotExpressible(AcesoError):
    """The plan has something stock Megatron-LM cannot run; the message names the stage and field."""


HINT = "search with --target megatron-lm, or run the plan as it is with aceso train"


def layer_name(model: ModelSpec, unit) -> str:
    """``layer 3`` (GPT/Llama) or ``decoder layer 3`` (T5) for the layer holding ``unit``."""
    return f"{unit.stack} layer {unit.layer}" if model.is_t5 else f"layer {unit.layer}"
