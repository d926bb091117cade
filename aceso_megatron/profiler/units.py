"""Unit profiling: forward/backward time, activation bytes per recompute choice and weight bytes of every unit
kind, the embedding and the head, built by the runtime itself.

For a tensor-parallel degree ``tp`` on ``world`` processes the profiler makes a one-stage plan of a one-layer copy
of the model (tp, dp = world / tp) and lets the runtime build it: ``parallel.layout.build_groups`` (real TP groups
of ``tp`` adjacent ranks) and ``model.stage_model.build_stage`` (the unit layers from ``model_specs.builders``, the
user's own ``layer_spec`` modules included, the per-unit configs of ``model.config``, embedding, final norm, output
layer, loss; a layer spec that cannot be carved into units is refused: ``check_profiled_model``). One stage is
built per recompute choice (the plan's ``recompute`` of every unit that can take it, ``none`` for the others: MLP
units have no ``attn_dropout``), so every choice runs exactly the code the runtime runs. Layers are identical, so
one layer per unit kind is enough.

Each TP group measures concurrently (every rank runs every measurement; rank 0's group is recorded), in
lockstep: all ranks meet at a barrier before every repeat, so every repeat runs under the load of all the
processes, as in a real run where they all compute at once (a tp-1 group alone would drift out of step). Per unit and per-rank batch:
- ``fwd_us``, ``bwd_us``: medians with recompute none (the unit's TP collectives included);
- ``recompute_us[c]``: ``(fwd + bwd)`` under choice c minus under none (clipped at 0); lists indexed by the
  unit kind's choices in ``search.spec.plan.RECOMPUTE_CHOICES`` order (``recompute_allowed``: 4 for attention and
  cross-attention, 3 for MLP);
- ``act_bytes[c]``: bytes kept for backward (``memory.py``); ``weight_bytes``: the unit's parameters per rank;
- on GPU: ``peak_bytes[c]``, the backward's transient peak under c above the one under none, and
  ``workspace_bytes``, the transient under none (gradient buffers, kernel workspaces).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import MLA_ONLY, RECOMPUTE_CHOICES, parse_plan, recompute_allowed

from . import memory
from .timing import repeat


def one_layer(model: ModelSpec) -> ModelSpec:
    """The model with one layer (T5: one encoder and one decoder layer); an MoE model with dense layers too gets
    two, a dense one and an MoE one (``moe.probe_model``); a hybrid model one layer of each kind of its pattern, in
    the order they first appear (``M*-`` for Nemotron-H), each a unit (``hybrid_probe``)."""
    if model.hybrid_layer_pattern:
        return hybrid_probe(model)
    if model.moe is not None:
        from .moe import probe_model

        return probe_model(model)
    upd = {"num_layers": 1}
    if model.is_t5:
        upd["num_decoder_layers"] = 1
    return ModelSpec.model_validate({**model.model_dump(), **upd})


def hybrid_probe(model: ModelSpec) -> ModelSpec:
    """A hybrid model cut to one layer per symbol of its main pattern (MTP left out: its block is priced from its
    inner layers' units); an MoE hybrid keeps its ``E`` layer (``moe.probe_model`` is for GPT layers)."""
    from search.layers.hybrid import parse_pattern

    pattern = "".join(dict.fromkeys(parse_pattern(model.hybrid_layer_pattern).layers))
    return ModelSpec.model_validate({**model.model_dump(), "num_layers": len(pattern), "hybrid_layer_pattern": pattern,
                                     "mtp_num_layers": None})


def probe_plan(model: ModelSpec, tp: int, world: int, rc: str, ep: int = 1):
    """A one-stage plan of the one-layer model with choice ``rc`` on every unit that can take it (an MoE model:
    experts at ``ep``, etp = tp, the settings ``moe.PROBE_SETTINGS``)."""
    m = one_layer(model)
    dp = world // tp
    recompute = [rc if rc in recompute_allowed(u.kind) else "none" for u in m.units]
    raw = {"model": m.model_dump(), "micro_batch_size": dp, "global_batch_size": dp,
           "stages": [{"num_gpus": world, "tp": tp, "dp": dp, "start_unit": 0, "end_unit": m.num_units,
                       "recompute": recompute}]}
    if m.moe is not None:
        from .moe import PROBE_SETTINGS

        raw["stages"][0]["ep"] = ep
        raw["moe"] = PROBE_SETTINGS.model_dump()
    return parse_plan(raw, world_size=world, source="profiler probe plan")


def check_profiled_model(model: ModelSpec, device: str) -> None:
    """The model's layer specs and megatron block (``model.layers.check_model``), and layers that can be carved:
    the profiler measures attention and MLP units one by one, which a layer that runs whole does not have."""
    from model_specs.extensions import whole_layer_stacks

    from ..model.layers import check_model

    whole = whole_layer_stacks(model)
    if whole:
        raise AcesoError(f"{next(iter(whole.values()))}, so its layers run whole; the profiler measures attention "
                         "and MLP units one by one and cannot profile it yet (plan it with --cost-model analytic)")
    probe = probe_plan(model, 1, 1, "none")
    if model.moe is not None or model.mla is not None or model.mtp_num_layers:   # what the runtime cannot build
        from ..model.fast_path import Environment
        from ..preflight import refusal

        if (msg := refusal(Environment.detect(device), probe)) is not None:
            raise AcesoError(msg)
    check_model(probe, device)


def seq_of(model: ModelSpec, stack: str) -> int:
    return model.decoder_seq_length if (model.is_t5 and stack == "decoder") else model.seq_length


def param_bytes(params) -> int:
    return int(sum(p.numel() * p.element_size() for p in params))


@dataclass
class Settings:
    device: str
    warmup: int
    repeats: int


class TPBench:
    """The runtime's modules at one tp: one stage per recompute choice, sharing this rank's TP group."""

    def __init__(self, model: ModelSpec, tp: int, world: int, rank: int, settings: Settings, seed: int = 1234,
                 ep: int = 1):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from ..model.stage_model import build_stage
        from ..parallel.layout import build_groups

        self.model, self.tp, self.ep, self.s = model, tp, ep, settings
        # mla_up_proj is not profiled yet (``unit`` measures recompute_allowed(kind) without MLA; the database's
        # rows mark it unavailable): no stage for it
        plans = {rc: probe_plan(model, tp, world, rc, ep) for rc in RECOMPUTE_CHOICES if rc not in MLA_ONLY}
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        if model.moe is not None:     # as the runtime does (training.engine.build_runtime)
            from patches import moe_router_without_te

            moe_router_without_te.apply()
            if model.add_bias_linear:   # a biased expert's fc2 bias out of place (GPT-OSS)
                from patches import expert_bias_out_of_place

                expert_bias_out_of_place.apply()
        if model.mamba is not None:   # megatron-core's MambaMixer on torch kernels where mamba-ssm is absent, as the
            from patches import mamba_cpu     # runtime applies it (training.build_steps._patches_for)

            mamba_cpu.apply()         # a no-op where mamba-ssm is installed
        if model.gdn is not None:     # GatedDeltaNet on torch kernels where fla is absent (the runtime's gdn_cpu)
            from patches import gdn_cpu

            gdn_cpu.apply()           # a no-op where fla is installed
        self.groups = build_groups(plans["none"], rank)
        lay = self.groups.layout
        model_parallel_cuda_manual_seed(seed, tp_rank=lay.tp_rank, ep_rank=lay.ep_rank, etp_rank=lay.etp_rank)
        self.stages = {}
        for rc, plan in plans.items():
            st = build_stage(plan, 0, self.groups.pg_collection, settings.device)
            self.stages[rc] = st.to(settings.device) if settings.device == "cuda" else st
        self.dtype = self.stages["none"].config.params_dtype

    # ----- inputs ---------------------------------------------------------------------------------------------
    def _randn(self, *shape, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.s.device).requires_grad_(grad)

    def _unit_call(self, stack: str, kind: str, b: int):
        """(x, kwargs, excluded tensors) for one unit of kind (stack, kind) at per-rank batch b."""
        m, h = self.model, self.model.hidden_size
        s = seq_of(m, stack)
        x = self._randn(s, b, h)
        st = self.stages["none"]
        if not m.is_t5:
            return x, {"rotary_pos_emb": st.rotary_table(s)}, []
        dev = self.s.device
        if stack == "encoder":
            return x, {"attention_mask": torch.zeros(1, 1, s, s, dtype=torch.bool, device=dev)}, []
        ctx = self._randn(m.seq_length, b, h)
        mask = torch.zeros(1, 1, s, m.seq_length, dtype=torch.bool, device=dev)
        return x, {"context": ctx, "context_mask": mask}, [ctx]

    def _find_unit(self, rc: str, stack: str, kind: str):
        for u in self.stages[rc].units:
            if u.unit.stack == stack and u.unit.kind == kind:
                return u
        raise ValueError(f"the model has no {stack} {kind} unit")

    # ----- forward/backward, measured -------------------------------------------------------------------------
    def _backward(self, out: torch.Tensor) -> None:
        out.backward(torch.ones_like(out) if out.dim() == 0 else self._grad_like(out))

    def _time(self, fwds: list) -> list[dict]:
        """Forward and backward medians of each callable; the callables alternate within every repeat, so a
        drift in machine speed (a shared CPU) shifts them alike and their differences stay meaningful."""
        def step(clock):
            for fwd in fwds:
                out = fwd()
                clock.mark()
                self._backward(out)
                clock.mark()

        stats = repeat(step, 2 * len(fwds), self.s.warmup + 1, self.s.repeats, self.s.device, self.groups.world)
        return [{"fwd_us": f.median_us, "bwd_us": b.median_us, "spread": [round(f.spread, 4), round(b.spread, 4)],
                 "_total": np.add(f.samples, b.samples)} for f, b in zip(stats[0::2], stats[1::2])]

    def _account(self, fwd, params, exclude, inputs) -> dict:
        """Bytes kept for backward by one forward (and, on GPU, the backward's transient peak)."""
        cuda = self.s.device == "cuda"
        with memory.SavedTensors(exclude=exclude, params=params) as saved:
            before = memory.allocated() if cuda else 0
            out = fwd()
            after = memory.allocated() if cuda else 0
        res = {"saved_bytes": saved.nbytes, "act_bytes": saved.nbytes}
        if cuda:
            kept_inputs = sum(memory.tensor_bytes(t) for t in inputs if saved.holds(t))
            res["act_bytes"] = max(after - before - memory.tensor_bytes(out), 0) + kept_inputs
            memory.reset_peak()
            base = memory.allocated()
        self._backward(out)
        if cuda:
            res["bwd_peak_bytes"] = memory.peak() - base
        return res

    def _measure(self, fwd, params, exclude, inputs) -> dict:
        t = self._time([fwd])[0]
        del t["_total"]
        return {**t, **self._account(fwd, params, exclude, inputs)}

    def _grad_like(self, out: torch.Tensor) -> torch.Tensor:
        g = getattr(self, "_g", None)
        if g is None or g.shape != out.shape:
            g = self._g = torch.randn_like(out)
        return g

    def unit(self, stack: str, kind: str, b: int) -> dict:
        """One unit kind at per-rank batch ``b`` under every recompute choice the kind can take."""
        rcs = recompute_allowed(kind)
        x, kw, exclude = self._unit_call(stack, kind, b)
        mods = {rc: self._find_unit(rc, stack, kind) for rc in rcs}
        fwds = [lambda mod=mods[rc]: mod(x, **kw) for rc in rcs]
        per = dict(zip(rcs, self._time(fwds)))
        for rc, fwd in zip(rcs, fwds):
            per[rc].update(self._account(fwd, list(mods[rc].parameters()), exclude, [x]))
        base = per["none"]
        # extra time of a choice: the median of the per-repeat differences (paired: drift cancels)
        extra = [max(float(np.median(per[rc]["_total"] - base["_total"])), 0.0) for rc in rcs[1:]]
        res = {"fwd_us": base["fwd_us"], "bwd_us": base["bwd_us"], "recompute_us": [0.0] + extra,
               "act_bytes": [float(per[rc]["act_bytes"]) for rc in rcs],
               "saved_bytes": [float(per[rc]["saved_bytes"]) for rc in rcs],
               "weight_bytes": float(param_bytes(mods["none"].parameters())),
               "spread": {rc: per[rc]["spread"] for rc in rcs}}
        if "bwd_peak_bytes" in base:
            w0 = base["bwd_peak_bytes"]
            res["peak_bytes"] = [0.0] + [float(max(per[rc]["bwd_peak_bytes"] - w0, 0)) for rc in rcs[1:]]
            res["workspace_bytes"] = float(w0)
        if kind == "moe":
            from .moe import moe_columns

            res.update(moe_columns(self, mods["none"], fwds[0]))
        return res

    def embedding(self, b: int) -> dict:
        st, m = self.stages["none"], self.model
        s = m.seq_length
        ids = torch.randint(0, m.vocab_size, (b, s), device=self.s.device)
        pos = torch.arange(s, device=self.s.device).unsqueeze(0).expand_as(ids)
        params = list(st.embedding.parameters())
        res = self._measure(lambda: st.embedding(input_ids=ids, position_ids=pos), params, [], [])
        res["weight_bytes"] = float(param_bytes(params))
        return res

    def head(self, b: int) -> dict:
        """Final norm + output layer + vocab-parallel cross-entropy, summed to a scalar as the runtime's loss."""
        st, m = self.stages["none"], self.model
        s = seq_of(m, "decoder")
        x = self._randn(s, b, m.hidden_size)
        labels = torch.randint(0, m.vocab_size, (b, s), device=self.s.device)
        norm = st.decoder_final_layernorm if m.is_t5 else st.final_layernorm
        if m.is_t5:
            weight = st.embedding.word_embeddings.weight if m.tied_embeddings else st.output_layer.weight
        else:
            weight = st.output_weight()

        def fwd():
            logits, _ = st.output_layer(norm(x), weight=weight)
            return st._loss(logits, labels).sum()

        owned = list(norm.parameters()) + [p for p in st.output_layer.parameters() if p is not weight or
                                           not m.tied_embeddings]
        if m.is_t5:
            owned += list(st.encoder_final_layernorm.parameters())
        res = self._measure(fwd, list(st.parameters()), [], [x])
        res["weight_bytes"] = float(param_bytes(owned))
        return res
