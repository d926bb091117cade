"""``CostModel``: time and memory of stages and whole plans from a source of ``UnitTable``s.

A stage (model chunks ``spans`` on tp*cp*dp GPUs starting at ``first_rank``) at pipeline micro-batch ``mbs`` runs
``b = mbs / dp`` samples per rank. Per micro-batch and chunk:

    fwd, bwd     sum of its units' times at (b, tp, cp, sp) from the table (the exposed TP / CP collectives
                 included), plus the embedding on the first model chunk and the final norm + logits + loss on the
                 last
    recompute    sum over units of the extra forward of its recompute choice
    p2p          each boundary moves the activation forward and its gradient backward. Re-sharding between stages
                 of different (tp, dp): the receiving rank needs ``X/dp_r`` of the micro-batch's activation X
                 (replicated over its TP group; SP: sharded), each sending rank supplies ``tp_r X / (tp_s dp_s)``;
                 time = max of the two over the link, on the network when the two stages' ranks span nodes (the
                 interleaved wrap from the last stage to the first: whenever the cluster has several nodes).
                 ``RunSettings.p2p_scatter_gather``: X / tp over the link, then an all-gather in the receiving TP
                 group. 1F1B: blocking send/recv (both neighbours wait: each boundary counts in both stages); in
                 the steady state megatron-core batches each send with the opposite receive on the same boundary
                 (``send_forward_recv_backward``, full-duplex links: ``RunSettings.batched_p2p``), so the steady
                 ops move half the time; the ``min(p - k - 1, M)`` warm-up forwards of the boundary's upstream
                 stage k (and as many cool-down backwards) move alone.
                 Interleaved with ``overlap_p2p_comm``: async behind the op, exposed ``max(0, p2p - op)``.
Per iteration (DP group = the stage's dp x cp ranks, strided by tp; on the network when they span nodes):
    EDP sync     MoE: the expert parameters' gradients reduce over the expert-DP group instead (edp = tp cp dp /
                 (etp ep) ranks strided by etp x ep; on the network when it spans nodes; ``_per_iteration``), their
                 optimizer states and the step shard over it with the distributed optimizer (``comm`` "edp",
                 "edp_param_gather"; the dispatch / combine all-to-all is ``comm`` "ep")
    DP sync      gradient all-reduce of the stage's per-rank parameters at the gradient width (distributed
                 optimizer: reduce-scatter of the gradients; the parameter all-gather belongs to the step), in
                 megatron-core's buckets (``--ddp-bucket-size``, else max(40M, 1M x dp); only the first chunk of the
                 first stage is bucketed), launched where megatron-core launches them: bucket hooks during the last
                 micro-batch's backward, or each chunk after its last backward when the schedule aligns them
                 (Megatron-LM's default), queued on one stream (``dp_timeline.py``): exposed = what ends after the
                 stage's last backward. On the group's links: the NVLink domains it spans and the NICs its members
                 there pool (``RunSettings.rank_order``: megatron-core's default tp-cp-ep-dp-pp or tp-cp-ep-pp-dp),
                 NCCL's ring latency per domain crossing, NVLS / SHARP where on (``comm.py``). The first and last
                 stage add the tied word-embedding gradient all-reduce between them (pp > 1).
    step         the optimizer (memory bound: Adam reads fp32 master, m, v and the gradient and writes master, m,
                 v and the weight: ``OPT_BYTES_PER_PARAM`` 28 B for bf16/fp16 (30 with fp32 gradients) /
                 (HBM x ``OPT_MEM_EFFICIENCY``), divided by dp x cp with the distributed optimizer), then the
                 distributed optimizer's parameter all-gather (the precision-aware optimizer: its states' bytes,
                 ``optimizer_state.py``). With ``overlap_param_gather`` the all-gather runs
                 before each chunk's forward of the next iteration (``dp_timeline.py``: pre-hooks bucket by bucket,
                 or the schedule's aligned ``param_sync_func``): its exposed part delays the stage's first op
                 (``StageCost.prologue_ms``).
Memory per GPU: see ``memory.py``; the step's fp32 gradient copy (``RunSettings.fp32_grad_copy``) lives after the
activations are freed: states + max(activations + transients, copy). The pipeline time: see ``pipeline.py``.
``StageCost.comm`` reports, per iteration, every communication kind's (exposed, hidden) ms.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from search.settings import precision as lowp
from search.spec.cluster import ClusterSpec
from search.settings.data_parallel import TP_PP_DP
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec
from ..layers import resolve
from search.settings.moe_plan import moe_settings
from search.costmodel.throughput import throughput
from .comm import CommModel, overlap_tax, overlapped
from .dp_timeline import COOLDOWN_MICRO_BATCHES, fifo, gather_jobs as dp_gather_jobs, grad_jobs as dp_grad_jobs
from .kernels import GENERATION, arch
from .memory import (FRAGMENTATION, MB, RESERVE_MB, grad_copy_bytes, in_flight_per_chunk,
                     state_bytes_per_param)
from .moe_cost import flex_buffer_mb
from .offload import host_link_gbps, kept_mb, offload_ms
from .stack_cost import offload_recompute_key, stack_terms
from .optimizer_state import (state_bytes as pa_state_bytes, step_bytes as pa_step_bytes,
                              step_copy_bytes as pa_step_copy_bytes)
from .optimizers import (MUON_OPT_BYTES, dp_collectives, is_muon, muon_matrices, muon_params, ns_flops,
                         shards_states, step_ms)
from .sharding import fsdp_buffer_mb, per_micro_batch, state_divisors
from .pipeline import interleaved_one_f_one_b, one_f_one_b
from .types import (ALL_FEATURES, N_RC, RC_CODE, Event, Features, PipelineCost, PlanCost, RunSettings, Shape,
                    StageCost, TableStack, UnitTable)

OPT_BYTES_PER_PARAM = {"bf16": 28.0, "fp16": 28.0, "fp32": 32.0}
OPT_MEM_EFFICIENCY = 0.8
SPAN_CACHE_SIZE = 200_000   # entries of each memo (stage terms, span sums); a memo is cleared when full
COMM_SHARE = 0.2        # a stage whose communication (or recompute) share reaches this is "communication"-bound
FWD_COMM = ("tpf", "tphf", "cpf", "cphf")   # prefix-sum names of ``UnitTable.comm_fwd_ms``'s columns
SOURCE_FEATURES = frozenset({"sequence_parallel", "context_parallel", "tp_comm_overlap"})   # priced by the source


class _Prepared(NamedTuple):
    """Prefix sums and a gather table over one UnitTable (python lists: fast scalar indexing)."""

    table: UnitTable
    cum: dict                # name -> prefix sums (fwd, bwd, params, tpc, tph, cpc, cph)
    rap: np.ndarray          # (U*N_RC, 3): row u*N_RC+c = (recompute_ms, act_mb, peak_mb) of unit u, choice c
    rap_rows: list           # the same rows as python tuples (short spans are faster in plain python)
    base3: np.ndarray        # (U,) = N_RC * u
    boundary: list[float]
    cross_first: int         # first unit that reads the encoder output (T5 decoder), else U


class _Static(NamedTuple):
    """The recompute-independent terms of one stage (memoised by ``CostModel.stage_cost``): its times, and its
    memory as named terms (``StageCost.memory_breakdown`` keys) that ``_assemble`` adds to the activations."""

    # ----- time, ms ----------------------------------------------------------------------------------------------
    fwd: float
    bwd: float
    p2p: float                # exposed, per micro-batch
    sync: float
    opt: float
    tpc: float
    ideal: float
    prologue: float
    chunk_fwd: tuple[float, ...]
    chunk_bwd: tuple[float, ...]
    chunk_p2p: tuple[tuple[float, float], ...]   # exposed (forward, backward) p2p per chunk op
    comm: dict                # ``StageCost.comm``
    chunk_comm: tuple[tuple[float, ...], ...]    # ``StageCost.chunk_comm``
    terms: tuple              # (name, ms per iteration) of the features' named time terms (``StageCost.terms``)
    in_flight: tuple[int, ...]   # micro-batches in flight per chunk at the stage's peak
    micro_batches: int
    # ----- memory, MB: named terms -------------------------------------------------------------------------------
    states: tuple             # (params | grads | optimizer, MB): the model states
    buffers: tuple            # (p2p_buffers | fsdp_buffers | dispatch_buffers, MB): held while the stage runs
    stack_mb: tuple           # (name, MB) of the stack features' memory terms (``stack_cost.py``)
    # ... and the terms that combine with the activations (``_assemble``)
    act_extra: float          # embedding / head / encoder-output MB, already times their chunks' in-flight counts
    head_peak: float          # the loss's transient peak
    copy_mb: float            # the optimizer step's gradient copy (lives after the activations are freed)
    off_mb: float             # activation MB the offload moves to the host (recompute none), per micro-batch
    off_kept: float           # of the offloaded activations, the MB of the layer in flight (``offload.kept_mb``)


def table_stack(features: Features | None) -> TableStack | None:
    """The part of the plan's stack switches a unit table depends on (CUDA-graph scopes, cross-entropy fusion), or
    None when neither is set (the table of a plan without them)."""
    st = features.stack if features is not None else None
    if st is None or (not st.graphs and not st.ce_fusion):
        return None
    return TableStack(st.graphs, st.ce_fusion)


def _chunk_comm(c: dict, a: int, e: int) -> tuple[float, ...]:
    """``StageCost.chunk_comm`` of the units ``[a, e)``: the exposed TP total holds the ring's (``UnitCost``)."""
    tot = {n: c[n][e] - c[n][a] for n in ("tpc", "tph", "cpc", "cph", *FWD_COMM)}
    tp, cp = tot["tpc"] - tot["cpc"], tot["cpc"]
    return (tot["tpf"], tp - tot["tpf"], tot["cpf"], cp - tot["cpf"], tot["tphf"], tot["tph"] - tot["tphf"],
            tot["cphf"], tot["cph"] - tot["cphf"])


def _prepare(t: UnitTable, cross_first: int) -> _Prepared:
    def cum(a):
        return [0.0] + np.cumsum(a).tolist()
    zero = np.zeros_like(t.fwd_ms)
    arrays = {"fwd": t.fwd_ms, "bwd": t.bwd_ms, "params": t.weight_params,
              "eparams": t.expert_params if t.expert_params is not None else zero,
              "epc": t.ep_comm_ms if t.ep_comm_ms is not None else zero,
              "eph": t.ep_hidden_ms if t.ep_hidden_ms is not None else zero,
              "tpc": t.tp_comm_ms if t.tp_comm_ms is not None else zero,
              "tph": t.tp_hidden_ms if t.tp_hidden_ms is not None else zero,
              "cpc": t.cp_comm_ms if t.cp_comm_ms is not None else zero,
              "cph": t.cp_hidden_ms if t.cp_hidden_ms is not None else zero}
    if t.comm_fwd_ms is not None:       # the forward's shares of tp / tp hidden / cp / cp hidden (timelines)
        arrays.update(zip(FWD_COMM, t.comm_fwd_ms.T))
    rap = np.stack([t.recompute_ms, t.act_mb, t.peak_mb], axis=-1).reshape(-1, 3)
    return _Prepared(t, {k: cum(v) for k, v in arrays.items()}, rap, [tuple(r) for r in rap.tolist()],
                     np.arange(len(t.fwd_ms), dtype=np.int64) * N_RC, t.boundary_mb.tolist(), cross_first)


def _span_sums(p: _Prepared, start: int, end: int, rc: np.ndarray) -> tuple[float, float, float]:
    """(recompute ms, activation MB, peak MB) of units [start, end) under recompute codes ``rc``."""
    if len(rc) != end - start:
        raise ValueError(f"recompute has {len(rc)} codes for the {end - start} units [{start}, {end})")
    if end - start > 32:
        g = p.rap[p.base3[start:end] + rc]
        sums = g.sum(axis=0)
        return float(sums[0]), float(sums[1]), float(g[:, 2].max())
    rows = p.rap_rows
    rec = act = peak = 0.0
    for i, c in enumerate(rc.tolist(), start):
        r = rows[N_RC * i + c]
        rec += r[0]
        act += r[1]
        if r[2] > peak:
            peak = r[2]
    return rec, act, peak


class CostModel:
    """Evaluates stages and plans of one model on one cluster with one training setup.

    ``settings``: how the framework runs the plan (``types.RunSettings``; default: our runtime on megatron-core).
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, source, comm: CommModel,
                 kind: str = "analytic", settings: RunSettings | None = None):
        self.model, self.cluster, self.training = model, cluster, training
        self.source, self.comm, self.kind = source, comm, kind
        self.settings = settings or RunSettings()
        self.memory_limit_mb = cluster.memory_mb
        self._prep: dict[tuple, _Prepared] = {}
        self._span_cache: dict[tuple, tuple[float, float, float]] = {}   # (b, tp, start, end, rc bytes) -> sums
        self._static_cache: dict[tuple, _Static] = {}                     # stage_cost args but recompute -> terms
        self._result_cache: dict[tuple, StageCost] = {}                   # all args -> result (shared: do not mutate)
        fp32g = self.settings.grad_reduce_in_fp32
        self._w, self._g, self._opt = state_bytes_per_param(training.dtype, False, 1, fp32g)
        self._copy = grad_copy_bytes(training.dtype, fp32g) if self.settings.fp32_grad_copy else 0.0
        pa = self.settings.precision_aware     # megatron-core's precision-aware optimizer (optimizer_state.py)
        if pa is not None:
            self._opt = pa_state_bytes(pa, training.precision)
            self._copy = pa_step_copy_bytes(pa, training.precision, fp32g)
        # low precision (search/settings/precision.py): quantized weight caches per linear parameter, quantized all-gather
        non_tn = GENERATION.get(cluster.gpu.name) == "blackwell"     # no transposed FP8 copy (precision.copies)
        self._w_lp = lowp.weight_bytes_per_param(training.precision, training.fp8_param_gather, non_tn)
        self._ag_lp = lowp.gather_bytes_per_param(training.precision, training.fp8_param_gather, self._w) - self._w
        self._w_lp_fsdp = lowp.fsdp_weight_bytes_per_param(training.precision, training.fp8_param_gather, self._w,
                                                           non_tn)
        # a linear a per-module override sets: its recipe's copies, its weight bf16 (the override's fp8_param False)
        self._w_over = {fsdp: {r: lowp.fsdp_weight_bytes_per_param(r or "bf16", False, self._w, non_tn) if fsdp
                               else lowp.weight_bytes_per_param(r or "bf16", False, non_tn)
                               for r in (None, *lowp.LOW_PRECISIONS)} for fsdp in (False, True)}
        self._lp_mask = np.array([lowp.unit_quantized(training.precision, u.layer, model.num_layers,
                                                      training.bf16_layers_start, training.bf16_layers_end,
                                                      mtp=u.kind == "mtp", hybrid=bool(model.hybrid_layer_pattern))
                                  for u in model.units], dtype=bool)
        opt_bytes = OPT_BYTES_PER_PARAM[training.dtype] + (2.0 if fp32g and training.dtype != "fp32" else 0)
        if pa is not None:
            opt_bytes = pa_step_bytes(pa, training.precision, opt_bytes)
        self._opt_ms_per_param = getattr(source, "optimizer_ms_per_param", None) or (  # measured, else analytic
            opt_bytes / (cluster.gpu.hbm_gbps * 1e6 * OPT_MEM_EFFICIENCY))
        self._optimizer = training.optimizer
        if is_muon(self._optimizer) and self.kind != "analytic":
            raise AcesoError(f"the {self.kind} cost model prices Adam only; use the analytic model for "
                             f"--optimizer {self._optimizer}")
        # Muon's Newton-Schulz GEMMs: bf16 at the GPU's sustained GEMM ceiling (kernels.ARCH)
        a = arch(cluster.gpu.name)
        self._ns_rate = cluster.gpu.peak_tflops("bf16" if cluster.gpu.peak_tflops_bf16 else "fp16") * 1e9 * \
            a.gemm_max * a.sustained
        self._muon_memo: dict = {}
        cross = [i for i, u in enumerate(model.units) if u.kind == "cross_attention"]
        self._cross_first = cross[0] if cross else model.num_units
        self._default_features = Features(distributed_optimizer=bool(training.distributed_optimizer))
        self.warnings: list[str] = []
        # what this cost model prices beyond a v1 plan: the source's SP / CP / TP overlap, the rest here
        self.features = frozenset(ALL_FEATURES - SOURCE_FEATURES) | frozenset(getattr(source, "features", ()))
        self._tax = overlap_tax(cluster.gpu.name)     # compute slow-down per ms of NCCL communication it hides
        self._moe_model = bool(model.moe or model.mla or model.mtp_num_layers)

    # ----- tables -------------------------------------------------------------------------------------------------
    def _prepared(self, batch: float, tp: int, cp: int = 1, sp: bool = False, ov: bool = False, ep: int = 1,
                  etp: int = 0, moe=None, stack=None) -> _Prepared:
        key = (batch, tp, cp, sp, ov, ep, etp, moe, stack)
        p = self._prep.get(key)
        if p is None:
            if stack is not None and self.kind != "analytic":
                raise AcesoError(f"the {self.kind} cost model cannot price the plan's stack switches (CUDA graphs, "
                                 "the cross-entropy fusion); use the analytic model")
            if batch <= 0 or tp < 1 or cp < 1:
                raise AcesoError(f"per-rank batch ({batch}), tp ({tp}) and cp ({cp}) must be positive")
            for on, name, what in ((cp > 1, "context_parallel", "context parallelism"),
                                   (sp, "sequence_parallel", "sequence parallelism"),
                                   (ov, "tp_comm_overlap", "TP communication overlap")):
                if on and name not in self.features:
                    raise AcesoError(f"the {self.kind} cost model cannot price {what}; use the analytic model")
            if stack is not None:
                table = self.source.unit_table(batch, tp, cp=cp, sp=sp, tp_overlap=ov, ep=ep, etp=etp, moe=moe,
                                               stack=stack)
            elif self._moe_model:     # the analytic source only (make_cost_model refuses the others)
                table = self.source.unit_table(batch, tp, cp=cp, sp=sp, tp_overlap=ov, ep=ep, etp=etp, moe=moe)
            elif ov:
                table = self.source.unit_table(batch, tp, cp=cp, sp=sp, tp_overlap=True)
            elif cp > 1 or sp:
                table = self.source.unit_table(batch, tp, cp=cp, sp=sp)
            else:
                table = self.source.unit_table(batch, tp)
            p = self._prep[key] = _prepare(table, self._cross_first)
        return p

    def unit_table(self, batch: float, tp: int, cp: int = 1, sp: bool = False, tp_overlap: bool = False,
                   ep: int = 1, etp: int = 0, moe=None, features: Features | None = None) -> UnitTable:
        """The per-unit table ``stage_cost`` prices a stage of this shape with (``ep``/``etp``/``moe``: its expert
        shape and the plan's MoE settings, ``features`` the plan's switches, as ``stage_cost`` takes them)."""
        return self._prepared(batch, tp, cp, sp, tp_overlap and sp and tp > 1, ep, etp, moe,
                              table_stack(features)).table

    # ----- one stage ----------------------------------------------------------------------------------------------
    def stage_cost(self, stage_index: int, num_stages: int, first_rank: int, start_unit: int, end_unit: int,
                   tp: int, dp: int, recompute: np.ndarray, micro_batch_size: int,
                   prev: tuple | None = None, next: tuple | None = None,
                   num_micro_batches: int | None = None, *, cp: int = 1, sp: bool = False,
                   spans: tuple[tuple[int, int], ...] | None = None, features: Features | None = None,
                   ep: int = 1, etp: int = 0, moe=None) -> StageCost:
        """Cost of one stage (pipeline rank) of ``tp * cp * dp`` GPUs.

        ``prev``/``next``: the neighbours' shapes, ``(tp, dp)`` or ``(tp, dp, cp, sp)`` (default: this stage's);
        with interleaving these are the ring neighbours (stage ``i - 1`` and ``i + 1`` modulo ``num_stages``).
        ``spans``: the stage's model chunks ``((start, end), ...)`` for an interleaved plan (chunk ``j`` is model
        chunk ``j * num_stages + stage_index``; ``start_unit``/``end_unit`` are then ignored) and ``recompute`` is
        the chunks' codes one after the other. ``features``: the plan-level switches (default: the training spec's
        distributed optimizer, everything else off). ``ep``/``etp``: the stage's expert shape (MoE models; etp 0 =
        tp), priced by ``moe_cost.py`` under ``moe`` (the plan's ``MoEPlanSettings``; None = the defaults).

        Memoised (pure functions of their keys): everything that does not depend on the recompute choices, the
        (recompute ms, activation MB, peak MB) sums of a span under one recompute vector, and the result itself
        (a shared object: do not mutate it).
        """
        if spans is None:
            spans = ((start_unit, end_unit),)
        if features is None:
            features = self._default_features
        me = Shape(tp, dp, cp, sp, ep, etp)
        prev, next = Shape.of(prev), Shape.of(next)
        if type(recompute) is not np.ndarray:
            recompute = np.asarray(recompute, dtype=np.int8)
        sk = features.stack     # the fine-grained offload moves less where the recompute checkpoints (stack_cost.py)
        rc_off = offload_recompute_key(self, sk, spans, recompute) if sk is not None and sk.offload_modules else None
        key = (stage_index, num_stages, first_rank, spans, me, micro_batch_size, prev, next, num_micro_batches,
               features, moe, rc_off)
        st = self._static_cache.get(key)
        if st is None:
            st = self._static(*key)
            if len(self._static_cache) > SPAN_CACHE_SIZE:
                self._static_cache.clear()
            self._static_cache[key] = st
        rkey = (key, recompute.tobytes())
        hit = self._result_cache.get(rkey)
        if hit is not None:
            return hit
        b = micro_batch_size / dp
        ov = features.tp_comm_overlap and sp and tp > 1
        rec = act = rpeak = 0.0
        chunk_rec, pos = [], 0
        for (a, e), n_j in zip(spans, st.in_flight):
            rc = recompute[pos:pos + e - a] if len(spans) > 1 else recompute
            pos += e - a
            tst = table_stack(features)
            skey = (b, tp, cp, sp, ov, ep, etp, moe, tst, a, e, rc.tobytes())
            hit = self._span_cache.get(skey)
            if hit is None:
                hit = _span_sums(self._prepared(b, tp, cp, sp, ov, ep, etp, moe, tst), a, e, rc)
                if len(self._span_cache) > SPAN_CACHE_SIZE:
                    self._span_cache.clear()
                self._span_cache[skey] = hit
            rec += hit[0]
            act += hit[1] * n_j
            if hit[2] > rpeak:
                rpeak = hit[2]
            chunk_rec.append(hit[0])
        if pos != len(recompute) and len(spans) > 1:
            raise ValueError(f"recompute has {len(recompute)} codes for the {pos} units of the stage's chunks")
        out = self._assemble(st, rec, act, rpeak, chunk_rec)
        if features.offload_layers and recompute.any():     # megatron-core refuses it (search/settings/fsdp.py): never fits
            out.fits = False
        if len(self._result_cache) > SPAN_CACHE_SIZE:
            self._result_cache.clear()
        self._result_cache[rkey] = out
        return out

    def _assemble(self, st: _Static, rec: float, act: float, rpeak: float, chunk_rec: list[float]) -> StageCost:
        if st.head_peak > rpeak:
            rpeak = st.head_peak
        acts = (act + st.act_extra - st.off_mb - st.off_kept) * (1 + FRAGMENTATION)
        # the offloaded layer still in flight overlaps the last layers' forward, not the loss (``offload.py``)
        in_flight = max(0.0, st.off_kept * (1 + FRAGMENTATION) - rpeak)
        live = acts + in_flight + rpeak
        for _, v in st.buffers:
            live += v
        live += sum(v for _, v in st.stack_mb)
        over = st.copy_mb - live if st.copy_mb > live else 0.0     # the step's gradient copy beyond the activations
        total = 0.0
        for _, v in st.states:
            total += v
        total = total + live + over + RESERVE_MB
        (p2p_name, buf), *buffers = st.buffers
        mem = {**dict(st.states), "activations": acts, "recompute_peak": rpeak, p2p_name: buf, "reserve": RESERVE_MB}
        if st.copy_mb:
            mem["grad_copy"] = over
        for name, v in buffers:       # a buffer a stage does not hold is no term (offload's in flight: after FSDP's)
            if v:
                mem[name] = v
            if name == "fsdp_buffers" and st.off_kept:
                mem["offload_in_flight"] = in_flight
        for name, v in st.stack_mb:
            mem[name] = mem.get(name, 0.0) + v
        parts = tuple((f, pf, r, bw, pb) for f, bw, r, (pf, pb) in zip(st.chunk_fwd, st.chunk_bwd, chunk_rec,
                                                                       st.chunk_p2p))
        cf = cb = ()
        if len(chunk_rec) > 1:
            cf = tuple(f + pf for f, pf, _, _, _ in parts)
            cb = tuple(bw + r + pb for _, _, r, bw, pb in parts)
        return StageCost(fwd_ms=st.fwd, bwd_ms=st.bwd, recompute_ms=rec, p2p_ms=st.p2p, dp_sync_ms=st.sync,
                         optimizer_ms=st.opt, memory_mb=total, memory_breakdown=mem,
                         fits=total <= self.memory_limit_mb, tp_comm_ms=st.tpc, ideal_ms=st.ideal,
                         ep_comm_ms=st.comm.get("ep", (0.0, 0.0))[0] / max(st.micro_batches, 1),
                         chunk_fwd_ms=cf, chunk_bwd_ms=cb, comm=st.comm, prologue_ms=st.prologue, chunk_parts=parts,
                         chunk_comm=st.chunk_comm, terms=dict(st.terms))

    def _static(self, stage_index, num_stages, first_rank, spans, me, mbs, prev, next, m, features,
                moe=None, rc_off=None) -> _Static:
        """The recompute-independent part of a stage: times per chunk, sync, and the memory terms (``rc_off``: the
        recompute codes where they change what the fine-grained offload moves, ``stack_cost``)."""
        tp, dp, cp, sp, ep, etp = me
        for on, name in ((len(spans) > 1, "interleaved"), (features.overlap_grad_reduce, "overlap_grad_reduce"),
                         (features.overlap_param_gather, "overlap_param_gather"),
                         (features.distributed_optimizer, "distributed_optimizer"),
                         (bool(features.fsdp), "megatron_fsdp"), (features.offload_layers > 0, "activation_offload")):
            if on and name not in self.features:
                raise AcesoError(f"the {self.kind} cost model cannot price {name}; use the analytic model")
        if features.overlap_param_gather and not (features.distributed_optimizer or features.fsdp):
            raise AcesoError("overlap_param_gather needs distributed_optimizer or megatron_fsdp; set it or turn the "
                             "overlap off")
        ov = features.tp_comm_overlap and sp and tp > 1
        p = self._prepared(mbs / dp, tp, cp, sp, ov, ep, etp, moe, table_stack(features))
        t, c = p.table, p.cum
        S, v = num_stages, len(spans)
        n = me.num_gpus
        M = m or self.training.global_batch_size // mbs
        prev, next = prev or me, next or me
        chunk_fwd, chunk_bwd, chunk_p2p, chunk_comm = [], [], [], []
        split = FWD_COMM[0] in c
        params = act = head_peak = buf = ideal = lp_params = 0.0
        over = dict.fromkeys((r for r, _ in t.override_params), 0.0)   # recipe -> parameters an override set
        sums = dict.fromkeys(("tpc", "tph", "cpc", "cph", "epc", "eph", "eparams"), 0.0)
        p2p_total = p2p_exposed = 0.0
        in_fl = in_flight_per_chunk(stage_index, S, v, M)
        chunk_params, chunk_lp, chunk_ex = [], [], []
        for j, (a, e) in enumerate(spans):
            act0, params0 = act, params
            k = j * S + stage_index                 # the model chunk
            first, last = k == 0, k == S * v - 1
            fwd = c["fwd"][e] - c["fwd"][a]
            bwd = c["bwd"][e] - c["bwd"][a]
            params += c["params"][e] - c["params"][a]
            lp0 = lp_params
            lp_params += float(t.weight_params[a:e][self._lp_mask[a:e]].sum()) if self._w_lp or self._ag_lp else 0.0
            for r, n_r in t.override_params:    # at their own recipe, not the plan's
                k_r = float(n_r[a:e].sum())
                over[r] += k_r
                lp_params -= k_r if self._w_lp or self._ag_lp else 0.0
            chunk_lp.append(lp_params - lp0)
            for name in sums:
                sums[name] += c[name][e] - c[name][a]
            chunk_ex.append(c["eparams"][e] - c["eparams"][a])
            if split:
                chunk_comm.append(_chunk_comm(c, a, e))
            if first:
                fwd += t.embed_fwd_ms
                bwd += t.embed_bwd_ms
                params += t.embed_params
                act += t.embed_act_mb
            if last:
                fwd += t.head_fwd_ms
                bwd += t.head_bwd_ms
                params += t.head_params
                act += t.head_act_mb
                head_peak = t.head_peak_mb
                if S > 1:
                    params += t.word_embed_params
            chunk_params.append(params - params0)
            if e > p.cross_first:
                act += t.encoder_output_mb
            act = act0 + (act - act0) * in_fl[j]
            p2p = unpaired = 0.0      # unpaired: 1F1B's warm-up/cool-down share of each boundary's transfers
            if not first:   # receive from the previous chunk (stage i - 1, or the last stage when wrapping)
                ms, mb = self._boundary(p.boundary[a] * dp, prev, me, first_rank - prev.num_gpus,
                                        first_rank + n - 1, stage_index == 0, ((stage_index - 1) % S, stage_index, S))
                p2p += 2 * ms
                unpaired += 2 * ms * min(S - stage_index, M) / M
                buf += mb
            if not last:
                ms, mb = self._boundary(p.boundary[e] * dp, me, next, first_rank,
                                        first_rank + n + next.num_gpus - 1, stage_index == S - 1,
                                        (stage_index, (stage_index + 1) % S, S))
                p2p += 2 * ms
                unpaired += 2 * ms * min(S - stage_index - 1, M) / M
                buf += mb
            if v > 1 and self.settings.overlap_p2p_comm:   # async: what the op covers is hidden (and taxed)
                h = p2p / 2
                exp = (max(0.0, h - fwd) + self._tax * min(h, fwd), max(0.0, h - bwd) + self._tax * min(h, bwd))
            elif v == 1 and self.settings.batched_p2p:     # steady-state 1F1B: each send paired with a receive
                exp = ((p2p + unpaired) / 4,) * 2
            else:
                exp = (p2p / 2, p2p / 2)
            p2p_total += p2p
            p2p_exposed += exp[0] + exp[1]      # (the tax counts as exposed: hidden = total - exposed, at least 0)
            chunk_fwd.append(fwd)
            chunk_bwd.append(bwd)
            chunk_p2p.append(exp)
            if self.kind == "analytic":
                ideal += self._ideal(first, last, a, e, mbs, n)
            else:
                ideal += fwd + bwd
        if self.kind != "analytic":
            ideal -= sums["tpc"]
        fsdp_mb, fsdp_comm = self._fsdp_micro_batches(p, spans, chunk_params, chunk_lp, chunk_fwd, chunk_bwd,
                                                      first_rank, n, dp * cp, features, M, me)
        off_mb, off_kept, off_comm = self._offload(p, stage_index, chunk_fwd, chunk_bwd, features, M)
        experts = sums["eparams"]
        mu = self._muon_split(spans, me) if is_muon(self._optimizer) else None
        sync, opt, prologue, dp_comm = self._per_iteration(stage_index, S, first_rank, n, dp * cp, params,
                                                           chunk_fwd, chunk_bwd, t, features, chunk_params,
                                                           chunk_lp, chunk_ex, me, M, mu)
        comm = {**fsdp_comm, **off_comm, "tp": (M * (sums["tpc"] - sums["cpc"]), M * sums["tph"]),
                "cp": (M * sums["cpc"], M * sums["cph"]), "ep": (M * sums["epc"], M * sums["eph"]),
                "p2p": (M * p2p_exposed, M * max(0.0, p2p_total - p2p_exposed)), **dp_comm}
        dpc, edp = dp * cp, me.expert_dp
        shard = shards_states(self._optimizer, features.distributed_optimizer)
        dw, dg, do = state_divisors(features.fsdp, dpc, shard)
        # the experts' states shard over the expert-DP group where the dense ones shard over dp x cp
        ew, eg, eo = state_divisors(features.fsdp, edp, shard)
        dense = params - experts
        lp_w = lp_params * (self._w_lp_fsdp if features.fsdp else self._w_lp) + sum(
            k * self._w_over[bool(features.fsdp)][r] for r, k in over.items())
        # Muon's parameters keep MUON_OPT_BYTES instead of Adam's (optimizers.py): the difference on their count
        o_dense = dense * self._opt - (mu[0] * (self._opt - MUON_OPT_BYTES) if mu else 0.0)
        o_exp = experts * self._opt - (mu[1] * (self._opt - MUON_OPT_BYTES) if mu else 0.0)
        states = (("params", (dense * self._w / dw + experts * self._w / ew + lp_w * (dense / dw + experts / ew) /
                              max(params, 1.0)) / MB),
                  ("grads", (dense * self._g / dg + experts * self._g / eg) / MB),
                  ("optimizer", (o_dense / do + o_exp / eo) / MB))
        buffers = (("p2p_buffers", buf), ("fsdp_buffers", fsdp_mb),
                   ("dispatch_buffers", self._dispatch_mb(spans, me, moe)))
        stack_mb, terms = stack_terms(self, p, spans, in_fl, M, features, opt, me, moe, chunk_fwd, chunk_bwd,
                                      rc_off)
        return _Static(
            fwd=sum(chunk_fwd), bwd=sum(chunk_bwd), p2p=p2p_exposed, sync=sync, opt=opt, tpc=sums["tpc"], ideal=ideal,
            prologue=prologue, chunk_fwd=tuple(chunk_fwd), chunk_bwd=tuple(chunk_bwd), chunk_p2p=tuple(chunk_p2p),
            comm={k: v for k, v in comm.items() if v[0] > 0 or v[1] > 0}, chunk_comm=tuple(chunk_comm), terms=terms,
            in_flight=in_fl, micro_batches=M, states=states, buffers=buffers, stack_mb=stack_mb, act_extra=act,
            head_peak=head_peak, copy_mb=(dense * self._copy / do + experts * self._copy / eo) / MB, off_mb=off_mb,
            off_kept=off_kept)

    def _muon_split(self, spans, me: Shape) -> tuple[float, float, float, float]:
        """(dense Muon parameters, expert Muon parameters, their Newton-Schulz FLOPs) of a stage's units per rank
        (``optimizers.muon_matrices``: the 2-D weights; the embedding and output layer stay Adam)."""
        key = (spans, me.tp, me.ep, me.etp)
        hit = self._muon_memo.get(key)
        if hit is not None:
            return hit
        units = self.model.units
        per_kind = {}
        dense = expert = ns_d = ns_e = 0.0
        for a, e in spans:
            for i in range(a, e):
                kind = units[i].kind
                if kind not in per_kind:
                    mats = muon_matrices(self.model, kind, me.tp, me.ep, me.etp or me.tp)
                    experts = resolve(self.model, kind).routed_experts    # their shards second and third
                    ex = mats[1:3] if experts else []
                    rest = [mats[0]] + mats[3:] if experts else mats
                    per_kind[kind] = (muon_params(rest), muon_params(ex),
                                      sum(k * ns_flops(r, c) for r, c, k in rest),
                                      sum(k * ns_flops(r, c) for r, c, k in ex))
                d, x, nd, nx = per_kind[kind]
                dense, expert, ns_d, ns_e = dense + d, expert + x, ns_d + nd, ns_e + nx
        out = (dense, expert, ns_d, ns_e)
        self._muon_memo[key] = out
        return out

    def _dispatch_mb(self, spans, me: Shape, moe) -> float:
        """The flex dispatcher's buffer on a stage that holds an MoE layer (``moe_cost.flex_buffer_mb``)."""
        units = self.model.units
        if self.model.moe is None or not any(units[i].kind in ("moe", "mtp") for a, e in spans for i in range(a, e)):
            return 0.0
        return flex_buffer_mb(self.model, moe, me.ep, me.etp or me.tp, self.model.dtype_bytes)

    def _step(self, adam: float, muon: float, ns: float, shard: int) -> float:
        """The optimizer step's ms on one rank (``optimizers.step_ms``): Adam's pass over ``adam`` parameters,
        Muon's over ``muon`` with ``ns`` Newton-Schulz FLOPs, / ``shard``."""
        if not muon:
            return adam * self._opt_ms_per_param / shard
        return step_ms(adam, muon, ns, self._opt_ms_per_param, self.cluster.gpu.hbm_gbps * 1e6 * OPT_MEM_EFFICIENCY,
                       self._ns_rate, shard)

    def _per_iteration(self, stage_index: int, S: int, first_rank: int, n: int, dpc: int, params: float,
                       chunk_fwd: list[float], chunk_bwd: list[float], t: UnitTable, features: Features,
                       chunk_params: list[float], chunk_lp: list[float], chunk_experts: list[float], me: Shape,
                       M: int, muon: tuple | None = None):
        """(exposed DP sync, step, prologue, comm entries) of a stage: gradient reduction, tied-embedding sync,
        optimizer step and the distributed optimizer's parameter all-gather, placed on the stage's timeline as
        megatron-core places them (``dp_timeline.py``: buckets, per-chunk launches, what stays exposed).
        MoE: the expert parameters (per rank, per chunk ``chunk_experts``) reduce over the expert-DP group instead
        (``edp`` ranks strided by etp x ep inside the stage, megatron-core's ``expert_data_parallel_group``); both
        groups queue on one stream (the same NICs). ``muon``: the stage's Muon parameters and Newton-Schulz FLOPs,
        (dense, expert, dense FLOPs, expert FLOPs) (``optimizers.py``)."""
        cfg = self.settings
        dist = features.distributed_optimizer
        reduce_once = gather_after = True     # DDP / the distributed optimizer; FSDP: ``sharding.py``
        if features.fsdp:
            dist = features.fsdp != "no_shard"
            reduce_once = features.fsdp in ("no_shard", "optim")
            gather_after = features.fsdp in ("optim", "optim_grads")
        gather, shard = dist, dist
        if is_muon(self._optimizer):          # Muon: all-reduced gradients; dist_muon gathers the parameters
            dist, gather = dp_collectives(self._optimizer, dist)
            shard = shards_states(self._optimizer, dist)
        experts = sum(chunk_experts)
        dense = params - experts
        mu = muon or (0.0, 0.0, 0.0, 0.0)
        opt = self._step(dense - mu[0], mu[0], mu[2], dpc if shard else 1)
        sync = prologue = 0.0
        out = {}
        dense_chunks = [p - e for p, e in zip(chunk_params, chunk_experts)]
        groups = [("dp", "param_gather", dense_chunks, dpc, self._group_link(self._dp_ranks(stage_index, S,
                                                                                           first_rank, me)))]
        if experts:
            edp, stride = me.expert_dp, me.expert_tp * me.ep
            opt += self._step(experts - mu[1], mu[1], mu[3], edp if shard else 1)
            groups.append(("edp", "edp_param_gather", list(chunk_experts), edp,
                           self._group_link([first_rank + i * stride for i in range(edp)])))
        # megatron-core: --ddp-bucket-size, else max(40M, 1M x dp) (dp without CP) with overlap_grad_reduce;
        # --ddp-num-buckets N: the rank's parameters (all chunks, experts included) // N (Megatron-LM
        # core_v0.19.0 training.py:1559-1560, core_v0.16.1 training.py:1303)
        bucket = (int(params) // cfg.ddp_num_buckets if cfg.ddp_num_buckets else
                  cfg.ddp_bucket_size or max(cfg.bucket_params, 1_000_000 * me.dp))
        depth = max(1, min(S, M, COOLDOWN_MICRO_BATCHES))
        red_fn = self.comm.reduce_scatter if dist else self.comm.all_reduce
        grad_jobs, gather_jobs = [], []
        for name, pg, nparams, size, (inter, k, domains) in groups:
            if size <= 1 or sum(nparams) <= 0:
                continue

            def red(b, size=size, inter=inter, k=k, domains=domains):
                return red_fn(b, size, inter, k, domains, in_network=True)

            def gat(b, size=size, inter=inter, k=k, domains=domains):
                return self.comm.all_gather(b, size, inter, k, domains, in_network=True)
            # the quantized all-gather (``precision.py``) of the group's share of the low-precision weights
            w = [q * self._w + (lp * q / p * self._ag_lp if p else 0.0)
                 for q, lp, p in zip(nparams, chunk_lp, chunk_params)]
            single = red(sum(nparams) * self._g)
            if not reduce_once:
                out[name] = (0.0, 0.0)                         # reduce-scattered every micro-batch instead
            elif features.overlap_grad_reduce:
                n0 = len(grad_jobs)
                grad_jobs += dp_grad_jobs(nparams, [q * self._g for q in nparams], chunk_bwd, red, stage_index,
                                          depth, bucket, cfg.align_grad_reduce)
                out[name] = (sum(j[1] for j in grad_jobs[n0:]), 0.0)   # its total: split below
            else:
                sync += single
                out[name] = (single, 0.0)
            if gather and gather_after:
                ag = gat(sum(w))
                if features.overlap_param_gather:
                    n0 = len(gather_jobs)
                    gather_jobs += dp_gather_jobs(nparams, w, chunk_fwd, gat, stage_index, depth, bucket,
                                                  cfg.align_param_gather)
                    out[pg] = (sum(j[1] for j in gather_jobs[n0:]), 0.0)
                else:
                    opt += ag
                    out[pg] = (ag, 0.0)
        if grad_jobs:          # the backward runs slower while it hides them (``overlap_tax``)
            exp, hid = fifo(grad_jobs)
            total = exp + hid
            exp = min(total, exp + self._tax * hid)
            sync += exp
            self._split(out, ("dp", "edp"), exp, total)
        if gather_jobs:
            exp, hid = fifo(gather_jobs)
            total = exp + hid
            exp = min(total, exp + self._tax * hid)
            prologue += exp
            self._split(out, ("param_gather", "edp_param_gather"), exp, total)
        if stage_index in (0, S - 1) and S > 1 and t.word_embed_params:
            emb = self.comm.all_reduce(t.word_embed_params * self._g, 2, self.cluster.num_gpus > self.cluster.nvlink_size)
            sync += emb
            out["embedding_grads"] = (emb, 0.0)
        return sync, opt, prologue, out

    @staticmethod
    def _split(out: dict, names: tuple[str, ...], exposed: float, total: float) -> None:
        """Share ``exposed`` of ``total`` ms among the entries ``names`` of ``out`` (each holding its total)."""
        for name in names:
            if name in out and total > 0:
                mine = out[name][0]
                out[name] = (exposed * mine / total, mine - exposed * mine / total)

    def _dp_ranks(self, stage: int, S: int, first_rank: int, me: Shape) -> list[int]:
        """The DP x CP group of the stage's first TP rank, in the plan's rank order (``RunSettings.rank_order``):
        tp-cp-ep-dp-pp (megatron-core's default): ``first_rank + i tp``; tp-cp-ep-pp-dp
        (``--use-tp-pp-dp-mapping``, uniform stages): ``stage tp cp + c tp + d tp cp pp``."""
        if self.settings.rank_order == TP_PP_DP:
            return [stage * me.tp * me.cp + c * me.tp + d * me.tp * me.cp * S for d in range(me.dp)
                    for c in range(me.cp)]
        return [first_rank + i * me.tp for i in range(me.dp * me.cp)]

    def _group_link(self, ranks: list[int]) -> tuple[bool, int, int]:
        """(on the network, NICs per node, NVLink domains) of a group: the DP x CP group and MoE's expert-DP group
        (stride etp x ep). One NIC per group without ``RunSettings.multi_nic``."""
        if len(ranks) <= 1:
            return False, 1, 1
        domains, members = self.comm.placement(ranks)
        inter = domains > 1
        return inter, members if inter and self.settings.multi_nic else 1, domains

    def _fsdp_micro_batches(self, p: _Prepared, spans, chunk_params: list, chunk_lp: list, chunk_fwd: list,
                            chunk_bwd: list, first_rank: int, n: int, dpc: int, features: Features,
                            M: int, me: Shape | None = None) -> tuple[float, dict]:
        """Megatron FSDP's per-micro-batch collectives (``sharding.py``): the exposed parts added to each chunk's
        forward / backward in place; returns (whole-layer buffer MB, comm entries per iteration). ``chunk_lp``: the
        chunks' linear parameters at the plan's recipe (not those a per-module override sets: bf16 weights), gathered
        (and buffered) quantized with param gather. MoE: the
        experts' parameters are sharded over the expert-DP group (megatron-core's ``expt_dp`` parameter groups:
        ``edp`` ranks strided by etp x ep), so they are gathered and reduce-scattered there, behind what the dense
        collectives leave of the micro-batch (one DP stream)."""
        if not features.fsdp or dpc <= 1:
            return 0.0, {}
        groups = [(dpc, *self._group_link([first_rank + i * (n // dpc) for i in range(dpc)]))]
        edp = me.expert_dp if me is not None else 1
        if edp > 1:
            groups.append((edp, *self._group_link([first_rank + i * me.expert_tp * me.ep for i in range(edp)])))
        starts, c = self.model.layer_starts, p.cum["params"]
        ce = p.cum["eparams"]
        gath = red = (0.0, 0.0)
        biggest = layers = 0.0
        for j, (a, e) in enumerate(spans):
            bounds = [u for u in starts if a <= u <= e]
            layer = [c[y] - c[x] for x, y in zip(bounds[:-1], bounds[1:])]
            biggest, layers = max([biggest, *layer]), layers + sum(layer)
            prm = chunk_params[j]      # its layers' and, on the end chunks, the embedding's / output layer's
            ex = float(ce[e] - ce[a])
            fwd, bwd = chunk_fwd[j], chunk_bwd[j]
            for (size, inter, k, nd), part in zip(groups, (prm - ex, ex)):
                if part <= 0 or size <= 1:
                    continue
                link = (size, inter, k, nd)
                ag = lambda b, link=link: self.comm.all_gather(b, *link)        # noqa: E731
                rs = lambda b, link=link: self.comm.reduce_scatter(b, *link)    # noqa: E731
                lp = chunk_lp[j] * part / prm if prm else 0.0
                nbytes = (part * self._w + lp * self._ag_lp, part * self._g)
                exp, g, r = per_micro_batch(features.fsdp, size, nbytes, len(layer), fwd, bwd, ag, rs, self._tax,
                                            features.overlap_param_gather, features.overlap_grad_reduce)
                chunk_fwd[j] += exp[0]
                chunk_bwd[j] += exp[1]
                fwd, bwd = max(0.0, fwd - g[1] / 2), max(0.0, bwd - g[1] / 2 - r[1])   # what is left for the experts
                gath, red = (gath[0] + M * g[0], gath[1] + M * g[1]), (red[0] + M * r[0], red[1] + M * r[1])
        w_layer = self._w + self._ag_lp * sum(chunk_lp) / max(layers, 1.0)    # a layer's weight bytes per parameter
        return (fsdp_buffer_mb(features.fsdp, dpc, biggest, w_layer, self._g),
                {"fsdp_param_gather": gath, "fsdp_grad_reduce": red})

    def _offload(self, p: _Prepared, stage_index: int, chunk_fwd: list, chunk_bwd: list, features: Features,
                 M: int) -> tuple[float, float, dict]:
        """CPU activation offload of the first ``offload_layers`` layers (``offload.py``; one stage): the exposed
        copies added to the forward / backward in place; returns (MB off the GPU per micro-batch, MB of the layer in
        flight, comm entries)."""
        N = features.offload_layers
        if not N or stage_index:
            return 0.0, 0.0, {}
        end = self.model.layer_starts[N]
        c = p.cum
        act = float(p.table.act_mb[:end, 0].sum())
        fwd, bwd = (c["fwd"][end] - c["fwd"][0]) / N, (c["bwd"][end] - c["bwd"][0]) / N
        gbps = host_link_gbps(self.cluster.gpu.name)
        d2h, h2d = offload_ms(act / N, N, fwd, gbps), offload_ms(act / N, N, bwd, gbps)
        chunk_fwd[0] += d2h[0]
        chunk_bwd[0] += h2d[0]
        kept = kept_mb(act, N)
        return act - kept, kept, {"offload": (M * (d2h[0] + h2d[0]), M * (d2h[1] + h2d[1]))}

    def _ideal(self, first: bool, last: bool, start: int, end: int, mbs: int, n: int) -> float:
        """fwd + bwd of the stage's work on one GPU at the whole micro-batch, divided by its GPUs (analytic only:
        a profile need not cover tp 1 at the whole micro-batch; other sources report fwd + bwd - TP comm)."""
        p = self._prepared(mbs, 1)
        t, c = p.table, p.cum
        ms = c["fwd"][end] - c["fwd"][start] + c["bwd"][end] - c["bwd"][start]
        ms += (t.embed_fwd_ms + t.embed_bwd_ms if first else 0.0) + (t.head_fwd_ms + t.head_bwd_ms if last else 0.0)
        return ms / n

    def _boundary(self, full_mb_per_dp1: float, send: Shape, recv: Shape, lo_rank: int, hi_rank: int,
                  wrap: bool = False, hop: tuple[int, int, int] | None = None) -> tuple[float, float]:
        """One direction of one boundary: (ms, receive-buffer MB). ``full_mb_per_dp1`` = MB of the micro-batch.
        ``wrap``: the interleaved schedule's last-stage -> first-stage hop (across nodes on a multi-node cluster).
        ``hop``: (sending stage, receiving stage, stages) under the tp-cp-ep-pp-dp rank order, where stage k of
        replica d holds ranks ``t + c tp + k tp cp + d tp cp pp``: on the network if any of its pairs is."""
        x = full_mb_per_dp1
        recv_mb = x / recv.dp
        send_mb = recv.tp * x / (send.tp * send.dp)
        if self.settings.rank_order == TP_PP_DP and hop is not None:
            a, b, S = hop
            w = recv.tp * recv.cp
            inter = any(self.cluster.domain_of(r + a * w) != self.cluster.domain_of(r + b * w)
                        for r in (i + d * w * S for d in range(recv.dp) for i in range(w)))
        elif wrap:
            inter = self.cluster.num_gpus > self.cluster.nvlink_size
        else:
            inter = self.comm.spans_nodes(max(lo_rank, 0), hi_rank)
        if self.settings.p2p_scatter_gather and send == recv and recv.tp > 1 and not recv.sp:
            return self.comm.p2p(recv_mb / recv.tp * MB, inter) + self.comm.all_gather(recv_mb * MB, recv.tp), recv_mb
        return self.comm.p2p(max(recv_mb, send_mb) * MB, inter), recv_mb

    # ----- the pipeline ------------------------------------------------------------------------------------------
    def _schedule_inputs(self, stage_costs: list[StageCost]):
        barrier = self.settings.optimizer_barrier
        sync = [s.dp_sync_ms + (0.0 if barrier else s.optimizer_ms) for s in stage_costs]
        step = [s.optimizer_ms for s in stage_costs] if barrier else None
        pro = [getattr(s, "prologue_ms", 0.0) for s in stage_costs]
        return sync, step, pro if any(pro) else None

    def pipeline(self, stage_costs: list[StageCost], num_micro_batches: int,
                 events: list | None = None) -> PipelineCost:
        sync, step, ready = self._schedule_inputs(stage_costs)
        if stage_costs[0].chunk_fwd_ms:
            return interleaved_one_f_one_b([list(s.chunk_fwd_ms) for s in stage_costs],
                                           [list(s.chunk_bwd_ms) for s in stage_costs], sync, num_micro_batches,
                                           events, ready=ready, step=step)
        fwd = [s.fwd_ms + s.p2p_ms / 2 for s in stage_costs]
        bwd = [s.bwd_ms + s.recompute_ms + s.p2p_ms / 2 for s in stage_costs]
        return one_f_one_b(fwd, bwd, sync, num_micro_batches, ready=ready, step=step, events=events)

    def pipeline_events(self, stage_costs: list[StageCost], num_micro_batches: int) -> list[Event]:
        """The schedule's timeline (``types.Event``, finer kinds: ``timeline.refine``) from the same recurrence as
        ``pipeline``."""
        from .timeline import refine
        events: list[Event] = []
        self.pipeline(stage_costs, num_micro_batches, events)
        return refine(events, stage_costs, self.settings.optimizer_barrier)

    # ----- a whole plan ------------------------------------------------------------------------------------------
    def stage_costs(self, plan) -> list[StageCost]:
        """Every stage of a ``ParallelPlan``, with each boundary's real neighbour shapes and the plan's features."""
        self._check_plan(plan)
        st, k = plan.stages, plan.num_stages
        ring = plan.num_virtual_stages > 1
        feats = Features.of_plan(plan)
        moe = moe_settings(plan)
        out = []
        for i, s in enumerate(st):
            rc = np.fromiter((RC_CODE[r] for r in s.all_recompute), dtype=np.int8, count=s.num_units)
            prev = st[i - 1] if i or ring else None
            nxt = st[(i + 1) % k] if i < k - 1 or ring else None
            out.append(self.stage_cost(
                i, k, plan.first_rank(i), s.chunks[0].start_unit, s.chunks[-1].end_unit, s.tp, s.dp, rc,
                plan.micro_batch_size, prev=Shape.of(prev) if k > 1 and prev is not None else None,
                next=Shape.of(nxt) if k > 1 and nxt is not None else None,
                num_micro_batches=plan.num_micro_batches, cp=s.cp, sp=s.sequence_parallel,
                spans=s.spans if ring else None, features=feats, ep=s.ep, etp=s.etp or 0, moe=moe))
        return out

    def evaluate(self, plan) -> PlanCost:
        stages = self.stage_costs(plan)
        pipe = self.pipeline(stages, plan.num_micro_batches)
        return self.summarize(stages, pipe, plan.global_batch_size, plan.world_size)

    def summarize(self, stages: list[StageCost], pipe: PipelineCost, global_batch_size: int,
                  num_gpus: int) -> PlanCost:
        it = pipe.iteration_ms
        mem = [s.memory_mb for s in stages]
        fits = all(s.fits for s in stages)
        warnings = list(getattr(self.source, "warnings", []))
        for i, s in enumerate(stages):
            if not s.fits:
                over = s.memory_mb - self.memory_limit_mb
                warnings.append(f"stage {i} needs {s.memory_mb:.0f} MiB per GPU, {over:.0f} MiB over the "
                                f"{self.memory_limit_mb:.0f} MiB limit")
        worst = max(range(len(stages)), key=lambda i: mem[i] - self.memory_limit_mb) if not fits else pipe.bottleneck
        t = throughput(self.model, global_batch_size, it, num_gpus, self.cluster.gpu.peak_tflops(self.training.dtype))
        return PlanCost(iteration_ms=it, samples_per_s=t.samples_per_s,
                        stages=stages, pipeline=pipe, max_memory_mb=max(mem), memory_limit_mb=self.memory_limit_mb,
                        fits=fits, bottleneck_stage=worst,
                        bottleneck_resource="memory" if not fits else classify(stages[worst]),
                        tflops_per_gpu=t.tflops_per_gpu, mfu=t.mfu or 0.0, cost_model=self.kind,
                        warnings=warnings, tokens_per_s_per_gpu=t.tokens_per_s_per_gpu)

    def _check_plan(self, plan) -> None:
        if plan.model != self.model:
            raise AcesoError(f"the plan is for model {plan.model.name} but the cost model was built for "
                             f"{self.model.name}; build it with the plan's model")
        if plan.world_size > self.cluster.num_gpus:
            raise AcesoError(f"the plan uses {plan.world_size} GPUs but the cluster {self.cluster.label} has "
                             f"{self.cluster.num_gpus}; use a plan for this cluster")
        if self.settings.rank_order == TP_PP_DP and (len({Shape.of(s) for s in plan.stages}) > 1 or self._moe_model):
            raise AcesoError("rank order tp-cp-ep-pp-dp (--use-tp-pp-dp-mapping): aceso prices it for dense plans "
                             "whose stages share one shape; drop the flag or use uniform stages")


def classify(s: StageCost) -> str:
    """What limits a (fitting) stage: communication or recompute when either takes ``COMM_SHARE`` of its time."""
    total = s.time_per_microbatch_ms or 1.0
    comm = (s.p2p_ms + s.tp_comm_ms + s.ep_comm_ms) / total
    rec = s.recompute_ms / total
    if max(comm, rec) >= COMM_SHARE:
        return "communication" if comm >= rec else "recompute"
    return "compute"
