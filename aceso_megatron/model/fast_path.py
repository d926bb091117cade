"""Which of megatron-core's fast paths a run uses: one pure function from a description of the environment
and the plan to the layer-spec builder and ``TransformerConfig`` options (torch-free, unit-tested on CPU).

``choose(env, model, tp_comm_overlap=...) -> FastPath``; ``Environment.detect()`` fills the description on the running machine
(the only impure part); ``refusal(env, plan)`` names a plan feature this environment cannot run (the runtime
refuses such a plan before any process group exists).

| option | on when | why / what it needs |
|---|---|---|
| transformer-engine layer specs | CUDA and TE importable | fused LayerNorm+GEMM, TE/flash attention, TP-overlap GEMMs |
| dtype | CUDA: the model's (bf16 presets); bf16 needs compute capability >= 8.0, else fp32 | CPU: fp32 |
| ``bias_activation_fusion`` | CUDA, and SwiGLU or GELU with biases; quick GEGLU where every MLP is a routed expert | megatron-core's jit-fused bias-GELU/SwiGLU (fused bias-GELU asserts ``add_bias_linear``); its quick-GEGLU kernel is the weighted one only (experts: ``per_token_scale``), a dense or shared-expert MLP raises "Only support fusion of gelu and swiglu" (``MLP.forward``, 0.16.1 and 0.19.2) |
| ``bias_dropout_fusion`` | CUDA | jit-fused bias + dropout + residual add |
| ``masked_softmax_fusion`` | CUDA and (TE specs, or apex's ``scaled_masked_softmax_cuda``) | local attention imports the apex kernel at the first call |
| ``apply_rope_fusion`` | CUDA, RoPE (not YaRN), TE >= 1.4 | TE's fused RoPE; YaRN's cos / sin scale is unfused only (megatron-core falls back with a warning per call; Megatron-LM turns the fusion off for ``--position-embedding-type yarn``) |
| ``gradient_accumulation_fusion`` | CUDA and (TE specs or apex's ``fused_weight_gradient_mlp_cuda``) | wgrad GEMM accumulates into ``main_grad``; local linears need the apex kernel, so the output layer (a local ``ColumnParallelLinear``) gets it only with apex (``output_layer_grad_accum_fusion``) |
| low-precision recipe (``settings.low_precision``) | CUDA, TE (>= the recipe's version), the recipe's tensor cores | ``model.lowprec``: megatron-core's fp8 / fp4 config fields and per-layer contexts; refused otherwise |
| ``tp_comm_overlap`` | the plan asks, CUDA, TE >= 1.9 with userbuffers | TE's ``initialize_ub`` builds one TP domain per block of ``tp`` ranks of the world: every stage needs the same tp, cp and per-rank micro-batch |

Recompute stays exact with fusions: a selective MLP unit keeps its activation unfused (``model.config.unit_config``
turns ``bias_activation_fusion`` off for it), because megatron-core's MLP calls the fused kernel directly and
would bypass the ``CheckpointedActivation`` that frees the activation output; ``attn_dropout`` with TE's fused
attention runs as ``none`` (nothing to free). Fusions change no parameter: a checkpoint or profile made with them
loads in a run without them (TE's fused LayerNorm weights map to the local norms' canonical names,
``stage_model.canonical_names``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan
from search.spec.rope_scaling import yarn_on_standard_attention

APEX_SOFTMAX = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
APEX_GRAD_ACCUM = "fused_weight_gradient_mlp_cuda"


def _version(v: str | None) -> tuple[int, ...]:
    """``"1.13.0.dev0+abc"`` -> ``(1, 13, 0)``: the leading dotted numbers."""
    m = re.match(r"\d+(?:\.\d+)*", v or "")
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _bias_activation_fusion(m: ModelSpec) -> bool:
    """Whether megatron-core's fused bias-activation kernels run ``m``'s MLPs (module table)."""
    if m.activation == "quick_geglu":
        moe = m.moe
        return (moe is not None and not moe.moe_shared_expert_intermediate_size
                and all(moe.is_moe_layer(i) for i in range(m.num_layers)))
    return m.activation == "swiglu" or m.add_bias_linear


def no_cuda_message(torch) -> str:
    """Why a GPU run cannot start on this machine, and the fix (one line)."""
    why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
           else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU (driver, CUDA_VISIBLE_DEVICES)")
    return f"no CUDA device: {why}; add --cpu to run CPU processes (gloo, fp32), or run it on a GPU node"


@dataclass(frozen=True)
class Environment:
    """What the running machine offers (``detect()``), or a hand-written one in tests."""

    cuda: bool
    te_version: str | None = None  # transformer-engine's version when importable
    apex_kernels: frozenset[str] = frozenset()  # importable apex CUDA extensions (APEX_SOFTMAX, APEX_GRAD_ACCUM)
    compute_capability: tuple[int, int] | None = None
    te_userbuffers: bool = False  # transformer_engine.pytorch.module.base.initialize_ub exists

    @classmethod
    def detect(cls, device: str) -> Environment:
        """The description of this machine for a run on ``device`` ("cpu": CPU whatever is installed)."""
        import importlib.util

        if device == "cpu":
            return cls(cuda=False)
        import torch

        if not torch.cuda.is_available():   # a CUDA run asked for on a machine without one: the user's to fix
            from search.io.errors import AcesoError

            raise AcesoError(no_cuda_message(torch))

        te = None
        userbuffers = False
        try:
            import transformer_engine
            from transformer_engine.pytorch.module import base as te_base

            te = getattr(transformer_engine, "__version__", "0")
            userbuffers = hasattr(te_base, "initialize_ub")
        except ImportError:
            pass
        kernels = frozenset(k for k in (*APEX_SOFTMAX, APEX_GRAD_ACCUM) if importlib.util.find_spec(k) is not None)
        return cls(cuda=True, te_version=te, apex_kernels=kernels,
                   compute_capability=tuple(torch.cuda.get_device_capability()), te_userbuffers=userbuffers)

    @property
    def te(self) -> bool:
        return self.te_version is not None


@dataclass(frozen=True)
class FastPath:
    """The choice for one run: layer specs, dtype, config options, and why anything is off."""

    spec: str  # "te" | "local"
    dtype: str  # "fp32" | "bf16" | "fp16"
    config: dict[str, bool]  # TransformerConfig fields
    output_layer_grad_accum_fusion: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def te(self) -> bool:
        return self.spec == "te"


OFF = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "masked_softmax_fusion": False,
       "apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
       "cross_entropy_loss_fusion": False, "tp_comm_overlap": False}


def choose(env: Environment, model: ModelSpec, tp_comm_overlap: bool = False) -> FastPath:
    """The fast paths this environment runs ``model`` with (see the module table); ``tp_comm_overlap``: the
    plan asks for it (check ``refusal`` first: it is assumed possible)."""
    m = model
    if not env.cuda:
        return FastPath("local", "fp32", dict(OFF), notes=("CPU: fp32, every fusion off (fused kernels are "
                                                           "CUDA-only)",))
    notes = []
    dtype = m.params_dtype
    if dtype == "bf16" and env.compute_capability is not None and env.compute_capability < (8, 0):
        dtype = "fp32"
        notes.append(f"bf16 needs compute capability 8.0 (this GPU: {env.compute_capability}): fp32")
    apex_softmax = all(k in env.apex_kernels for k in APEX_SOFTMAX)
    apex_accum = APEX_GRAD_ACCUM in env.apex_kernels
    cfg = dict(OFF)
    cfg["bias_activation_fusion"] = _bias_activation_fusion(m)
    cfg["bias_dropout_fusion"] = True
    cfg["masked_softmax_fusion"] = env.te or apex_softmax
    cfg["apply_rope_fusion"] = (m.position_embedding == "rope" and not yarn_on_standard_attention(m)
                                and _version(env.te_version) >= (1, 4))
    cfg["gradient_accumulation_fusion"] = env.te or apex_accum
    cfg["tp_comm_overlap"] = tp_comm_overlap and env.te_userbuffers
    if not env.te:
        notes.append("transformer-engine not importable: megatron-core's local specs (unfused attention)")
    if not cfg["masked_softmax_fusion"]:
        notes.append("masked softmax unfused: needs transformer-engine or apex's scaled_masked_softmax_cuda")
    if not cfg["gradient_accumulation_fusion"]:
        notes.append("gradient-accumulation fusion off: needs transformer-engine or apex's "
                     f"{APEX_GRAD_ACCUM}")
    return FastPath("te" if env.te else "local", dtype, cfg, output_layer_grad_accum_fusion=apex_accum,
                    notes=tuple(notes))


def refusal(env: Environment, plan: ParallelPlan) -> str | None:
    """One line naming what of ``plan`` this machine's software cannot run, or None: the recipe's needs (CUDA,
    transformer-engine's version, tensor cores) and a transformer-engine without userbuffers. What the capability
    table decides from the device alone (context parallelism and TP overlap need transformer-engine, one TP domain)
    is asked before this (``aceso_megatron.preflight.refusal``)."""
    from search.targets.runtime_rules import TP_OVERLAP_UNAVAILABLE

    from .lowprec import refusal as recipe_refusal

    if (msg := recipe_refusal(env, plan)) is not None:   # FP8 / FP4: CUDA, transformer-engine, tensor cores
        return msg
    if plan.tp_comm_overlap and env.te and (not env.te_userbuffers or _version(env.te_version) < (1, 9)):
        return f"{TP_OVERLAP_UNAVAILABLE} (this transformer-engine lacks it); set it false"
    return None
