"""Resolve a model argument: a preset name (``model_specs/presets``) or a user spec file (JSON/YAML), and write a
model back as a spec file (``aceso models --show``).

Spec files are strict: unknown fields are errors (``ModelSpec`` forbids extras), and so are duplicate keys (JSON and
YAML parsers would silently keep the last). YAML numbers follow YAML 1.2, as JSON does: ``1e-5`` is a float (PyYAML's
YAML 1.1 resolver would read it as the string "1e-5", which matters in the ``megatron`` block).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic

from model_specs import presets as model_presets

from search.io.errors import AcesoError, did_you_mean, format_validation_error
from search.spec.model import MAX_LAYERS, ModelSpec


_FLOAT_12 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"   # YAML 1.2 core schema floats
                       r"|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$")


class _DuplicateKey(json.JSONDecodeError):
    """A key given twice in a JSON spec file (reported by the JSON error handler)."""

    def __init__(self, key: str):
        super().__init__(f"key '{key}' appears twice; keep one", "", 0)

    def __str__(self) -> str:
        return self.msg


def _no_duplicates(pairs: list[tuple]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _yaml_loader():
    """A SafeLoader that refuses duplicate keys and reads YAML 1.2 floats (``1e-5``)."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        out = {}
        for k, v in node.value:
            key = loader.construct_object(k, deep=deep)
            if key in out:
                raise yaml.YAMLError(f"key '{key}' appears twice; keep one")
            out[key] = loader.construct_object(v, deep=deep)
        return out

    def number(loader, node):
        text = loader.construct_scalar(node)
        return int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else yaml.SafeLoader.construct_yaml_float(loader, node)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    Strict.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
    Strict.add_constructor("tag:yaml.org,2002:float", number)
    return Strict


def _read_spec_file(path: Path) -> dict:
    from search.io.files import read_text

    text = read_text(path)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise AcesoError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise AcesoError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        except RecursionError:
            raise AcesoError(f"{path}: not valid YAML (nested too deeply)") from None
    else:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            raise AcesoError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise AcesoError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise AcesoError(f"{path}: a model spec must be a mapping of fields")
    if "family" not in data and ("model_type" in data or "architectures" in data):
        raise AcesoError(f"{path}: a Hugging Face config.json, not a model spec; convert it first: "
                         f"aceso models --from-hf {path} -o spec.json")
    if "stages" in data and "model" in data:
        raise AcesoError(f"{path}: a plan, not a model spec; give the model (or a spec file) to --model")
    return data


def load_model(name_or_path: str, num_layers: int | None = None) -> ModelSpec:
    """A preset by name, or a spec file; ``num_layers`` overrides the depth (T5: encoder and decoder)."""
    path = Path(name_or_path)
    if name_or_path in model_presets.preset_names():
        data, source = model_presets.preset_data(name_or_path), f"model {name_or_path}"
    elif path.suffix in (".json", ".yaml", ".yml") and path.is_file():
        data, source = _read_spec_file(path), str(path)
    elif path.suffix in (".json", ".yaml", ".yml"):
        what = "is a folder" if path.is_dir() else "no such spec file"
        raise AcesoError(f"model '{name_or_path}': {what}; give a .json/.yaml spec file or a preset (`aceso models`)")
    else:
        hint = did_you_mean(name_or_path, model_presets.preset_names())
        if hint:
            raise AcesoError(f"model '{name_or_path}': not a preset or a spec file{hint} (`aceso models` lists "
                             "the presets)")
        raise AcesoError(
            f"model '{name_or_path}': not a preset or a spec file; choose one of "
            f"{', '.join(model_presets.preset_names())} or give a .json/.yaml spec"
        )
    if num_layers is not None:
        if not 1 <= num_layers <= MAX_LAYERS:
            raise AcesoError(f"--num-layers ({num_layers}) must be in [1, {MAX_LAYERS}]")
        data = dict(data, num_layers=num_layers)
        if data.get("family") == "t5":
            data["num_decoder_layers"] = num_layers
        data.pop("nominal_params_b", None)
    try:
        return ModelSpec.model_validate(data)
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + (_unknown_key(e) or format_validation_error(e))) from None


def _unknown_key(err: pydantic.ValidationError) -> str | None:
    """An unknown key first (a misspelt field also shows as a missing one), with a did-you-mean."""
    import difflib

    extra = [e for e in err.errors() if e["type"] == "extra_forbidden"]
    if not extra:
        return None
    key = ".".join(map(str, extra[0]["loc"]))
    close = difflib.get_close_matches(str(extra[0]["loc"][-1]), list(ModelSpec.model_fields), n=1)
    return f"{key}: unknown field; " + (f"did you mean {close[0]}?" if close and len(extra[0]["loc"]) == 1
                                        else "remove it (aceso models --show NAME prints every field)")


# ----- writing a spec file (aceso models --show) --------------------------------------------------------------------
_EXAMPLES = {  # commented-out starting points for the extension fields a spec leaves unset
    "layer_spec": ("layer_spec: my_pkg.specs:get_my_layer_spec", "layer_spec: {encoder: my_pkg.specs:encoder_spec, "
                   "decoder: my_pkg.specs:decoder_spec}"),
    "megatron": ("megatron:\n  qk_layernorm: true\n  layernorm_epsilon: 1.0e-05",) * 2,
}


def _yaml_value(key: str, value) -> str:
    import yaml

    if isinstance(value, dict):
        body = yaml.safe_dump(value, sort_keys=False, default_flow_style=False).rstrip("\n")
        return f"{key}:\n" + "\n".join("  " + line for line in body.splitlines())
    return yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=True, width=1000).strip()[1:-1]


def spec_text(model: ModelSpec, fmt: str = "yaml", title: str | None = None) -> str:
    """``model`` as a spec file: the fields it sets (a preset's own), in ``ModelSpec`` order. YAML carries every
    field's description as a comment and the unset extension fields (``layer_spec``, ``megatron``) as
    commented-out examples; JSON is the bare mapping."""
    data = {k: v for k, v in model.model_dump(exclude_unset=True, mode="json").items() if v is not None}
    order = [f for f in ModelSpec.model_fields if f in data]
    if fmt == "json":
        return json.dumps({f: data[f] for f in order}, indent=2) + "\n"
    import textwrap

    lines = [f"# {title or model.name} as a model spec file: edit it and pass it as --model FILE.yaml",
             "# (fields: docs/model-specs.md; unknown keys are errors)"]
    for f, info in ModelSpec.model_fields.items():
        example = _EXAMPLES.get(f)
        if f not in data and example is None:
            continue
        lines.append("")
        lines += textwrap.wrap(info.description or "", 110, initial_indent="# ", subsequent_indent="# ")
        if f in data:
            lines.append(_yaml_value(f, data[f]))
        else:
            lines += ["# " + line for line in example[1 if model.is_t5 else 0].splitlines()]
    return "\n".join(lines) + "\n"
