"""What differs between the megatron-core releases the runtime runs on, in one module.

Supported: megatron-core 0.16.1 (Python 3.11 or 3.12) and 0.19.x (Python 3.12; tested on 0.19.2). The runtime,
the layer-spec builders and the tests ask here instead of testing versions themselves; the patches (``patches/``)
state and test the versions they support and branch inside themselves where megatron-core moved what they change.
Each function names the difference it hides:

- ``mlp_class`` / ``mlp_submodules`` / ``with_mlp_class`` / ``mlp_on_group``: a ``TransformerLayer``'s ``mlp``
  slot. 0.16.1: a ``ModuleSpec`` (``module=MLP``, ``submodules=MLPSubmodules``). 0.19: a builder called with
  ``config, pg_collection, is_mtp_layer, name`` -- ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` in the
  stock specs, ``partial(MoELayer, submodules=...)`` for MoE; a ``ModuleSpec`` of ``MLP`` itself is rewrapped so by
  ``TransformerLayer``, one of a subclass is not (``mlp_on_group`` rewraps it: 0.16-style user specs run on 0.19).
- ``mtp_layer_spec``: ``get_mtp_layer_spec_for_backend``'s keyword (``transformer_layer_spec`` ->
  ``mtp_model_layer_spec``); 0.16.1's MTP layer builds its inner layer and ``eh_proj`` without the stage's groups.
- ``save_mtp_loss`` / ``mtp_tracker_key``: ``MTPLossLoggingHelper.save_loss_to_tracker`` ->
  ``save_metrics_to_tracker`` (with acceptance counts), its tracker's ``values`` -> ``loss_values``.
- ``mtp_loss_scale``: 0.19's ``process_mtp_loss`` under ``calculate_per_token_loss`` scales layer ``j``'s masked
  loss by (tokens before rolling / tokens after rolling ``j + 1``); 0.16.1's ``_postprocess`` does not.
- ``param_and_grad_buffer``: ``_ParamAndGradBuffer(params -> params_with_names, param_layout)``; 0.19 computes the
  distributed optimizer's padded layout outside the buffer (``DistributedOptimizer._compute_per_buffer_param_layout``).
- ``fsdp_class``: ``FullyShardedDataParallel``; 0.16.1's ``_fix_tensor_parallel_attributes`` reads the global TP
  groups (run with the stage's set there, skipped without transformer-engine), 0.19 annotates parameters itself.
- ``quiet_cuda_build_notices``: torch's CUDA build (the only cp312 torch on PyPI) on a machine without a GPU logs
  "No CUDA runtime is found, using CUDA_HOME=..." when ``torch.utils.cpp_extension`` is first imported (0.19's
  megatron-core imports it) wherever a CUDA toolkit or ``nvcc`` is found; torch's CPU wheel (0.16.1's stack) does not.
- ``quiet_ddp_layout_notice``: 0.19's ``DistributedDataParallel`` warns on every rank that it computes the
  distributed optimizer's buffer layout itself when not given one (``full_param_layout``), which it then does.
- ``have_hybrid``: ``megatron.core.models.hybrid`` (``HybridModel``, ``HybridStack``; 0.19), which the stage model
  builds its layers on where present.
- ``reset_moe_metrics``: megatron-core's process-wide MoE aux-loss log, sized by the first MoE model's layers (and
  MTP depths) that logs into it: 0.19 ``moe_logging``'s ``MoEMetricsTracker``, 0.16.1 ``moe_utils``' dict.
- ``update_router_expert_bias``: ``_update_router_expert_bias``'s group: 0.19 takes ``tp_dp_cp_group``, 0.16.1
  reads the global ``parallel_state`` TP x DP x CP group (the stage's set there for the call).
- ``shared_mtp_refusal``: ``TransformerConfig.mtp_use_repeated_layer`` (one MTP layer run at every depth; 0.17 on),
  which 0.16.1 has not.

Torch and megatron-core are imported on first use, so importing this module imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import warnings

SUPPORTED = ("0.16.1", "0.19")   # a release, or a series (0.19.x); patches name the exact versions they were tested on


class _DropMessage(logging.Filter):
    """Drops a logger's records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def _drop(logger_name: str, flt: _DropMessage) -> None:
    logger = logging.getLogger(logger_name)   # before the module exists: its logger keeps the filter
    if flt not in logger.filters:
        logger.addFilter(flt)


_NO_CUDA_NOTICE = _DropMessage("No CUDA runtime is found")
# 0.19's DDP asks its callers to compute the distributed optimizer's buffer layout themselves and computes the same
# one when they do not (the runtime lets it: DDP knows its parameters and buckets best)
_DDP_LAYOUT_NOTICE = _DropMessage("DistributedDataParallel: full_param_layout not provided")


def quiet_cuda_build_notices() -> None:
    """Silence what torch's CUDA build says at import on a machine without a GPU (before torch is imported; idempotent):
    the "No CUDA runtime is found" log line of ``torch.utils.cpp_extension`` and the "CUDA initialization" warning of
    ``torch.cuda``. Nothing a user can act on, and it would break a one-line error (bad input: one line, exit 2)."""
    _drop("torch.utils.cpp_extension", _NO_CUDA_NOTICE)
    warnings.filterwarnings("ignore", message="CUDA initialization", category=UserWarning)


def quiet_ddp_layout_notice() -> None:
    """Drop 0.19 DDP's warning that it computes the distributed optimizer's layout itself (idempotent)."""
    _drop("megatron.core.distributed.distributed_data_parallel", _DDP_LAYOUT_NOTICE)


def version() -> str:
    """The installed megatron-core release (``patches._base.megatron_version``: without a ``+<git sha>`` suffix)."""
    from ._base import megatron_version

    return megatron_version()


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("rc")[0].split(".")[:3] if x.isdigit())


def at_least(v: str) -> bool:
    """The installed megatron-core is release ``v`` or newer."""
    return _release(version()) >= _release(v)


def have_hybrid() -> bool:
    return importlib.util.find_spec("megatron.core.models.hybrid") is not None


def reset_moe_metrics() -> None:
    """Drop megatron-core's MoE aux-loss log (module docstring), so a process that builds MoE models of other
    depths (a test running several plans) logs into a log of the model's size."""
    if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is not None:
        from megatron.core.transformer.moe.moe_logging import set_moe_metrics_tracker

        set_moe_metrics_tracker(None)
    else:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()


def shared_mtp_refusal(model) -> str | None:
    """Why this megatron-core cannot build ``model``'s shared MTP layer (``mtp_use_repeated_layer``: 0.17 on), one
    line; or None."""
    if not getattr(model, "mtp_use_repeated_layer", False) or at_least("0.17"):
        return None
    return (f"model.mtp_use_repeated_layer: megatron-core {version()} has no shared MTP layer (0.17 on): use the "
            "Python 3.12 stack (README), set it false, or export the plan (aceso export --to megatron-lm)")


# ----- a TransformerLayer's mlp slot ------------------------------------------------------------------------------
def mlp_class(mlp) -> type | None:
    """The module class an ``mlp`` slot builds: a ``ModuleSpec``'s ``module``, a class, or the class behind a
    0.19 builder (``partial(cls.as_mlp_submodule, ...)``, ``partial(MoELayer, ...)``); None for anything else."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp, ModuleSpec):
        mlp = mlp.module
    if isinstance(mlp, functools.partial):
        mlp = mlp.func
    owner = getattr(mlp, "__self__", None)   # a bound classmethod: as_mlp_submodule
    if isinstance(owner, type):
        return owner
    return mlp if isinstance(mlp, type) else None


def mlp_submodules(mlp):
    """The ``MLPSubmodules`` (or ``MoESubmodules``) an ``mlp`` slot builds with, or None."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords.get("submodules")
    return getattr(mlp, "submodules", None)


def _as_builder(mlp):
    """A 0.19 ``mlp`` slot for ``mlp``: a ``ModuleSpec`` of an ``MLP`` (sub)class becomes its ``as_mlp_submodule``
    builder with the spec's submodules and params (0.19 rewraps only ``MLP`` itself); anything else as given."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    cls = getattr(mlp, "module", None)
    if isinstance(mlp, ModuleSpec) and isinstance(cls, type) and issubclass(cls, MLP) \
            and hasattr(cls, "as_mlp_submodule"):
        return functools.partial(cls.as_mlp_submodule, submodules=mlp.submodules, **mlp.params)
    return mlp


def with_mlp_class(mlp, cls: type):
    """The ``mlp`` slot building ``cls`` instead, with the same submodules and parameters."""
    if isinstance(mlp, functools.partial):
        func = mlp.func
        if isinstance(getattr(func, "__self__", None), type):   # cls.as_mlp_submodule
            func = getattr(cls, func.__name__)
        else:
            func = cls
        return functools.partial(func, *mlp.args, **mlp.keywords)
    return dataclasses.replace(mlp, module=cls)


def mlp_on_group(mlp, tp_group):
    """An ``mlp`` slot of a user's ``MLP`` subclass built on ``tp_group``: 0.16.1's ``TransformerLayer`` passes its
    TP group to ``MLP`` itself only (a subclass's ``ModuleSpec`` gets it as a parameter here); 0.19 builds through
    ``as_mlp_submodule``, which passes ``pg_collection.tp`` (a 0.16-style ``ModuleSpec`` of a subclass becomes that
    builder: ``TransformerLayer`` rewraps only ``MLP``'s own)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if at_least("0.19"):
        return _as_builder(mlp)
    if isinstance(mlp, ModuleSpec) and "tp_group" not in mlp.params:
        return dataclasses.replace(mlp, params={**mlp.params, "tp_group": tp_group})
    return mlp


def build_mlp(mlp, config, layer_number: int, pg_collection=None):
    """The module an ``mlp`` slot builds on its own (outside a ``TransformerLayer``), as the layer builds it."""
    if isinstance(mlp, functools.partial):
        module = mlp(config=config, pg_collection=pg_collection, is_mtp_layer=False)
        if hasattr(module, "set_layer_number"):
            module.set_layer_number(layer_number)
        return module
    from megatron.core.transformer.spec_utils import build_module

    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return build_module(mlp, config=config, layer_number=layer_number, **kw)


# ----- multi-token prediction -------------------------------------------------------------------------------------
def mtp_layer_spec(layer_spec, backend, pg_collection):
    """megatron-core's MTP layer spec around the decoder layer spec ``layer_spec``, built on ``pg_collection``:
    0.16.1 builds the inner transformer layer without ``pg_collection`` and ``eh_proj`` without ``tp_group`` (bound
    here); 0.19 passes both itself (binding them too would pass them twice)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_spec_for_backend
    from megatron.core.transformer.spec_utils import ModuleSpec

    if at_least("0.19"):
        return get_mtp_layer_spec_for_backend(mtp_model_layer_spec=layer_spec, backend=backend)
    layer_spec = dataclasses.replace(layer_spec, params={**layer_spec.params, "pg_collection": pg_collection})
    spec = get_mtp_layer_spec_for_backend(transformer_layer_spec=layer_spec, backend=backend)
    sub = spec.submodules
    eh_proj = ModuleSpec(module=sub.eh_proj, params={"tp_group": pg_collection.tp})
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, eh_proj=eh_proj))


def mtp_tracker_key() -> str:
    """The key of ``MTPLossLoggingHelper.tracker``'s per-layer loss tensor."""
    return "loss_values" if at_least("0.19") else "values"


def save_mtp_loss(loss, layer: int, num_layers: int, avg_group) -> None:
    """Log MTP layer ``layer``'s loss as megatron-core's helper does (0.19: with zero acceptance counts, which the
    runtime does not compute)."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as H

    if hasattr(H, "save_metrics_to_tracker"):
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        H.save_metrics_to_tracker(loss, zero, zero.clone(), layer, num_layers, avg_group=avg_group)
    else:
        H.save_loss_to_tracker(loss, layer, num_layers, avg_group=avg_group)


def mtp_loss_scale(original_tokens, rolled_tokens):
    """The factor on an MTP layer's masked per-token loss under ``calculate_per_token_loss`` (tensors or numbers):
    0.19 weighs it by the tokens before rolling over those left after; 0.16.1 by 1."""
    if not at_least("0.19"):
        return 1.0
    import torch

    return original_tokens / torch.clamp(torch.as_tensor(rolled_tokens), min=1)


# ----- DDP buffers ------------------------------------------------------------------------------------------------
def param_and_grad_buffer(ddp_config, param_dtype, grad_dtype, params, dp_group, bucket_size, param_to_name,
                          gradient_scaling_factor, param_indices, nccl_ub, pg_collection):
    """megatron-core's ``_ParamAndGradBuffer`` for ``params`` as its DDP builds one (0.19: with the distributed
    optimizer's padded layout, which DDP computes outside the buffer)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    if not at_least("0.19"):
        return _ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, params, dp_group, bucket_size,
                                   param_to_name, gradient_scaling_factor, param_indices, nccl_ub, pg_collection)
    layout = None
    if ddp_config.use_distributed_optimizer:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        layout = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp_group.size(),
                                                                       ddp_config, param_indices)
    return _ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, [(p, param_to_name[p]) for p in params],
                               dp_group, bucket_size, param_to_name, gradient_scaling_factor, param_indices,
                               nccl_ub, pg_collection, param_layout=layout)


# ----- Megatron FSDP ----------------------------------------------------------------------------------------------
def fsdp_class(tp_group, expt_tp_group) -> type:
    """megatron-core's ``FullyShardedDataParallel`` for a stage with these TP groups.

    0.16.1: ``_fix_tensor_parallel_attributes`` (it flags TP-duplicated transformer-engine ``TELinear`` and router
    weights, and expert weights of expert-TP > 1) reads the TP sizes from the global ``parallel_state`` groups, which
    the runtime never initialises: a subclass runs it with the stage's groups put there for the call. Without
    transformer-engine it cannot run at TP > 1 (``isinstance`` on the ``TELinear`` placeholder raises) and has
    nothing to flag in a dense model: skipped. 0.19 annotates each parameter's TP mode from its module
    (``_annotate_tensor_parallelism``, no globals): the class as it is."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as a

    if not hasattr(a.FullyShardedDataParallel, "_fix_tensor_parallel_attributes"):
        return a.FullyShardedDataParallel

    class StageFSDP(a.FullyShardedDataParallel):
        def _fix_tensor_parallel_attributes(self, module):
            if not isinstance(getattr(a, "TELinear", None), type):
                return
            with _global_groups(_TENSOR_MODEL_PARALLEL_GROUP=tp_group, _EXPERT_TENSOR_PARALLEL_GROUP=expt_tp_group):
                super()._fix_tensor_parallel_attributes(module)

    return StageFSDP


@contextlib.contextmanager
def _global_groups(**groups):
    """megatron-core's global ``parallel_state`` groups named (``_TENSOR_MODEL_PARALLEL_GROUP=...``) set to a
    stage's for the call, restored after."""
    from megatron.core import parallel_state as ps

    saved = {name: getattr(ps, name) for name in groups}
    for name, group in groups.items():
        setattr(ps, name, group)
    try:
        yield
    finally:
        for name, group in saved.items():
            setattr(ps, name, group)


# ----- the router's expert bias -----------------------------------------------------------------------------------
def update_router_expert_bias(model_chunks, config, tp_dp_cp_group) -> None:
    """megatron-core's end-of-batch expert-bias step (``finalize_model_grads._update_router_expert_bias``: the
    routers' ``local_tokens_per_expert`` all-reduced, each bias moved by ``moe_router_bias_update_rate`` towards
    balance) with the tokens counted over ``tp_dp_cp_group``. 0.19 takes the group; 0.16.1's
    ``get_updated_expert_bias`` reads the global TP x DP x CP group, which the runtime never initialises: the
    stage's is set there for the call."""
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")   # the module, not the function
    if "tp_dp_cp_group" in inspect.signature(fmg._update_router_expert_bias).parameters:
        fmg._update_router_expert_bias(model_chunks, config, tp_dp_cp_group=tp_dp_cp_group)
        return
    with _global_groups(_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP=tp_dp_cp_group):
        fmg._update_router_expert_bias(model_chunks, config)
