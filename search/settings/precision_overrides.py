"""Per-module precision overrides: megatron-core's ``--te-precision-config-file`` as a plan field, parsed, written
and applied to each unit's linear layers.

megatron-core (core_v0.16.1 through core_v0.19.0: ``quantization/quant_config.py`` is byte-identical in the four,
``training/arguments.py`` ``--te-precision-config-file`` -> ``TransformerConfig.quant_recipe`` through
``load_quantization_recipe``; core_v0.19.0 ``training/argument_utils.py:365``) reads a YAML of named ``configs``
and ordered ``matchers``. After building the model, ``GPTModel`` / ``HybridModel`` (``MambaModel`` before 0.18) walk
``named_modules()`` and hand each transformer-engine linear the config its module path matches
(``get_quant_config_or_none``): ``RecipeConfig._build_matchers`` keeps the enabled matchers in file order
(``enabled`` defaults to False), ``match_to_config_key`` returns the first whose glob (``fnmatch`` on the full path,
``decoder.layers.3.self_attention.linear_qkv``) matches. ``TEQuantizationParams.parse_from_config``
(``extensions/transformer_engine.py``) reads ``transformer_engine_config_type: TEQuantizationParams`` and a
``training_recipe`` (``fp8_quantization_recipe`` tensorwise / blockwise / mxfp8, ``fp4_quantization_recipe`` nvfp4,
neither = bf16; delayed scaling refused). At run time ``_get_should_context_be_quantized_recipe``: the override
replaces the layer's recipe only where the layer's own context is quantized (``override_quantized_autocast`` True
by default); a layer that runs unquantized (a plain-dtype run, the first / last layers kept in bf16) stays so
(``override_nonquantized_autocast`` False by default; TransformerEngineMixedPrecision.md: "if the non-overridden
precision of a layer is non-quantized"): ``recipe_of``.

What aceso holds (``PrecisionOverride``, ``LowPrecision.per_module``): the enabled glob matchers in order, each with
the recipe of its config's training recipe. Refused in one line: other matcher types, ``custom_recipe_factory``,
``fp8_param`` / ``fp4_param``, non-default ``override_*_autocast`` or ``tp_only_amax_red``, other config types, and a
pattern that names a layer index (megatron-core matches the stage-local ``named_modules`` index, which moves with the
pipeline split: not priced). ``evaluation_recipe`` (validation only) and ``fp8_format`` (e4m3 / hybrid: priced the
same) are read and not kept.

A linear an override matches is also built under that config (``_get_fp8_model_init_for_quant_params``): its
weight is a bf16 parameter (``fp8_param`` False), whatever ``--fp8-param-gather`` says; ``UnitRecipes.matched``
names those linears, and the cost model charges their cached quantized copies at their own recipe
(``costmodel.analytic._override_params``).

The module paths of a unit's linears: ``unit_prefix`` (``decoder.layers.N.``, an MTP depth's inner layer
``mtp.layers.D.mtp_model_layer.``) and each kind's ``LayerKind.linears`` (``search/layers``). Routed experts are
named as ``TEGroupedMLP`` names them (``mlp.experts.linear_fc1``; ``SequentialMLP``'s
``mlp.experts.local_experts.E.linear_fc1`` is matched by the same ``*fc1*``-style patterns).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

OverrideRecipe = Literal["bf16", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]
_FP8 = {"tensorwise": "fp8-tensorwise", "blockwise": "fp8-blockwise", "mxfp8": "mxfp8"}
_FP4 = {"nvfp4": "nvfp4"}
_TE = "TEQuantizationParams"
_RECIPE_KEYS = {"fp8_quantization_recipe", "fp4_quantization_recipe", "fp8_format", "override_quantized_autocast",
                "override_nonquantized_autocast", "tp_only_amax_red", "custom_recipe_factory", "fp8_param",
                "fp4_param"}
_DEFAULTS = {"override_quantized_autocast": True, "override_nonquantized_autocast": False,
             "tp_only_amax_red": False, "fp8_param": False, "fp4_param": False, "custom_recipe_factory": None}
_LAYER_INDEX = re.compile(r"layers\.[0-9\[]")


class PrecisionOverride(BaseModel):
    """One enabled glob matcher of a ``--te-precision-config-file``: the linears whose module path matches
    ``pattern`` (fnmatch) run ``recipe`` (bf16: unquantized)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    pattern: str = Field(min_length=1, max_length=256, description="fnmatch glob on the module path "
                         "(decoder.layers.3.self_attention.linear_qkv).")
    recipe: OverrideRecipe = Field(description="The recipe of the matched linears (bf16: not quantized).")

    @field_validator("pattern")
    @classmethod
    def _no_layer_index(cls, v: str) -> str:
        if _LAYER_INDEX.search(v):
            raise ValueError("per_module pattern " + _index_why(v))
        return v


# the ordered overrides as a plan / spec field (LowPrecision.per_module, TrainingSpec.per_module); a file's JSON array
# is read as the tuple strict mode takes
PerModule = Annotated[tuple[PrecisionOverride, ...], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]


def _index_why(pattern) -> str:
    return (f"'{pattern}' names a layer index: megatron-core matches the stage-local named_modules index, which "
            "moves with the pipeline split (not priced); use patterns on module names (*.linear_qkv)")


def match(path: str, default: str | None, overrides) -> PrecisionOverride | None:
    """The override that sets the recipe of the linear at module ``path``: the first whose pattern matches, where
    the layer's own recipe ``default`` is quantized (None / "bf16": unquantized, left so); None: no override."""
    if default in (None, "bf16"):
        return None
    return next((o for o in overrides if fnmatch.fnmatch(path, o.pattern)), None)


def recipe_of(path: str, default: str | None, overrides) -> str | None:
    """The recipe the linear at module ``path`` runs: its override's (``match``), else ``default``. None = bf16."""
    o = match(path, default, overrides)
    if o is None:
        return None if default in (None, "bf16") else default
    return None if o.recipe == "bf16" else o.recipe


@dataclass(frozen=True)
class UnitRecipes:
    """The recipe of each linear of one unit (``PriceArgs.lp``): ``named`` every linear of its kind, ``default``
    (the layer's own recipe, None = bf16) for what a kind does not name; ``matched`` the linears an override set
    (built with the override's parameter setting, ``fp8_param`` False: their weights stay bf16 under
    ``--fp8-param-gather``). Truthy when any linear is quantized."""

    default: str | None
    named: tuple[tuple[str, str | None], ...] = ()
    matched: tuple[str, ...] = ()

    def of(self, name: str | None) -> str | None:
        for n, r in self.named:
            if n == name:
                return r
        return self.default

    def __bool__(self) -> bool:
        if self.named:
            return any(r is not None for _, r in self.named)
        return self.default is not None


def unit_prefix(stack: str, layer: int) -> str:
    """The module path of a unit's layer: ``decoder.layers.N.`` (megatron-core's ``named_modules`` under the model;
    N the layer index), an MTP depth's inner layer ``mtp.layers.0.mtp_model_layer.`` (core_v0.19.0
    ``multi_token_prediction.py``)."""
    if stack == "mtp":
        return "mtp.layers.0.mtp_model_layer."
    return f"{stack}.layers.{layer}."


def unit_recipes(linears: tuple[str, ...], prefix: str, default: str | None, overrides) -> UnitRecipes:
    """A unit's ``UnitRecipes``: each of its kind's ``linears`` under ``prefix`` through ``recipe_of`` / ``match``."""
    if not overrides:
        return UnitRecipes(default)
    return UnitRecipes(default, tuple((n, recipe_of(prefix + n, default, overrides)) for n in linears),
                       tuple(n for n in linears if match(prefix + n, default, overrides) is not None))


# ----- megatron-core's YAML ---------------------------------------------------------------------------------------
def _recipe_of_config(key: str, cfg) -> OverrideRecipe:
    where = f"--te-precision-config-file configs.{key}"
    if not isinstance(cfg, dict) or cfg.get("transformer_engine_config_type") != _TE:
        raise ValueError(f"{where}: aceso reads transformer_engine_config_type: {_TE} configs only")
    extra = set(cfg) - {"transformer_engine_config_type", "training_recipe", "evaluation_recipe"}
    if extra or "training_recipe" not in cfg:
        raise ValueError(f"{where}: needs training_recipe (and optionally evaluation_recipe), not "
                         f"{', '.join(sorted(extra)) or 'nothing'}")
    tr = cfg["training_recipe"] or {}
    if not isinstance(tr, dict) or set(tr) - _RECIPE_KEYS:
        raise ValueError(f"{where}.training_recipe: unknown fields {sorted(set(tr) - _RECIPE_KEYS)} "
                         "(megatron-core TEQuantizationRecipe)")
    for k, dflt in _DEFAULTS.items():
        if k in tr and tr[k] != dflt:
            raise ValueError(f"{where}.training_recipe.{k}: {tr[k]} is not priced by aceso; drop it (default "
                             f"{dflt})")
    if tr.get("fp8_format", "e4m3") not in ("e4m3", "hybrid"):
        raise ValueError(f"{where}.training_recipe.fp8_format: {tr['fp8_format']}; megatron-core takes e4m3 or hybrid")
    f8, f4 = tr.get("fp8_quantization_recipe"), tr.get("fp4_quantization_recipe")
    if f8 is not None and f4 is not None:
        raise ValueError(f"{where}.training_recipe: fp8 and fp4 recipes together (megatron-core refuses it); one")
    if f8 is not None:
        if f8 not in _FP8:
            raise ValueError(f"{where}.training_recipe.fp8_quantization_recipe: {f8}; aceso prices "
                             f"{', '.join(_FP8)} (megatron-core refuses delayed here)")
        return _FP8[f8]
    if f4 is not None:
        if f4 not in _FP4:
            raise ValueError(f"{where}.training_recipe.fp4_quantization_recipe: {f4}; aceso prices nvfp4")
        return "nvfp4"
    return "bf16"


def from_config(data) -> tuple[PrecisionOverride, ...]:
    """The overrides of a parsed ``--te-precision-config-file`` (megatron-core's ``RecipeConfig.from_config_dict``);
    ValueError: one line naming the field."""
    if not isinstance(data, dict) or set(data) - {"configs", "matchers"}:
        raise ValueError("--te-precision-config-file: a mapping of configs and matchers (megatron-core RecipeConfig)")
    configs, matchers = data.get("configs") or {}, data.get("matchers") or {}
    if not isinstance(configs, dict) or not isinstance(matchers, dict):
        raise ValueError("--te-precision-config-file: configs and matchers are mappings of names (megatron-core "
                         "RecipeConfig.from_config_dict)")
    out = []
    for name, m in matchers.items():
        if not isinstance(m, dict):
            raise ValueError(f"--te-precision-config-file matchers.{name}: a mapping of type, pattern, config, enabled")
        if not m.get("enabled", False):
            continue
        if m.get("type") != "glob":
            raise ValueError(f"--te-precision-config-file matchers.{name}.type: {m.get('type')}; megatron-core "
                             "implements glob")
        if m.get("config") not in configs:
            raise ValueError(f"--te-precision-config-file matchers.{name}.config: '{m.get('config')}' is not one of "
                             f"configs ({', '.join(configs) or 'none'})")
        if _LAYER_INDEX.search(str(m.get("pattern"))):
            raise ValueError(f"--te-precision-config-file matchers.{name}.pattern: " + _index_why(m.get("pattern")))
        out.append(PrecisionOverride(pattern=str(m.get("pattern")),
                                     recipe=_recipe_of_config(m["config"], configs[m["config"]])))
    return tuple(out)


def read_file(path: str) -> tuple[PrecisionOverride, ...]:
    """The overrides of the YAML file ``path`` (``read_yaml``); ``ValueError`` with one line when it cannot be read
    or is not such a file."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--te-precision-config-file {path}: unreadable ({type(e).__name__})") from None
    return read_yaml(text)


def read_yaml(text: str) -> tuple[PrecisionOverride, ...]:
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--te-precision-config-file: not YAML ({str(e).splitlines()[0]})") from None
    return from_config(data)


_CONFIG = {"bf16": {}, "fp8-tensorwise": {"fp8_quantization_recipe": "tensorwise"},
           "fp8-blockwise": {"fp8_quantization_recipe": "blockwise"}, "mxfp8": {"fp8_quantization_recipe": "mxfp8"},
           "nvfp4": {"fp4_quantization_recipe": "nvfp4"}}


def to_config(overrides) -> dict:
    """megatron-core's YAML structure of ``overrides``: one config per recipe used, one matcher per override."""
    configs, matchers = {}, {}
    for i, o in enumerate(overrides):
        key = o.recipe.replace("-", "_")
        configs[key] = {"transformer_engine_config_type": _TE, "training_recipe": dict(_CONFIG[o.recipe])}
        matchers[f"m{i}_{key}"] = {"config": key, "type": "glob", "pattern": o.pattern, "enabled": True}
    return {"configs": configs, "matchers": matchers}


def write_yaml(overrides) -> str:
    import yaml
    return yaml.safe_dump(to_config(overrides), sort_keys=False)
