"""The runtime's half of the one pre-flight (``search.targets.preflight``): what only torch and megatron-core can answer.

``preflight(plan, device, here)``: the model's layer specs and ``megatron`` block built into a stage config the way
the run builds it (``model.layers.check_model``: providers importable and transformer-engine-free on CPU, layers
carvable or kept whole, QK norms declared, names and types against ``TransformerConfig``; for a CPU run, one layer
of a user's layer spec built on the meta device, ``model.build_check``: a module that needs CUDA), einops for
Megatron FSDP, then, for a run on this machine (``here``), the plan against this machine's environment
(``training.engine.check_plan``: a recipe's transformer-engine version and tensor cores, userbuffers, fp16). What
needs no torch (MoE, MLA / MTP, Megatron FSDP, what a CPU cannot run) is the capability table's
(``search.targets.capabilities``), which ``search.targets.preflight`` applies before this, torch or not. A plan checked elsewhere (``aceso validate`` of a GPU plan on a
laptop) is not held to this machine's environment, nor to its megatron-core's version (``installed_refusal``: a
hybrid model needs 0.19, a shared MTP layer 0.17; on the GPUs the workers check theirs). Before any process group
exists; one ``AcesoError`` line.
"""

from __future__ import annotations

import importlib.util


def preflight(plan, device: str, here: bool = False) -> bool:
    """Refuse what the runtime would not run; returns False when it could not tell (a GPU plan's transformer-engine
    spec checked on a machine without transformer-engine: the workers on the GPUs check it)."""
    import warnings

    from search.io.errors import AcesoError

    from .errors import bad_input_from_patches

    with bad_input_from_patches(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # megatron-core's import-time "X is not installed" notes
        from model_specs.extensions import TE_MISSING

        from .model.build_check import check_layers_build
        from .model.layers import check_model, installed_refusal

        elsewhere = not here and device == "cuda" and not _has_cuda()
        if elsewhere and installed_refusal(plan.model) is not None:
            return False     # this machine's megatron-core cannot build it; the GPUs' own is the workers' to check
        try:
            check_model(plan, "cpu" if elsewhere else device)
        except AcesoError as e:
            if elsewhere and TE_MISSING in str(e):
                return False
            raise
        check_layers_build(plan.model, device)   # a CPU run: one layer of a user's spec built on the meta device

        if (msg := fsdp_machine_refusal(plan)) is not None:    # what of Megatron FSDP needs a package (einops)
            raise AcesoError(msg)
        if here:
            from .model.fast_path import Environment

            if (msg := refusal(Environment.detect(device), plan)) is not None:   # the runtime entry's check
                raise AcesoError(msg)
    return True


def refusal(env, plan) -> str | None:
    """Why this runtime does not run ``plan`` on a machine of environment ``env`` (``model.fast_path.Environment``;
    None: what no machine runs), one line, or None. Torch-free: the runtime's entry check (``training.engine
    .check_plan``, before any process group). The capability table's runtime rules on this device
    (``search.targets.capabilities.plan_refusal``, the same lines validate, the search's output check and launch give;
    its ``built`` rows, which ``build_runtime`` runs for the GPU tests, skipped), then what only the machine tells:
    a recipe's transformer-engine version and tensor cores, userbuffers (``fast_path.refusal``), einops for Megatron
    FSDP, and fp16 on any GPU (no loss scaling; the table refuses it on the plan's GPU where that has bf16)."""
    from search.targets.capabilities import RUNTIME, Device, plan_refusal
    from search.targets.runtime_rules import fp16_loss_scaling

    device = Device(cuda=True, te=None) if env is None else Device(cuda=env.cuda, te=env.te)
    if (why := plan_refusal(plan, RUNTIME, device, entry=True)) is not None or env is None:
        return why
    from .model.fast_path import refusal as machine_refusal

    return (machine_refusal(env, plan) or fsdp_machine_refusal(plan)
            or (fp16_loss_scaling(plan.model.params_dtype) if env.cuda else None))


def fsdp_machine_refusal(plan) -> str | None:
    """Megatron FSDP on a machine without einops (megatron-core's device mesh needs it), or None."""
    if plan.megatron_fsdp is None or importlib.util.find_spec("einops") is not None:
        return None
    return ("megatron_fsdp: megatron-core's FullyShardedDataParallel needs einops, which is not installed; "
            "pip install einops")


def _has_cuda() -> bool:
    """A GPU plan checked on a machine without one (``aceso validate`` on a laptop) builds its configs as CPU ones:
    the layer specs and megatron block are checked all the same; the GPU's environment is the worker's to check."""
    import torch

    return torch.cuda.is_available()
