"""The stack switches both ways with Megatron-LM (flags) and Megatron-Bridge (``model`` / ``optimizer`` fields):
CUDA graphs, fine-grained activation offload, the cross-entropy fusion (``search/settings/stack.py``) and the optimizer.

Megatron-LM core_v0.16.1 flags (``arguments.py``; megatron-core ``TransformerConfig`` names): ``--cuda-graph-impl
none|local|transformer_engine``, ``--cuda-graph-scope S ...`` (0.18+: ``--cuda-graph-modules``, read too; the export
writes the target release's name, ``versions.RENAMED``; ``mamba`` in both: ``stack.py``),
``--fine-grained-activation-offloading --offload-modules M ...`` (0.19: ``--activation-offload-fraction F``),
``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native|te``, ``--optimizer adam|muon|dist_muon``.
Megatron-LM's checks a plan depends on: muon with ``--use-distributed-optimizer`` (megatron-core 0.16.1
``get_megatron_muon_optimizer``: "muon with dist optimizer is not supported") or with Megatron FSDP ("Emerging
optimizer does not support Megatron-FSDP") is refused; the stack rules of ``stack.refusal`` apply to the plan.
"""

from __future__ import annotations

from search.io.errors import AcesoError
from search.settings.stack import (GRAPH_SCOPES, OFFLOAD_MODULES, CudaGraphs, FineGrainedOffload, StackSettings,
                                   moe_recompute_offload_refusal, offload_graphs_refusal)

FLAG_KINDS: dict[str, str] = {
    "--cuda-graph-impl": "str", "--cuda-graph-scope": "list", "--cuda-graph-modules": "list",
    "--offload-modules": "list", "--activation-offload-fraction": "float", "--cross-entropy-fusion-impl": "str",
    "--optimizer": "str", "--fine-grained-activation-offloading": "bool", "--cross-entropy-loss-fusion": "bool",
    "--megatron-fsdp-main-params-dtype": "str", "--megatron-fsdp-main-grads-dtype": "str",
}
OPTIMIZERS = ("adam", "muon", "dist_muon")


def stack_fields(f, model, distributed_optimizer: bool, fsdp: bool,
                 notes: list[str]) -> tuple[StackSettings | None, str]:
    """(the plan's ``StackSettings`` or None, the optimizer) of the stack flags."""
    optimizer = f.get("--optimizer", "adam")
    if optimizer not in OPTIMIZERS:
        raise AcesoError(f"--optimizer {optimizer}: aceso prices {', '.join(OPTIMIZERS)}; use one of them")
    if optimizer != "adam" and distributed_optimizer:
        raise AcesoError(f"--optimizer {optimizer} with --use-distributed-optimizer: megatron-core 0.16.1 raises "
                         "'muon with dist optimizer is not supported'; drop --use-distributed-optimizer "
                         "(dist_muon shards the states layer-wise)")
    if optimizer != "adam" and fsdp:
        raise AcesoError(f"--optimizer {optimizer} with --use-megatron-fsdp: Megatron-LM asserts 'Emerging optimizer "
                         "does not support Megatron-FSDP'; use adam or drop Megatron FSDP")
    graphs = _graphs(f, notes)
    offload = None
    if f.has("--fine-grained-activation-offloading"):
        mods = f.get("--offload-modules") or []
        if not mods:
            raise AcesoError("--fine-grained-activation-offloading needs --offload-modules (megatron-core asserts "
                             f"a non-empty list: {', '.join(OFFLOAD_MODULES)})")
        bad = [m for m in mods if m not in OFFLOAD_MODULES]
        if bad:
            raise AcesoError(f"--offload-modules {bad[0]}: not one of {', '.join(OFFLOAD_MODULES)}")
        frac = f.get("--activation-offload-fraction", 1.0)
        if not 0.0 <= frac <= 1.0:
            raise AcesoError(f"--activation-offload-fraction {frac:g}: must be in [0, 1]")
        offload = FineGrainedOffload(modules=tuple(dict.fromkeys(mods)), fraction=float(frac))
        _offload_rules(f, graphs, offload.modules, notes)
    elif f.has("--offload-modules") or f.has("--activation-offload-fraction"):
        notes.append("--offload-modules / --activation-offload-fraction without --fine-grained-activation-offloading "
                     "do nothing")
    ce = None
    if f.has("--cross-entropy-loss-fusion"):
        ce = f.get("--cross-entropy-fusion-impl", "native")
        if ce not in ("native", "te"):
            raise AcesoError(f"--cross-entropy-fusion-impl {ce}: use native or te")
    stack = StackSettings(cuda_graphs=graphs, offload=offload, cross_entropy_fusion=ce)
    return (None if stack.empty else stack), optimizer


OFFLOAD_NEEDS_TE = ("--fine-grained-activation-offloading with --transformer-impl local: Megatron-LM core_v0.16.1 to "
                    "core_v0.19.0 assert 'Fine-grained activation offloading is only supported with transformer_engine "
                    "implementation'; use --transformer-impl transformer_engine or drop the offload")
INFERENCE_PAD = "--moe-pad-experts-for-cuda-graph-inference"


def needs_inference_pad(rel, stack: StackSettings | None, ep: int) -> bool:
    """Whether ``rel``'s validate_args asserts ``INFERENCE_PAD`` on a line with ``stack`` and expert parallelism
    ``ep``: megatron-core's own CUDA graphs (``--cuda-graph-impl local``) with ep > 1 before 0.18
    (``versions.RULES`` local_graphs_ep_need_no_inference_pad). The flag pads experts in inference only, so the
    export writes it where asserted and the training step is the one priced."""
    g = stack.cuda_graphs if stack is not None else None
    return g is not None and g.impl == "local" and ep > 1 and not rel.rule("local_graphs_ep_need_no_inference_pad")


def release_stack_refusal(rel, stack: StackSettings | None, ep: int, inference_pad: bool,
                          attention: str | None) -> str | None:
    """What ``rel``'s validate_args refuses of a line's stack switches beside its other flags (one line, None where
    it runs): the fine-grained offload with megatron-core's local layers (``attention`` unfused: ``--transformer-impl
    local``), local CUDA graphs with ep > 1 without ``INFERENCE_PAD`` where the release asserts it."""
    if stack is not None and stack.offload is not None and attention == "unfused":
        return OFFLOAD_NEEDS_TE
    if needs_inference_pad(rel, stack, ep) and not inference_pad:
        return (f"--cuda-graph-impl local with --expert-model-parallel-size {ep}: {rel.label}'s validate_args asserts "
                f"'{INFERENCE_PAD} must be set when using CUDA graphs with expert parallelism'; add {INFERENCE_PAD} "
                "(it pads experts in inference only: the training step is the same)")
    return None


def _offload_rules(f, graphs: CudaGraphs | None, modules: tuple[str, ...], notes: list[str]) -> None:
    """megatron-core's rules on the offload with the line's CUDA graphs and recompute modules, at the release the
    flags are read under (``stack.offload_graphs_refusal``, ``stack.moe_recompute_offload_refusal``: one-line
    errors); a note where the recompute leaves the offload less to move (priced so: ``costmodel.stack_cost.moves``)."""
    core = f.release.version
    why = offload_graphs_refusal(graphs.impl, graphs.scope, modules, core) if graphs is not None else None
    selective = f.has("--recompute-activations") or f.get("--recompute-granularity") == "selective"
    recomputed = (f.get("--recompute-modules") or ["core_attn"]) if selective else []
    if f.has("--moe-layer-recompute"):         # megatron-core appends moe to the modules (selective)
        recomputed = [*recomputed, "moe"]
    why = why or moe_recompute_offload_refusal(recomputed, modules, core)
    if why:
        raise AcesoError(why)
    if f.get("--recompute-granularity") == "full":
        notes.append("--fine-grained-activation-offloading with --recompute-granularity full: the checkpointed "
                     "layers save no module input to offload (megatron-core runs it); priced as moving nothing there")
    elif "core_attn" in recomputed and "core_attn" in modules:
        notes.append("--offload-modules core_attn with --recompute-modules core_attn: megatron-core offloads the "
                     "core attention's input only where it does not recompute it; priced as not moving it")


def _graphs(f, notes: list[str]) -> CudaGraphs | None:
    impl = f.get("--cuda-graph-impl", "none")
    if impl not in ("none", "local", "transformer_engine", "full_iteration"):
        raise AcesoError(f"--cuda-graph-impl {impl}: use none, local or transformer_engine")
    old, new = f.get("--cuda-graph-scope"), f.get("--cuda-graph-modules")
    if old is not None and new is not None:
        raise AcesoError("--cuda-graph-scope and --cuda-graph-modules cannot be used together (Megatron-LM asserts "
                         "it); give one")
    scope = list(new if new is not None else old or [])
    flag = "--cuda-graph-modules" if new is not None else "--cuda-graph-scope"
    if impl == "full_iteration":          # megatron-core 0.17+: its own implementation name
        impl, scope = "local", ["full_iteration"]
    if impl == "none":
        if scope:
            notes.append(f"--cuda-graph-scope {' '.join(scope)} with --cuda-graph-impl none does nothing")
        return None
    if scope == ["full"]:
        scope = []                        # megatron-core: "full" (deprecated) is the whole layer
    bad = [x for x in scope if x not in GRAPH_SCOPES]
    if bad:
        raise AcesoError(f"{flag} {bad[0]}: not a scope of megatron-core ({', '.join(GRAPH_SCOPES)}, or full)")
    if impl == "local" and ({"moe_router", "moe_preprocess"} & set(scope)):
        scope += [x for x in ("moe_router", "moe_preprocess") if x not in scope]   # local graphs both together
    return CudaGraphs(impl=impl, scope=tuple(dict.fromkeys(scope)))


def stack_args(stack: StackSettings | None, optimizer: str = "adam") -> list[str]:
    """The Megatron-LM flags of the stack switches and the optimizer (empty for none)."""
    out = ["--optimizer", optimizer] if optimizer != "adam" else []
    if stack is None:
        return out
    g = stack.cuda_graphs
    if g is not None:
        out += ["--cuda-graph-impl", g.impl]
        out += ["--cuda-graph-scope", *g.scope] if g.scope else []
        # validate_args asserts the NaN check off under a full_iteration graph (core_v0.16.1 arguments.py:725,
        # core_v0.19.0 :1195); the import reads the flag quietly (cmdline.QUIET)
        out += ["--no-check-for-nan-in-loss-and-grad"] if "full_iteration" in g.scope else []
    if stack.offload is not None:
        out += ["--fine-grained-activation-offloading", "--offload-modules", *stack.offload.modules]
        if stack.offload.fraction < 1.0:
            out += ["--activation-offload-fraction", f"{stack.offload.fraction:g}"]
    if stack.cross_entropy_fusion:
        out += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", stack.cross_entropy_fusion]
    return out


def stack_bridge_fields(stack: StackSettings | None) -> dict[str, object]:
    """The Bridge ``model`` fields (megatron-core ``TransformerConfig`` names) of the stack switches. The loss fusion
    is always stated: every Bridge recipe sets it on (``bridge.recipe_ce_fusion``), so a plan without it says
    ``cross_entropy_loss_fusion: false`` (else the recipe's fused loss would run, not the priced one)."""
    out: dict[str, object] = {"cross_entropy_loss_fusion": False}
    if stack is None:
        return out
    g = stack.cuda_graphs
    if g is not None:
        out.update(cuda_graph_impl=g.impl, cuda_graph_scope=list(g.scope) if g.scope else "full")
    if stack.offload is not None:
        out.update(fine_grained_activation_offloading=True, offload_modules=list(stack.offload.modules))
        if stack.offload.fraction < 1.0:
            out["activation_offload_fraction"] = stack.offload.fraction
    if stack.cross_entropy_fusion:
        out.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=stack.cross_entropy_fusion)
    return out
