"""Build one layer of each stack of a CPU run's model before any process group exists (issue 25).

A user's layer spec may hold a module that needs CUDA (it creates a ``torch.cuda.Stream`` or calls
``torch.cuda.current_device()`` in its constructor): on a CPU run it used to fail in every worker, after the process
group existed. ``check_layers_build(model, device)`` builds the first layer of each stack (GPT's decoder; T5's
encoder and decoder) the way the run builds it (``build_unit_layers``, the stage config of a tp-1 stage), on the meta
device (shapes only, no memory) with groups that only report a size (``model.meta_groups``: construction
never communicates), and turns what the build raises into one ``AcesoError`` line naming the provider. Stock
megatron-core specs are not rebuilt: only a model with a ``layer_spec`` can bring such a module.
"""

from __future__ import annotations

import torch

from search.io.errors import AcesoError
from search.spec.model import ModelSpec


def check_layers_build(model: ModelSpec, device: str) -> None:
    """Refuse (one line) a layer spec whose layer cannot be built on ``device`` (only a CPU run is checked here: on
    GPUs the workers build it on their own device)."""
    if device != "cpu" or not model.layer_spec:
        return
    from .config import stage_config
    from .layers import build_unit_layers
    from .meta_groups import meta_groups

    config = stage_config(model, 1, device)
    for stack in dict.fromkeys(u.stack for u in model.units):
        units = [u for u in model.units if u.stack == stack and u.layer == 0]
        try:
            with torch.device("meta"):
                build_unit_layers(model, units, ["none"] * len(units), config, meta_groups(1, 1, 0), te=False)
        except AcesoError:
            raise
        except Exception as e:    # noqa: BLE001  (whatever the user's constructor raises, as one line)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            needs_cuda = "cuda" in first.lower()
            fix = ("it needs CUDA, which a CPU run does not have: make the module fall back to CPU when "
                   "torch.cuda.is_available() is False, or run the plan on GPUs" if needs_cuda else
                   "fix the module's constructor, or use megatron-core's stock spec (drop layer_spec)")
            raise AcesoError(f"model.layer_spec ({model.layer_spec_path(stack)}): a {stack} layer cannot be built "
                             f"on CPU ({type(e).__name__}: {first}); {fix}") from None
