"""Resolve a model argument: a preset name (``model_specs/presets``) or a user spec file (JSON/YAML)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic

import model_specs

from .errors import AcesoError, format_validation_error
from .model import ModelSpec


def _read_spec_file(path: Path) -> dict:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise AcesoError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise AcesoError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AcesoError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise AcesoError(f"{path}: a model spec must be a mapping of fields")
    return data


def load_model(name_or_path: str, num_layers: int | None = None) -> ModelSpec:
    """A preset by name, or a spec file; ``num_layers`` overrides the depth (T5: encoder and decoder)."""
    path = Path(name_or_path)
    if name_or_path in model_specs.preset_names():
        data, source = model_specs.preset_data(name_or_path), f"model {name_or_path}"
    elif path.suffix in (".json", ".yaml", ".yml") and path.is_file():
        data, source = _read_spec_file(path), str(path)
    else:
        raise AcesoError(
            f"model '{name_or_path}': not a preset or a spec file; choose one of "
            f"{', '.join(model_specs.preset_names())} or give a .json/.yaml spec"
        )
    if num_layers is not None:
        if num_layers < 1:
            raise AcesoError(f"--num-layers ({num_layers}) must be at least 1")
        data = dict(data, num_layers=num_layers)
        if data.get("family") == "t5":
            data["num_decoder_layers"] = num_layers
        data.pop("nominal_params_b", None)
    try:
        return ModelSpec.model_validate(data)
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + format_validation_error(e)) from None
