"""One pre-flight: will the runtime run this plan? (issue 25: "what validate accepts, the runtime runs").

``preflight(plan, device)`` is the one answer, asked by ``aceso validate``, by the search before it writes a plan
(it emits only plans its runtime runs), and by ``aceso launch`` / ``aceso train`` before any process exists. It is
one ``AcesoError`` line naming the stage or field, or None. Two parts, one function:

- the planner's checks (here, torch-free): a runtime plan (``settings`` absent or ``runtime``) has no activation
  offload nor low-precision recipe (``search/fsdp.py``, ``search/precision.py``; Megatron-LM runs them), nor the
  tp-cp-ep-pp-dp rank order or SHARP (``search/data_parallel.py``); an FP8
  plan's bf16 first / last layers fit megatron-core's bound (``precision.check_bf16_layers``); the padded vocabulary divides every tp that shards it (the first and
  last model chunks' stages, and a T5's decoder embedding), as megatron-core's ``VocabParallelEmbedding`` and
  output layer require; context parallelism on a CPU run (megatron-core runs it only with transformer-engine's
  attention) or with a softmax offset (transformer-engine: a2a only, not priced; ``layer_variants``);
- the runtime's checks, reached through the ``aceso.subcommands`` entry point of ``train`` (a module attribute
  ``preflight(plan, device)``), so that this package never names the runtime: the layer specs (importable,
  transformer-engine where there is none, carvable or kept whole in one chunk with one recompute none/full), the
  ``megatron`` block against the installed ``TransformerConfig`` (names and types), and what this machine's
  environment cannot run, and what of MoE / MLA / MTP and Megatron FSDP it does not run yet on any machine. They
  run only for what they can refuse: a plan whose model has a ``layer_spec``, a ``megatron`` block or MoE / MLA /
  MTP, a Megatron FSDP plan, or a run
  on this machine (``here=True``: launch, train). Without the runtime installed they
  are skipped, and ``runtime_checked`` says so.
"""

from __future__ import annotations

from .errors import AcesoError
from .layer_variants import offset_blocks_cp
from .precision import check_bf16_layers

RUNTIME_ENTRY = "train"      # the aceso.subcommands entry point whose module carries ``preflight``


def preflight(plan, device: str | None = None, here: bool = False) -> bool:
    """Refuse (``AcesoError``) what the runtime would not run; returns whether the runtime's checks ran."""
    device = device or target_device(plan)
    planner_checks(plan, device)
    m = plan.model
    if not (here or m.layer_spec or m.megatron or m.moe or m.mla or m.mtp_num_layers or plan.megatron_fsdp):
        return True          # nothing the runtime checks beyond the planner's
    check = runtime_preflight()
    if check is None:
        return False
    from .cli import RUNTIME_PACKAGES

    try:
        return check(plan, device, here=here) is not False
    except ModuleNotFoundError as e:     # the runtime's package is here but torch or megatron-core is not
        if here or (e.name or "").split(".")[0] not in RUNTIME_PACKAGES:
            raise
        return False


def target_device(plan) -> str:
    """The device a plan is made for: cpu for a ``*-cpu`` cluster, else cuda."""
    return "cpu" if plan.cluster is not None and plan.cluster.gpu.name == "cpu" else "cuda"


RUNTIME_LOW_PRECISION = ("the aceso runtime does not run low-precision recipes yet (its transformer-engine path "
                         "has not run on a GPU: tests/gpu/test_lowprec_gpu.py); search with --target megatron-lm "
                         "or megatron-bridge and export the plan")


def planner_checks(plan, device: str) -> None:
    m = plan.model
    s = plan.settings
    if s is not None and s.low_precision is not None and s.framework == "runtime":
        raise AcesoError(f"settings.low_precision ({s.low_precision.recipe}): {RUNTIME_LOW_PRECISION}")
    if s is not None and s.low_precision is not None:
        low = s.low_precision
        why = check_bf16_layers(low.recipe, low.bf16_layers_start, low.bf16_layers_end, m.num_layers,
                                plan.num_stages)
        if why:
            raise AcesoError(why)
    dps = s.data_parallel if s is not None else None
    if dps is not None and s.framework == "runtime" and (dps.rank_order != "tp-cp-ep-dp-pp" or dps.sharp):
        raise AcesoError("settings.data_parallel: the aceso runtime builds megatron-core's default rank order "
                         "(tp-cp-ep-dp-pp) without SHARP groups; run the plan with Megatron-LM (aceso export --to "
                         "megatron-lm) or remove rank_order / sharp")
    if plan.activation_offload and (plan.settings is None or plan.settings.framework == "runtime"):
        raise AcesoError("activation_offload: the aceso runtime keeps activations on the GPU; run the plan with "
                         "Megatron-LM (aceso export --to megatron-lm) or remove the field")
    vocab = m.padded_vocab_size
    holders = {plan.chunks_in_order()[0][0]: "the input embedding", plan.chunks_in_order()[-1][0]: "the output layer"}
    if m.is_t5:
        for s, _j, ch in plan.chunks_in_order():
            if ch.start_unit <= m.num_encoder_units < ch.end_unit or ch.start_unit == m.num_encoder_units:
                holders.setdefault(s, "the decoder embedding")
    for s, what in sorted(holders.items()):
        tp = plan.stages[s].tp
        if vocab % tp:
            raise AcesoError(
                f"stages[{s}].tp ({tp}): the padded vocabulary ({vocab} = vocab_size {m.vocab_size} rounded up to "
                f"make_vocab_size_divisible_by {m.make_vocab_size_divisible_by}) must divide by it ({what} is "
                f"split over tp); set model.make_vocab_size_divisible_by to a multiple of {tp} (Megatron-LM uses "
                "128), or use a tp that divides it")
    for i, st in enumerate(plan.stages):
        if st.cp > 1 and offset_blocks_cp(m):
            raise AcesoError(f"stages[{i}].cp ({st.cp}): transformer-engine runs softmax_type {m.softmax_type} "
                             "under context parallelism only with cp_comm_type a2a, which aceso does not price; "
                             "use cp 1")
    if device == "cpu":
        for i, st in enumerate(plan.stages):
            if st.cp > 1:
                raise AcesoError(f"stages[{i}].cp ({st.cp}): megatron-core runs context parallelism only with "
                                 "transformer-engine's attention, which a CPU run does not have; search the plan "
                                 "for a CPU cluster with cp 1 (aceso search --cluster 1xN-cpu), or run it on GPUs")


def runtime_preflight():
    """The runtime's ``preflight(plan, device, here)``, or None in a planner-only install."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="aceso.subcommands"):
        if ep.name != RUNTIME_ENTRY:
            continue
        try:
            return getattr(ep.load(), "preflight", None)
        except ModuleNotFoundError:
            return None
    return None
