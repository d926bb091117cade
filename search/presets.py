"""Resolve a model argument: a preset name (``model_specs/presets``) or a user spec file (JSON/YAML)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic

import model_specs

from .errors import AcesoError, did_you_mean, format_validation_error
from .model import MAX_LAYERS, ModelSpec


def _read_spec_file(path: Path) -> dict:
    from .files import read_text

    text = read_text(path)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise AcesoError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise AcesoError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        except RecursionError:
            raise AcesoError(f"{path}: not valid YAML (nested too deeply)") from None
    else:
        try:
            data = json.loads(text)
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
    if name_or_path in model_specs.preset_names():
        data, source = model_specs.preset_data(name_or_path), f"model {name_or_path}"
    elif path.suffix in (".json", ".yaml", ".yml") and path.is_file():
        data, source = _read_spec_file(path), str(path)
    elif path.suffix in (".json", ".yaml", ".yml"):
        what = "is a folder" if path.is_dir() else "no such spec file"
        raise AcesoError(f"model '{name_or_path}': {what}; give a .json/.yaml spec file or a preset (`aceso models`)")
    else:
        hint = did_you_mean(name_or_path, model_specs.preset_names())
        if hint:
            raise AcesoError(f"model '{name_or_path}': not a preset or a spec file{hint} (`aceso models` lists "
                             "the presets)")
        raise AcesoError(
            f"model '{name_or_path}': not a preset or a spec file; choose one of "
            f"{', '.join(model_specs.preset_names())} or give a .json/.yaml spec"
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
        raise AcesoError(f"{source}: " + format_validation_error(e)) from None
