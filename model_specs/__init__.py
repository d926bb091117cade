"""Model architectures: presets as data files (``presets/*.json``), torch-free.

``model_specs.builders`` (torch, megatron-core) turns a ``search.spec.model.ModelSpec`` into megatron-core
``TransformerConfig``/``ModuleSpec`` objects, and ``model_specs.extensions`` imports and checks a user's own
``layer_spec`` and ``megatron`` block; importing this package imports neither.
"""

from __future__ import annotations

from model_specs.presets import preset_data, preset_names  # noqa: F401  (the presets' one reader, model_specs.presets)
