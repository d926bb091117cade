"""The search space: which stage shapes, micro-batches, chunkings and plan-level features a state may take.

A stage shape is ``Shape(tp, dp, cp, sp)`` on ``tp * cp * dp`` adjacent ranks (Megatron's tp-cp-dp order): tp a
power of two dividing heads, query groups and FFN, at most a node, and TP groups never straddle a node; cp one of
the context-parallel candidates (2 cp divides the sequence; not T5); sp only with tp > 1 and tp dividing the
tokens per CP rank.

**Micro-batches.** ``batches`` are the *per-rank* candidates (Megatron-LM's ``--micro-batch-size``). A state
carries one pipeline micro-batch ``m`` that every stage exchanges; stage i runs ``m / dp_i`` samples per rank.
The rule: ``m`` is legal iff it divides the global batch and **every stage's per-rank batch ``m / dp_i`` is one of
the candidates**. So data parallelism is limited only by the GPUs and the global batch (dp 48 with per-rank 1 is
``m = 48``), and stages of different dp differ by the ratio of two candidates (dp 8 and 16 share ``m = 16`` at
per-rank 2 and 1). A primitive that changes a stage's dp keeps ``m`` when it stays legal, else keeps that stage's
per-rank batch (``m`` scaled by the dp ratio), else takes the closest legal ``m`` (``retarget_mbs``).

**Chunks.** ``v`` model chunks per stage (interleaved 1F1B) when the cost model prices it: the state's bounds are
those of the ``S v`` model chunks in model order (chunk ``k`` is chunk ``k // S`` of stage ``k % S``); megatron-core
needs ``S >= 2`` and ``M % S == 0``.

**Features.** The plan-level switches (``Features``) the search may use: each is searched when the training spec
leaves it ``None`` and the cost model prices it (``CostModel.features``), else fixed; ``features[0]`` is the
preferred combination (everything on: what an experienced Megatron user runs).

**Experts (MoE models).** Each stage shape also carries its expert shape ``ep`` / ``etp`` (``experts.py``: etp 1 or
tp, ep dividing the experts and the stage's GPUs over etp); sequence parallelism is forced on at tp > 1 (megatron-core's
MoE layer refuses TP without it). ``shapes`` / ``stage_shapes`` give each attention shape one expert shape (``fit``:
the old one's where legal, else etp 1 and the largest ep), so the candidate count stays that of a dense model; the
expert moves (``expert_moves.py``) explore the rest.

**Targets.** ``aceso`` (our runtime: everything above, per stage) or ``megatron-lm`` (what stock Megatron-LM can
run, ``megatron_lm.py``): the same shape (and one folding: ep, etp) on every stage, stage and chunk boundaries on
layer boundaries.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from ..costmodel.types import Features, Shape
from search.io.errors import AcesoError
from search.settings.fsdp import one_rank_group, pipeline_refusal
from search.layers.layer_variants import offset_blocks_cp
from ..layers.kind import shape_refusal, without_runtime_cp
from ..megatron.hybrid_pattern import runs_as_pattern
from search.settings.moe_plan import MoEPlanSettings, dispatcher_settings, overlap_ep_refusal
from search.settings.plan_settings import sync_p2p_refused
from search.spec.training import MAX_VIRTUAL
from search.spec import query_groups
from . import constraints
from .experts import ExpertSpace

TARGETS = ("aceso", "megatron-lm")
FEATURE_NAMES = ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")


def _switch(training, name: str, priced: frozenset, label: str) -> tuple[bool, ...]:
    """The values a switch may take: searched (None and priced) -> (True, False); fixed -> its value."""
    want = getattr(training, name)
    if want is None:
        return (True, False) if name in priced else (False,)
    if want and name not in priced:
        raise AcesoError(f"--{label} on: this cost model cannot price it; use the analytic or profile model, or "
                         "turn it off")
    return (bool(want),)


def feature_combos(training, priced: frozenset) -> tuple[Features, ...]:
    """Every consistent combination of the searched plan-level switches, preferred (all on) first."""
    do = _switch(training, "distributed_optimizer", priced, "distributed-optimizer")
    og = _switch(training, "overlap_grad_reduce", priced, "overlap")
    op = _switch(training, "overlap_param_gather", priced, "overlap")
    tco = bool(training.tp_comm_overlap)
    if tco and "tp_comm_overlap" not in priced:
        raise AcesoError("--tp-comm-overlap: this cost model cannot price it; use the analytic or profile model")
    out = [Features(d, g, p, tco) for d, g, p in itertools.product(do, og, op) if d or not p]
    if not out:
        raise AcesoError("--overlap on needs the distributed optimizer for the parameter all-gather; do not turn "
                         "--distributed-optimizer off")
    return tuple(out)


def bridge_features(model, features: tuple[Features, ...]) -> tuple[Features, ...]:
    """A Bridge search's combinations with its recipe's loss fusion (``bridge.recipe_ce_fusion``): every recipe
    ``aceso export --to megatron-bridge`` writes runs the fused loss, and a Bridge user keeps it, so every state is
    priced with it and its plan records it (``settings.stack.cross_entropy_fusion``, which the YAML states)."""
    from ..costmodel.types import StackKey
    from ..megatron.bridge import recipe_ce_fusion
    ce = recipe_ce_fusion(model)
    return tuple(f._replace(stack=StackKey(ce_fusion=ce)) for f in features) if ce else features


SEARCHED_FSDP = ("optim_grads_params", "optim_grads")   # what saves memory beyond the distributed optimizer


def with_fsdp(training, priced: frozenset, features: tuple[Features, ...], target: str) -> tuple[Features, ...]:
    """The feature combinations plus Megatron FSDP's (``--target megatron-lm`` only: the runtime runs DDP): the
    two strategies that shard beyond the distributed optimizer (``optim`` prices exactly as it), overlapped as the
    switches allow; ``training.megatron_fsdp`` True: only those, False: none."""
    want = training.megatron_fsdp
    if want is False or (want is None and (target != "megatron-lm" or "megatron_fsdp" not in priced)):
        return features
    if target != "megatron-lm" or "megatron_fsdp" not in priced:
        raise AcesoError("--megatron-fsdp on: Megatron FSDP is searched for --target megatron-lm with the analytic "
                         "or profile model; use them, or turn it off")
    if features[0].tp_comm_overlap:
        return features if want is None else ()
    og = training.overlap_grad_reduce is not False
    op = og and training.overlap_param_gather is not False
    fsdp = tuple(Features(False, og, op, False, fsdp=s) for s in SEARCHED_FSDP)
    return fsdp if want else features + fsdp
def cut_points(model) -> tuple[int, ...]:
    """The model's layer starts as stage cut points, the last one the end of every unit: a unit after the last
    layer (an MoE model's MTP block) belongs to the last layer's chunk, wherever ``layer_starts`` ends."""
    starts = list(model.layer_starts)
    starts[-1] = max(starts[-1], model.num_units)
    return tuple(starts)


MAX_CHUNKS = 128    # default degrees only: at most this many model chunks in all (one layer each up to 128 layers)


def virtual_degrees(model, target: str) -> tuple[int, ...]:
    """Every number of model chunks per pipeline rank Megatron-LM (core_v0.16.1) accepts: ``validate_args`` takes
    any ``--num-virtual-stages-per-pipeline-rank`` (or a ``--pipeline-model-parallel-layout`` whose length pp
    divides) on pp >= 2 with its default p2p overlap, ``--num-layers-per-virtual-pipeline-stage`` any divisor of the
    layers per rank. So every v from 1 up to one layer per chunk on two stages (aceso target: one unit), at most
    ``MAX_VIRTUAL``; ``Space.legal`` keeps S v chunks within the layers (units) of the state and, for these default
    degrees, within ``MAX_CHUNKS`` (bounded search time; no degree is excluded for models up to 128 layers)."""
    top = len(model.layer_starts) - 1 if target in ("megatron-lm", "megatron-bridge") else model.num_units
    return tuple(range(1, max(min(top // 2, MAX_VIRTUAL, MAX_CHUNKS // 2), 1) + 1))


def bridge_one_chunk(model) -> bool:
    """Whether Megatron-Bridge runs the model's plans on one model chunk per stage only: a model it runs as a hybrid
    pattern (``bridge_hybrid``: v0.3.1's ``MambaModelProvider`` and v0.6.0's ``HybridModelProvider`` both assert no
    virtual pipeline; ``capabilities.bridge_hybrid_layout`` refuses every such plan), so the Bridge space offers
    no interleaving there instead of pricing states the final check then drops."""
    return runs_as_pattern(model)


def _candidates(values, priced: bool, name: str, label: str) -> tuple[int, ...]:
    vals = tuple(sorted(set(values)))
    if priced:
        return vals
    if 1 not in vals:
        raise AcesoError(f"--{label} {' '.join(map(str, vals))}: this cost model cannot price {name}; use the "
                         f"analytic or profile model, or {label} 1")
    return (1,)


def _bad_tp_cp(model, tps, cps) -> frozenset[tuple[int, int]]:
    """The (tp, cp) pairs a layer kind of the model refuses (``layers.kind.shape_refusal``: Mamba-2's
    ``MambaContextParallel``, GDN's heads per rank; none without such layers)."""
    return frozenset((t, c) for t in tps for c in cps if shape_refusal(model, t, c) is not None)


@dataclass(frozen=True)
class Space:
    """What shapes, micro-batches, chunkings and features the cluster, model, training spec and cost model allow."""

    num_gpus: int
    gpus_per_node: int
    tps: tuple[int, ...]
    batches: tuple[int, ...]            # per-rank micro-batch candidates that divide the global batch
    num_units: int
    gbs: int = 0                        # 0: any pipeline micro-batch (tests)
    cps: tuple[int, ...] = (1,)
    sps: tuple[bool, ...] = (False,)    # sequence-parallel values a tp > 1 stage may take, preferred first
    vs: tuple[int, ...] = (1,)
    features: tuple[Features, ...] = (Features(),)
    uniform_cp: bool = True
    target: str = "aceso"
    layer_starts: tuple[int, ...] = ()
    seqs: tuple[int, ...] = ()          # sequence lengths SP must split (GPT: one; T5: encoder and decoder)
    allowed: frozenset[tuple[int, int]] | None = None   # (per-rank batch, tp) the cost model covers; None: all
    max_stages: int = 0                 # 0: any (megatron-lm runs T5 on one pipeline stage)
    pps: frozenset[int] | None = None   # allowed numbers of stages (--pp); None: any
    max_chunks: int = 0                 # 0: any; else at most this many model chunks (default VPP degrees)
    experts: ExpertSpace | None = None  # MoE models: the expert shapes a stage may take; None: dense (ep 1)
    moe: object = None                  # MoE models: the MoEPlanSettings every state runs with (None: defaults)
    empty_ends: tuple[bool, bool] = (False, False)   # model chunk 0 may hold only the embedding / the last only
    #                                                  the loss (ChunkSpec.holds_only: GPT-style models, no MTP)
    bad_tp_cp: frozenset[tuple[int, int]] = frozenset()   # (tp, cp) a model's layers refuse (Mamba-2 heads and
    #                                                  groups per TP and CP rank: search.layers.mamba.cp_refusal)
    runs_on: str = ""                   # megatron-bridge: a Megatron-LM space whose plans Bridge must also run
    sync_p2p: bool = False              # interleaved p2p without overlap (--no-overlap-p2p-communication): Megatron-LM
    #                                     runs virtual stages on pp > 2 only (plan_settings.sync_p2p_refused)

    @classmethod
    def of(cls, model, cluster, training, micro_batch_sizes=None, priced=frozenset(), target: str = "aceso",
           allowed=None, moe=None, expert_shapes=None, sync_p2p: bool = False) -> "Space":
        """``priced``: what the cost model prices beyond a v1 plan (``CostModel.features``; empty for compat);
        ``moe``: the MoE settings every state runs with (``MoEPlanSettings``; None: the defaults);
        ``expert_shapes``: the (tp, ep, etp, dispatcher) the cost model prices (``ExpertSpace.of``; None: all);
        ``sync_p2p``: the plans run the interleaved schedule's p2p without overlap (``PlanSettings.overlap_p2p_comm``
        False)."""
        if target not in TARGETS + ("megatron-bridge",):
            raise AcesoError(f"--target {target}: choose one of {', '.join(TARGETS)}, megatron-bridge")
        runs_on, target = ("megatron-bridge", "megatron-lm") if target == "megatron-bridge" else ("", target)
        priced = frozenset(priced)
        tps, t = [], 1
        while t <= cluster.nvlink_size:
            if query_groups.tp_refusal(model.num_attention_heads, model.groups, model.ffn_hidden_size, t) is None \
                    and shape_refusal(model, t) is None:
                tps.append(t)
            t *= 2
        tps = list(constraints.tensor_sizes(model, cluster, training, tps))
        gbs = training.global_batch_size
        batches = tuple(sorted({m for m in (micro_batch_sizes or training.micro_batch_sizes) if gbs % m == 0}))
        cps = _candidates(training.context_parallel_sizes, "context_parallel" in priced, "context parallelism",
                          "context-parallel-sizes")
        if model.is_t5 and cps != (1,):
            cps = (1,)          # megatron-core's T5Model has no context parallelism
        if target == "aceso" and without_runtime_cp(model):
            cps = (1,)          # a layer kind the runtime does not run under CP yet (Mamba-2, GDN); Megatron-LM does
        if offset_blocks_cp(model):
            cps = (1,)          # a softmax offset runs under cp only over a2a, which is not priced (layer_variants)
        legal_cps = tuple(c for c in cps if c == 1 or model.seq_length % (2 * c) == 0)
        if not legal_cps:
            raise AcesoError(f"--context-parallel-sizes {' '.join(map(str, cps))}: 2 cp must divide seq_length "
                             f"({model.seq_length}) (causal load balancing); add 1 or a cp that does")
        cps = legal_cps
        vs = (virtual_degrees(model, target) if "interleaved" in priced else (1,)) \
            if training.virtual_stages is None else \
            _candidates(training.virtual_stages, "interleaved" in priced, "interleaving", "virtual-stages")
        if training.virtual_stages is not None:
            constraints.check_virtual(model, training.virtual_stages)
        if model.is_t5:
            vs = (1,)           # the interleaved schedule does not run encoder-decoder models
        if runs_on == "megatron-bridge" and bridge_one_chunk(model):
            if 1 not in vs:
                raise AcesoError(f"--virtual-stages {' '.join(map(str, vs))}: Megatron-Bridge's hybrid model "
                                 "providers assert no virtual pipeline; use --virtual-stages 1, or --target "
                                 "megatron-lm")
            vs = (1,)           # both Bridge hybrid providers assert no virtual pipeline (the capability table's row)
        if sync_p2p and target == "megatron-lm" and all(sync_p2p_refused(False, S, v) for v in vs
                                                        for S in (training.pipeline_parallel_sizes or [3])):
            pps = " ".join(map(str, training.pipeline_parallel_sizes))
            raise AcesoError(f"--no-overlap-p2p-communication with --pp {pps} and --virtual-stages "
                             f"{' '.join(map(str, vs))}: Megatron-LM runs virtual stages without "
                             "p2p overlap on more than 2 pipeline stages only; allow more stages or 1 chunk, or drop "
                             "the flag")
        sps = _switch(training, "sequence_parallel", priced, "sequence-parallel")
        if training.tp_comm_overlap:
            sps = (True,)       # TE's TP overlap needs sequence parallelism on every tp > 1 stage
        if moe is None and model.moe is not None and (training.token_dispatchers or training.moe_router_dtype
                                                      or training.moe_hybridep_num_sms):
            # --dispatcher: the first; --moe-router-dtype: every plan's; --moe-hybridep-num-sms: HybridEP's (flex
            # searched on HybridEP then, DeepEP a candidate of the final step)
            sms = training.moe_hybridep_num_sms
            moe = dispatcher_settings(model, (training.token_dispatchers or ["alltoall"])[0],
                                      MoEPlanSettings(router_dtype=training.moe_router_dtype, hybridep_num_sms=sms,
                                                      flex_backend="hybridep" if sms else "deepep"))
        experts = ExpertSpace.of(model, expert_shapes, getattr(moe, "token_dispatcher", "alltoall"),
                                 **constraints.expert_limits(model, cluster, training, tps))
        if experts is not None and True in sps:
            sps = (True,)       # MoE + TP needs sequence parallelism (moe_plan.check_expert_shape)
        seqs = (model.seq_length,) + ((model.decoder_seq_length,) if model.is_t5 else ())
        features = feature_combos(training, priced)
        if target == "megatron-lm":   # --overlap-param-gather requires --overlap-grad-reduce (validate_args)
            features = tuple(f for f in features if f.overlap_grad_reduce or not f.overlap_param_gather)
            if not features:
                raise AcesoError("--target megatron-lm: Megatron-LM overlaps the parameter all-gather only with "
                                 "the gradient reduction; do not turn --overlap off")
        features = with_fsdp(training, priced, features, target)
        if runs_on == "megatron-bridge" and priced:
            features = bridge_features(model, features)
        return cls(cluster.num_gpus, cluster.gpus_per_node, tuple(tps), batches, model.num_units, gbs, cps, sps,
                   vs, features, bool(training.uniform_cp), target, cut_points(model), seqs,
                   None if allowed is None else frozenset(allowed), 1 if target == "megatron-lm" and model.is_t5 else 0,
                   constraints.pipeline_sizes(model, cluster, training),
                   MAX_CHUNKS if training.virtual_stages is None else 0, experts, moe if experts else None,
                   empty_ends=(not model.is_t5, not model.is_t5 and not model.mtp_num_layers),
                   bad_tp_cp=_bad_tp_cp(model, tps, cps), runs_on=runs_on, sync_p2p=sync_p2p)

    @property
    def evaluator_target(self) -> str:
        """The ``Evaluator`` target of this space's plans: ``megatron-bridge`` for a Bridge search, else its own."""
        return self.runs_on or self.target

    @functools.cached_property
    def v_set(self) -> frozenset[int]:
        return frozenset(self.vs)

    # ----- micro-batches ------------------------------------------------------------------------------------------
    def batch_ok(self, b: int, tp: int) -> bool:
        return b in self.batches and (self.allowed is None or (b, tp) in self.allowed)

    def allows(self, tp: int, dp: int, mbs: int) -> bool:
        """Whether a stage of this (tp, dp) at pipeline micro-batch ``mbs`` is in the cost model's coverage."""
        return self.allowed is None or (mbs // dp, tp) in self.allowed

    def candidate_shapes(self) -> set[tuple[int, int]]:
        """Every (per-rank batch, tp) a stage could use before ``allowed`` filters it."""
        return {(b, tp) for b in self.batches for tp in self.tps}

    def mbs_ok(self, shapes, m: int) -> bool:
        """Every stage's per-rank batch ``m / dp`` is a candidate, and ``m`` divides the global batch."""
        if self.gbs and self.gbs % m:
            return False
        return all(m % s.dp == 0 and self.batch_ok(m // s.dp, s.tp) for s in shapes)

    def legal_mbs(self, shapes) -> list[int]:
        """Every legal pipeline micro-batch for these shapes, ascending."""
        d0 = shapes[0].dp
        return [b * d0 for b in self.batches if self.mbs_ok(shapes, b * d0)]

    def retarget_mbs(self, shapes, m: int, keep: int | None = None, old_dp: int | None = None) -> int | None:
        """``m`` if legal for ``shapes``; else stage ``keep``'s per-rank batch kept (``m * dp / old_dp``); else the
        legal micro-batch closest to ``m`` by ratio (the smaller on ties); None if there is none."""
        if self.mbs_ok(shapes, m):
            return m
        if keep is not None and old_dp:
            m2 = m * shapes[keep].dp
            if m2 % old_dp == 0 and self.mbs_ok(shapes, m2 // old_dp):
                return m2 // old_dp
        legal = self.legal_mbs(shapes)
        if not legal:
            return None
        return min(legal, key=lambda x: (max(x / m, m / x), x))

    # ----- shapes -------------------------------------------------------------------------------------------------
    def _sp_splits(self, tp: int, cp: int) -> bool:
        return all((s // cp) % tp == 0 for s in self.seqs)

    def sp_for(self, tp: int, cp: int, old: bool | None = None) -> bool | None:
        """The sequence-parallel value of a new (tp, cp) shape: off at tp 1, else ``old`` when allowed, else the
        preferred one; None when none is allowed (SP required but tp does not split the tokens)."""
        if tp == 1:
            return False
        opts = [x for x in self.sps if not x or self._sp_splits(tp, cp)]
        if not opts:
            return None
        return old if old in opts else opts[0]

    def shape_ok(self, s: Shape) -> bool:
        if s.tp not in self.tps or s.cp not in self.cps or s.dp < 1 or (s.tp, s.cp) in self.bad_tp_cp:
            return False
        if self.experts is None:
            if s.ep != 1 or s.etp:
                return False
        elif not self.experts.ok(s) or (s.tp > 1 and not s.sp):
            return False
        if s.tp == 1:
            return not s.sp
        return s.sp in self.sps and (not s.sp or self._sp_splits(s.tp, s.cp))

    def expert_fit(self, s: Shape, old: Shape | None = None) -> Shape | None:
        """``s`` with its expert shape (``ExpertSpace.fit``; ep 1 on a dense model); None when it has none."""
        if self.experts is None:
            return s._replace(ep=1, etp=0)
        return self.experts.fit(s, old)

    def stage_shapes(self, g: int, cp: int | None = None, every_sp: bool = True) -> list[Shape]:
        """Every shape of ``g`` GPUs whatever the micro-batch (``every_sp`` False: the preferred SP value only)."""
        out = []
        for c in ((cp,) if cp is not None else self.cps):
            for tp in self.tps:
                if g % (tp * c):
                    continue
                sps = [self.sp_for(tp, c)] if not every_sp or tp == 1 else list(self.sps)
                for x in sps:
                    s = self.expert_fit(Shape(tp, g // (tp * c), c, bool(x)))
                    if x is not None and s is not None and self.shape_ok(s):
                        out.append(s)
        return out

    def shapes(self, g: int, m: int, cp: int | None = None, sp: bool | None = None,
               old: Shape | None = None) -> list[Shape]:
        """Every shape of ``g`` GPUs legal at pipeline micro-batch ``m`` (``cp`` fixed if given; ``sp``: the old
        value to keep where allowed; ``old``: the shape whose expert shape to keep where legal)."""
        out = []
        for c in ((cp,) if cp is not None else self.cps):
            for tp in self.tps:
                if g % (tp * c):
                    continue
                dp = g // (tp * c)
                if m % dp or not self.batch_ok(m // dp, tp):
                    continue
                x = self.sp_for(tp, c, sp)
                s = None if x is None else self.expert_fit(Shape(tp, dp, c, x), old)
                if s is not None and self.shape_ok(s):
                    out.append(s)
        return out

    # ----- GPU splits for S stages ------------------------------------------------------------------------------------
    def gpu_splits(self, S: int) -> list[list[int]]:
        """Ways to split the GPUs into S stage sizes as evenly as valid sizes allow: for each odd divisor f of the
        GPU count, sizes ``f 2^k`` (so the stages' dp differ by powers of two), the largest that fits S times, then
        the last stages grown to the next size, round robin, until every GPU is used."""
        N = self.num_gpus
        odd = N
        while odd % 2 == 0:
            odd //= 2
        out = []
        for f in (d for d in range(1, odd + 1, 2) if odd % d == 0):
            valid = sorted({f << k for k in range(N.bit_length()) if f << k <= N})
            g0 = max((g for g in valid if g * S <= N), default=None)
            if g0 is None:
                continue
            counts, rest, progress = [g0] * S, N - g0 * S, True
            while rest and progress:
                progress = False
                for i in reversed(range(S)):
                    nxt = [g for g in valid if g > counts[i] and g - counts[i] <= rest]
                    if nxt:
                        rest -= nxt[0] - counts[i]
                        counts[i] = nxt[0]
                        progress = True
                    if not rest:
                        break
            if not rest and counts not in out:
                out.append(counts)
        return out

    # ----- legality -----------------------------------------------------------------------------------------------
    def normalize(self, st):
        """The state with ``tp_comm_overlap`` consistent with its shapes (it needs a tp > 1 stage)."""
        f = st.features
        want = self.features[0].tp_comm_overlap and any(s.tp > 1 for s in st.shapes)
        return st if f.tp_comm_overlap == want else st._replace(features=f._replace(tp_comm_overlap=want))

    def _tp_overlap_dropped(self, st) -> bool:
        """Whether ``st`` differs from an allowed switch combination only by the TP overlap, off because no stage
        has tp > 1 (``normalize``): Megatron-LM turns sequence parallelism off at tp 1 and asserts
        ``--tp-comm-overlap`` only with it (``validate_args``), so a tp-1 plan of a ``--tp-comm-overlap`` run drops
        the flag; without this, every tp-1 plan was outside such a space."""
        f = st.features
        return f.tp_comm_overlap != self.features[0].tp_comm_overlap and self.normalize(st) == st and \
            f._replace(tp_comm_overlap=self.features[0].tp_comm_overlap) in self.features

    def legal(self, st) -> bool:
        return self.refusal(st) is None

    def start_of(self, st):
        """A seed's starting state (``SearchOptions.seeds``): itself, or on ``--target megatron-lm`` without its
        stack switches (CUDA graphs, fine-grained offload, the cross-entropy fusion), which no move changes: the
        final step prices the seed as given and its stack on the final plans (``dispatchers.py``)."""
        own = self.features[0].stack      # a Bridge search's: the recipe's loss fusion (bridge_features)
        if self.target == "megatron-lm" and st.features.stack != own:
            return st._replace(features=st.features._replace(stack=own))
        return st

    def refusal(self, st) -> str | None:
        """Why ``st`` is outside the space (a few words), or None when it is a legal state."""
        S, nb = len(st.shapes), len(st.bounds)
        if S == 0 or (nb - 1) % S or (nb - 1) // S not in self.v_set or (self.max_stages and S > self.max_stages):
            return "its stage or chunk count"
        if self.pps is not None and S not in self.pps:
            return f"pp {S} (--pp)"
        v = (nb - 1) // S
        if v > 1 and self.max_chunks and nb - 1 > self.max_chunks:
            return f"{nb - 1} model chunks (at most {self.max_chunks})"
        if sum(s.num_gpus for s in st.shapes) != self.num_gpus:
            return "its GPU count"
        if st.features not in self.features and not self._tp_overlap_dropped(st):
            return "its plan-level switches"
        if st.bounds[0] != 0 or st.bounds[-1] != self.num_units:
            return "its unit bounds"
        if st.features.fsdp and (pipeline_refusal(S, v) is not None or any(
                one_rank_group(st.features.fsdp, s.dp, s.cp, s.num_gpus, s.etp or s.tp, s.ep, self.experts is not None)
                for s in st.shapes)):
            return "Megatron FSDP's rules"     # what megatron-core cannot run under Megatron FSDP (search.settings.fsdp)
        if self.sync_p2p and self.target == "megatron-lm" and sync_p2p_refused(False, S, v):
            return "virtual stages on pp <= 2 without p2p overlap"     # Megatron-LM's validate_args asserts it
        if self.moe is not None and overlap_ep_refusal(self.moe, S, v, any(s.ep > 1 for s in st.shapes)):
            return "the EP overlap's structure"    # moe_plan; the recompute search avoids full
        for i, (a, b) in enumerate(zip(st.bounds[:-1], st.bounds[1:])):
            if b < a or (b == a and not ((i == 0 and self.empty_ends[0]) or (i == nb - 2 and self.empty_ends[1]))):
                return "an empty model chunk"
        bad = next((s for s in st.shapes if not self.shape_ok(s)), None)
        if bad is not None:
            return f"stage shape tp {bad.tp} cp {bad.cp} dp {bad.dp} sp {bad.sp} ep {bad.ep}"
        if not self.mbs_ok(st.shapes, st.mbs):
            return f"micro-batch {st.mbs} (per-rank candidates {list(self.batches)})"
        if v > 1 and (S < 2 or (self.gbs and (self.gbs // st.mbs) % S)):
            return "interleaving with these stages and micro-batches"
        if self.uniform_cp and len({s.cp for s in st.shapes}) > 1:
            return "different cp per stage"
        if self.target == "megatron-lm":
            if len(set(st.shapes)) > 1:
                return "different stage shapes (Megatron-LM runs one)"
            if not set(st.bounds) <= set(self.layer_starts):
                return "a cut inside a layer"
        gpn, first = self.gpus_per_node, 0
        for s in st.shapes:
            if not (first % s.tp == 0 and gpn % s.tp == 0):
                for j in range(s.cp * s.dp):
                    lo = first + j * s.tp
                    if lo // gpn != (lo + s.tp - 1) // gpn:
                        return "a TP group across nodes"
            first += s.num_gpus
        return None
