"""What the aceso runtime does not run, decided torch-free from the model, the plan and the device: the runtime
column of the capability table (``search/targets/capabilities.py``).

These rules lived in the runtime (its former ``model.moe.refusal``, ``training.fsdp.refusal``,
``model.fast_path.refusal``), so a planner without torch (or with torch absent at the search's output check)
skipped them and ``aceso validate`` of a CPU plan skipped those that depend on the device: a plan with expert tp 2
and the alltoall dispatcher was valid, and ``aceso launch --cpu`` refused it in its workers 30 s later. The runtime
now asks these same functions; what only torch, megatron-core or the running machine can tell (layer specs, the
transformer-engine version, einops) stays there.

A rule takes ``(model, low)`` (``model`` scope: the model and the low-precision recipe decide, before any search),
``(dtype, gpu)`` (``precision`` scope: the training dtype on the plan's GPU, also before any search) or ``(plan,
device)`` (``plan`` scope; ``device``: ``capabilities.Device``, with ``te`` None where unknown) and
returns one line naming the field and the fix, or None. A line starts with the plan field a user edits, as plan
schema v4 names it (``settings.X`` for a plan-wide switch, ``model.X``, ``stages[i].X``;
tests/unit/test_runtime_rules_fields.py resolves each against the schema). Each line is written here only: the
runtime's own entry check (its pre-flight half's ``refusal``) asks these functions, and what only the running
machine can tell builds its line from the pieces here (``fp16_loss_scaling``, ``TP_OVERLAP_UNAVAILABLE``).
"""

from __future__ import annotations

from search.layers.kind import without_runtime_cp
from search.settings.data_parallel import runtime_refusal
from search.settings.moe_plan import MoEPlanSettings, expert_tp

RUNTIME_LOW_PRECISION = ("the aceso runtime does not run low-precision recipes yet (its transformer-engine path "
                         "has not run on a GPU: tests/gpu/test_lowprec_gpu.py); search with --target megatron-lm "
                         "or megatron-bridge and export the plan")
RUNTIME_NO_OFFLOAD = "the aceso runtime keeps activations on the GPU (megatron-core's CPU offloading is not built)"
TP_OVERLAP_UNAVAILABLE = ("settings.tp_comm_overlap: transformer-engine's TP communication overlap (userbuffers, "
                          "TE >= 1.9) is not available")


# ----- model scope: (model, low) ----------------------------------------------------------------------------------
def low_precision(model, low) -> str | None:
    if low is None:
        return None
    return f"settings.low_precision ({low.recipe}; aceso search --precision {low.recipe}): {RUNTIME_LOW_PRECISION}"


def latent_moe(model, low) -> str | None:
    if model.moe is None or not model.moe.moe_latent_size:
        return None
    return (f"model.moe.moe_latent_size ({model.moe.moe_latent_size}): the aceso runtime does not build LatentMoE's latent "
            "projections (megatron-core 0.19 builds them as transformer-engine linears only: MoELayer asserts "
            "HAVE_TE); search with --target megatron-lm and export the plan (--moe-latent-size)")


def t5_rope(model, low) -> str | None:
    """The runtime's T5 stages (its stage model's ``T5Stage``) build learned absolute position
    embeddings only; stock ``T5Model(position_embedding_type="rope")`` (megatron-core 0.16.1 to 0.19.2, Megatron-LM
    pretrain_t5.py's --position-embedding-type) has none and rotates encoder and decoder self-attention instead."""
    if not model.is_t5 or model.position_embedding != "rope":
        return None
    return (f"model.position_embedding rope with T5 (model {model.name}): the aceso runtime's T5 stages build learned "
            "position embeddings only; set model.position_embedding learned, or search with --target megatron-lm "
            "(pretrain_t5.py builds T5Model's RoPE)")


# ----- precision scope: (dtype, gpu) -------------------------------------------------------------------------------
def fp16_on_gpu(dtype: str, gpu) -> str | None:
    """fp16 trains with loss scaling, which the runtime does not run yet (its entry check refuses it on any GPU at
    launch: ``fp16_loss_scaling``; a CPU runs an fp16 plan in fp32). Refused where the GPU trains in bf16 (``gpu``:
    the plan's GPU, None on a CPU); a V100 has no bf16, and its fp16 plans (the Aceso reference's) stay, refused by
    the runtime on the machine."""
    if gpu is None or gpu.name == "cpu" or not gpu.peak_tflops("bf16"):
        return None
    return fp16_loss_scaling(dtype)


def fp16_loss_scaling(dtype: str) -> str | None:
    """A plan trained in fp16 on a GPU (the runtime's entry check asks it on the machine; ``fp16_on_gpu``)."""
    if dtype != "fp16":
        return None
    return ("model.params_dtype fp16 (aceso search --precision fp16): the aceso runtime has no fp16 loss scaling "
            "yet; train in bf16 (--precision bf16; a V100 has none: fp32), or search with --target megatron-lm "
            "(Megatron-LM scales fp16 losses)")


# ----- plan scope: (plan, device) ---------------------------------------------------------------------------------
def activation_offload(plan, device) -> str | None:
    if plan.activation_offload is None:
        return None
    return (f"settings.activation_offload: {RUNTIME_NO_OFFLOAD}; run the plan with Megatron-LM (aceso export --to "
            "megatron-lm) or remove the field")


def megatron_fsdp(plan, device) -> str | None:
    """What of Megatron FSDP the runtime does not run beyond what no framework runs (``fsdp.structural_refusal``,
    applied by the plan itself): ``no_shard``, MoE at tp or etp > 1."""
    if plan.megatron_fsdp is None:
        return None
    if plan.megatron_fsdp.data_parallel_sharding_strategy == "no_shard":
        return ("settings.megatron_fsdp no_shard: megatron-core 0.16.1's optimizer step fails on it (start_param_sync -> "
                "async_bucket_gather: the weight buffer is None) and it shards nothing; remove settings.megatron_fsdp "
                "(DDP)")
    st = plan.stages[0]
    etp = expert_tp(st)
    if plan.model.moe is not None and max(st.tp, etp) > 1:
        return (f"settings.megatron_fsdp with an MoE model at tp {st.tp} / etp {etp}: the runtime runs Megatron "
                "FSDP with experts at tp 1 and etp 1 only (the router's and experts' TP flags are not run yet); use "
                "stages[0].tp 1 or remove settings.megatron_fsdp")
    return None


def overlap_ep(plan, device) -> str | None:
    if plan.model.moe is None or not (plan.moe or MoEPlanSettings()).overlap_ep_comm:
        return None
    return ("settings.moe.overlap_ep_comm: the runtime does not run megatron-core's combined 1F1B EP overlap yet; "
            "set it false")


def mla_mtp(plan, device) -> str | None:
    """What of MLA / MTP the runtime does not run: MTP units run unrecomputed (megatron-core's MTP recompute is its
    whole-block ``full`` only), MLA attention units without ``attn_dropout`` (its core attention has separate key
    and value widths), the MTP block without interleaving or context parallelism (not proven)."""
    m = plan.model
    if m.mtp_num_layers:
        last, i = plan.stages[-1], len(plan.stages) - 1
        if len(last.chunks) > 1:
            return (f"stages[{i}].chunks ({len(last.chunks)} virtual stages on the last stage) with model.mtp_num_layers "
                    f"({m.mtp_num_layers}): the runtime's MTP block is proven without interleaving only; use one "
                    "chunk per stage")
        if last.cp > 1:
            return (f"stages[{i}].cp ({last.cp}) with model.mtp_num_layers ({m.mtp_num_layers}) on the last stage: the "
                    "runtime's MTP block is proven without context parallelism only; use cp 1 there")
    for s, j, ch in plan.chunks_in_order():
        for k, rc in enumerate(ch.recompute):
            unit = m.units[ch.start_unit + k]
            if unit.kind == "mtp" and rc != "none":
                return (f"stages[{s}].chunks[{j}].recompute[{k}] (unit {ch.start_unit + k} (mtp): recompute {rc}): "
                        "the runtime runs the MTP block without recompute; set it none")
            if unit.kind == "attention" and m.mla is not None and rc == "attn_dropout":
                return (f"stages[{s}].chunks[{j}].recompute[{k}] (unit {ch.start_unit + k}): attn_dropout with "
                        "multi-latent attention: the runtime's recomputed dropout assumes equal key and value widths; "
                        "use selective or full")
    return None


def layers_cp(plan, device) -> str | None:
    """Layers under context parallelism that the runtime does not run (a kind's ``no_runtime_cp``): Mamba-2's
    ``MambaContextParallel`` and GDN's own all-to-alls (``tensor_a2a_cp2hp``) on the runtime's per-stage groups have
    not been run against stock megatron-core (docs/runtime.md); Megatron-LM runs them. Without CP the runtime builds
    both (on CPU on ``patches/mamba_cpu.py``'s and ``patches/gdn_cpu.py``'s torch kernels)."""
    kinds = without_runtime_cp(plan.model)
    if not kinds:
        return None
    for i, st in enumerate(plan.stages):
        if st.cp > 1:
            return (f"stages[{i}].cp ({st.cp}): the aceso runtime does not run {kinds[0].no_runtime_cp} under context "
                    "parallelism yet; use cp 1, or search with --target megatron-lm and export the plan")
    return None


def flex_on_cpu(plan, device) -> str | None:
    if plan.model.moe is None or device.cuda or (plan.moe or MoEPlanSettings()).token_dispatcher != "flex":
        return None
    return ("settings.moe.token_dispatcher flex: DeepEP/HybridEP need CUDA, not available on CPU; use alltoall or "
            "allgather")


def expert_tp_alltoall_on_cpu(plan, device) -> str | None:
    if plan.model.moe is None or device.cuda or (plan.moe or MoEPlanSettings()).token_dispatcher != "alltoall":
        return None
    for i, st in enumerate(plan.stages):
        if expert_tp(st) > 1:
            return (f"stages[{i}].etp ({expert_tp(st)}) with the alltoall dispatcher on CPU "
                    "(settings.moe.token_dispatcher): megatron-core all-gathers uneven token counts over expert-TP, "
                    "which gloo cannot; use etp 1 or the allgather dispatcher")
    return None


def grouped_gemm_without_te(plan, device) -> str | None:
    if plan.model.moe is None or not device.cuda or device.te is not False:
        return None
    if not (plan.moe or MoEPlanSettings()).grouped_gemm:
        return None
    return ("settings.moe.grouped_gemm: megatron-core's grouped experts need transformer-engine, not importable here; "
            "set grouped_gemm false or install transformer-engine")


def tp_comm_overlap(plan, device) -> str | None:
    """transformer-engine's TP overlap: not without it, and ``initialize_ub`` builds one TP domain for the whole
    world (userbuffers and the TE version on a GPU machine are the runtime's ``fast_path.refusal``)."""
    if not plan.tp_comm_overlap:
        return None
    if device.te is False:
        where = "on CPU" if not device.cuda else "without transformer-engine"
        return f"{TP_OVERLAP_UNAVAILABLE} {where}; set it false"
    shapes = {(st.tp, st.cp, plan.micro_batch_per_rank(i)) for i, st in enumerate(plan.stages)}
    if len(shapes) > 1 or plan.stages[0].tp < 2:
        return ("settings.tp_comm_overlap: transformer-engine's initialize_ub builds one TP domain for the whole "
                "world, so every stage needs the same tp (> 1), cp and per-rank micro-batch (stages differ: "
                f"{sorted(shapes)}); set it false")
    return None


def stack_features(plan, device) -> str | None:
    """CUDA graphs, fine-grained activation offload and the fused cross-entropy (``plan.stack``) are Megatron-LM's."""
    if plan.stack is None:
        return None
    return ("settings.stack: the aceso runtime runs no CUDA graphs, fine-grained offload or cross-entropy fusion yet; run the "
            "plan with Megatron-LM (aceso export --to megatron-lm) or remove the field")


def optimizer(plan, device) -> str | None:
    s = plan.settings
    if s is not None and (why := precision_aware_refusal(s.precision_aware_optimizer)):
        return why
    return None if s is None else optimizer_refusal(s.optimizer)


def precision_aware_refusal(pa, what: str = "settings.precision_aware_optimizer") -> str | None:
    """The precision-aware optimizer (``pa``: a plan's ``PrecisionAwareOptimizer``, or a search's): the runtime builds
    its OptimizerConfig (its training-step builder) with none of the state dtypes, so the run would keep fp32 states
    where the plan is priced with the precision-aware ones."""
    if pa is None:
        return None
    return (f"{what}: the aceso runtime builds megatron-core's optimizer with fp32 states (its transformer-engine "
            "FusedAdam path has not run on a GPU); run the plan with Megatron-LM (search with --target megatron-lm, "
            "aceso export --to megatron-lm) or drop the setting")


def optimizer_refusal(name: str, what: str = "settings.optimizer") -> str | None:
    """The optimizer ``name`` (a plan's ``settings.optimizer``, a search's ``--optimizer``): Adam only."""
    if name == "adam":
        return None
    return (f"{what} ({name}): the aceso runtime runs Adam only; run the plan with Megatron-LM (search with --target "
            "megatron-lm, aceso export --to megatron-lm) or use adam")


def data_parallel(plan, device) -> str | None:
    """The runtime builds megatron-core's default rank order (tp-cp-ep-dp-pp) and no SHARP groups, and sizes DDP
    buckets by a bucket size (``data_parallel.runtime_refusal``)."""
    s = plan.settings
    why = runtime_refusal(s.data_parallel if s is not None else None)
    if why is None:
        return None
    if why[0] == "num_buckets":
        return (f"settings.data_parallel.num_buckets: {why[1]}; run the plan with Megatron-LM (aceso export --to "
                "megatron-lm) or give bucket_size instead")
    return (f"settings.data_parallel: {why[1]}; run the plan with Megatron-LM (aceso export --to megatron-lm) or "
            "remove settings.data_parallel.rank_order / sharp")



def overlap_p2p(plan, device) -> str | None:
    """The runtime's pipeline communicator runs the interleaved schedule's sends / receives synchronously (it refuses
    megatron-core's ``overlap_p2p_comm``), and the cost model prices a runtime plan so (``plan_view.run_settings``)."""
    s = plan.settings
    if s is None or not s.overlap_p2p_comm or all(len(st.chunks) == 1 for st in plan.stages):
        return None
    return ("settings.overlap_p2p_comm: the aceso runtime runs the interleaved schedule's pipeline sends and receives "
            "synchronously; remove the field (or set it false), or run the plan with Megatron-LM (aceso export --to "
            "megatron-lm)")
