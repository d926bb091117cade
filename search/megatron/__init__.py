"""Stock Megatron-LM / Megatron-Bridge as targets: what a plan looks like there, and back.

- ``check_expressible(plan) -> str | None`` (``expressible.py``): can Megatron-LM run the plan exactly? ``None``, or
  one line naming the stage and field. Stable signature: ``aceso search --target megatron-lm`` filters with it.
- ``megatron_config(plan) -> MegatronConfig`` (``expressible.py``, ``config.py``): the plan in Megatron-LM's terms.
- ``names.py``: the one table of our names <-> Megatron-LM flags <-> Megatron-Bridge ``ConfigContainer`` fields.
- ``script.py`` (bash launch script, ``--args-only``), ``bridge.py`` (Bridge recipe overrides).
- ``importer.read_megatron(text, ...)``: a launch script or argument line back into the plan it runs
  (``shell.py`` reads the bash, ``cmdline.py`` the flags, ``model_args.py`` the model), ``build.plan_from_config``.
- ``layout.py`` and ``recompute.py``: the two non-trivial mappings (layer splits, per-unit recompute); the planner
  uses ``recompute.recompute_of`` / ``unit_choices`` and ``config.Recompute`` too (keep them stable).
- what ``aceso search`` gains over a given configuration (``explain --megatron-args``) is the search command's own
  answer: ``search/cli/explain_search.py`` runs the very command it prints.

Checked against Megatron-LM ``core_v0.16.1`` (commit 55ac708, ``megatron/training/arguments.py``) and
Megatron-Bridge ``v0.3.1`` (whose Megatron-LM submodule is that same commit). See docs/megatron.md.
"""

from .config import MegatronConfig, NotExpressible, Recompute
from .expressible import check_expressible, megatron_config

MEGATRON_LM_VERSION = "core_v0.16.1"
MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
BRIDGE_VERSION = "v0.3.1"

__all__ = ["BRIDGE_VERSION", "MEGATRON_LM_COMMIT", "MEGATRON_LM_VERSION", "MegatronConfig", "NotExpressible",
           "Recompute", "check_expressible", "megatron_config"]
