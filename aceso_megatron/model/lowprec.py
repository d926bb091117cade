"""A plan's low-precision recipe (``settings.low_precision``, ``search/settings/precision.py``) in megatron-core's terms: the
``TransformerConfig`` fields, the per-layer FP8 / FP4 contexts, and what an environment cannot run.

``config_fields(low)``: the fields Megatron-LM core_v0.16.1's ``core_transformer_config_from_args`` sets from the
flags our export writes (``search.settings.precision.megatron_flags``: ``--fp8-format F --fp8-recipe R``,
``--fp4-format e2m1 --fp4-recipe nvfp4``, ``--fp8-param-gather`` / ``--fp4-param-gather``,
``--first-last-layers-bf16 --num-layers-at-start-in-bf16 N --num-layers-at-end-in-bf16 M``): each flag is a
``TransformerConfig`` field of the same name (``--fp8-format`` -> ``fp8``, ``--fp4-format`` -> ``fp4``; the
parameter flags -> ``fp8_param`` / ``fp4_param``), and the fields the export leaves out take Megatron-LM's
argparse defaults, which are the dataclass defaults (``ArgumentGroupFactory``): ``fp8_margin`` 0,
``fp8_interval`` 1, ``fp8_amax_history_len`` 1, ``fp8_amax_compute_algo`` most_recent, ``fp8_wgrad`` True, the FP8
attention options off, ``num_layers_at_start/end_in_bf16`` 1 when ``first_last_layers_bf16`` is off.
Checked against Megatron-LM's parser by tests/runtime/test_lowprec_oracle.py.

Per layer: megatron-core's ``TransformerBlock`` enters ``get_fp8_context(config, layer_no)`` (FP4:
``get_fp4_context``) around each layer, ``layer_no`` the *global* 0-based layer index, and for the delayed recipe
one context around the whole block instead (its amax reduction runs once per pass). Which layers stay bf16 is
``is_first_last_bf16_layer(config, layer_no)``: ``layer_no < start`` or ``layer_no >= config.num_layers - end``,
read off ``config.num_layers``. The runtime's stage configs keep the model's ``num_layers`` and its units their
global layer numbers (``model.layers``), so the same decision holds for every pipeline stage and chunk
(``block_context`` / ``layer_context``; ``init_context`` for the quantized-parameter build, as
``TransformerBlock.build_layer``).

``refusal(env, plan)``: a recipe needs CUDA and transformer-engine (its versions as megatron-core 0.16.1's
``fp8_utils.get_fp8_recipe`` / ``fp4_utils.get_fp4_recipe`` require them) and a GPU with the recipe's tensor cores;
refused before any process group, one line.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

from search.settings.precision import megatron_flags, recipe

# what each exported flag sets (core_v0.16.1: the TransformerConfig field of that argparse dest)
_FLAG_FIELDS = {"--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe", "--fp8-param-gather": "fp8_param",
                "--fp4-format": "fp4", "--fp4-recipe": "fp4_recipe", "--fp4-param-gather": "fp4_param",
                "--first-last-layers-bf16": "first_last_layers_bf16",
                "--num-layers-at-start-in-bf16": "num_layers_at_start_in_bf16",
                "--num-layers-at-end-in-bf16": "num_layers_at_end_in_bf16"}
# Megatron-LM's defaults for the recipe fields the export does not write (TransformerConfig's dataclass defaults)
DEFAULTS = {"fp8": None, "fp8_recipe": "delayed", "fp8_param": False, "fp8_margin": 0, "fp8_interval": 1,
            "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True,
            "fp8_dot_product_attention": False, "fp8_multi_head_attention": False, "fp4": None,
            "fp4_recipe": "nvfp4", "fp4_param": False, "first_last_layers_bf16": False,
            "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
# transformer-engine versions megatron-core 0.16.1 needs for each recipe (fp8_utils / fp4_utils)
TE_MIN = {"fp8-delayed": (1, 0), "fp8-tensorwise": (2, 2), "fp8-blockwise": (2, 3), "mxfp8": (2, 1),
          "nvfp4": (2, 7)}
# compute capability of each recipe's tensor cores (FP8: Ada/Hopper; block-scaled MXFP8 / NVFP4: Blackwell)
MIN_CC = {"fp8-delayed": (8, 9), "fp8-tensorwise": (8, 9), "fp8-blockwise": (9, 0), "mxfp8": (10, 0),
          "nvfp4": (10, 0)}


def config_fields(low) -> dict:
    """The ``TransformerConfig`` recipe fields of ``low`` (a ``LowPrecision``; None: no recipe, the defaults)."""
    out = dict(DEFAULTS)
    if low is None:
        return out
    flags = megatron_flags(low.recipe, low.param_gather, low.bf16_layers_start, low.bf16_layers_end)
    i = 0
    while i < len(flags):
        field = _FLAG_FIELDS[flags[i]]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            out[field] = int(value) if field.startswith("num_layers") else value
            i += 2
        else:
            out[field] = True
            i += 1
    return out


def _context(config, layer_no: int, is_init: bool = False):
    if config.fp8:
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(config, layer_no, is_init=is_init)
    if config.fp4:
        from megatron.core.fp4_utils import get_fp4_context

        return get_fp4_context(config, layer_no, is_init=is_init)
    return nullcontext()


def _delayed(config) -> bool:
    return bool(config.fp8) and config.fp8_recipe == "delayed"


def block_context(config):
    """The context around a chunk's layers (``TransformerBlock.forward``'s outer one: delayed scaling only)."""
    return _context(config, -1) if _delayed(config) else nullcontext()


def layer_context(config, layer_no: int):
    """The context around global layer ``layer_no`` (bf16 for the first / last layers kept; none under delayed
    scaling, whose context is the block's)."""
    return nullcontext() if _delayed(config) else _context(config, layer_no)


def init_context(config, layer_no: int):
    """The context a layer is built in: quantized parameters (``fp8_param`` / ``fp4_param``), as megatron-core."""
    return _context(config, layer_no, is_init=True)


def bf16_layers(config, layers) -> list[int]:
    """Which of global layers ``layers`` run their GEMMs in bf16 under ``config``: megatron-core's decision."""
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return [n for n in layers if not (config.fp8 or config.fp4) or is_first_last_bf16_layer(config, n)]


def entered(*contexts) -> ExitStack:
    """An ``ExitStack`` with ``contexts`` entered (the chunk's rng fork and its block context)."""
    stack = ExitStack()
    for c in contexts:
        stack.enter_context(c)
    return stack


def refusal(env, plan) -> str | None:
    """One line naming why ``env`` cannot run ``plan``'s recipe, or None (no recipe, or it can)."""
    from .fast_path import _version

    low = plan.settings.low_precision if plan.settings is not None else None
    if low is None:
        return None
    what = f"settings.low_precision ({low.recipe})"
    if not env.cuda or not env.te:
        return (f"{what}: FP8 / FP4 GEMMs run through transformer-engine on a GPU, "
                f"{'not on CPU' if not env.cuda else 'which is not importable here'}; run the plan on GPUs with "
                "transformer-engine, or search it in bf16 (--precision bf16)")
    if _version(env.te_version)[:2] < TE_MIN[low.recipe]:
        need = ".".join(map(str, TE_MIN[low.recipe]))
        return (f"{what}: megatron-core 0.16.1 runs it with transformer-engine >= {need} (here "
                f"{env.te_version}); upgrade transformer-engine or choose another recipe")
    cc = env.compute_capability
    if cc is not None and cc < MIN_CC[low.recipe]:
        return (f"{what}: needs {recipe(low.recipe).gemm.upper()} tensor cores of compute capability "
                f"{'.'.join(map(str, MIN_CC[low.recipe]))} (this GPU: {cc[0]}.{cc[1]}); choose a recipe it has")
    if plan.model.params_dtype != "bf16":
        return (f"{what} with model.params_dtype {plan.model.params_dtype}: the recipes train in bf16 "
                "(Megatron-LM --bf16); set params_dtype bf16")
    if plan.model.is_t5:
        return f"{what}: the runtime runs recipes on GPT models only (T5's two stacks are not numbered as one)"
    if low.param_gather:
        return (f"{what}: param_gather (parameters stored quantized) is not run by the aceso runtime yet "
                "(its plan-independent initialisation writes bf16 weights); set param_gather false")
    return None
