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

- ``hybrid_pattern.py``: a GPT / MoE plan as a hybrid-pattern run (``pretrain_hybrid.py --hybrid-layer-pattern
  "*-*-|*-..."``, 0.17 on), whose ``|`` cuts stages at any unit; ``aceso export --hybrid-pattern`` writes it, the
  import reads it back.
- ``versions.py``: the Megatron-LM releases aceso reads and writes (core_v0.16.1 to core_v0.19.0), each a data file
  of its parser's flags, defaults and entry points, plus the rules and renames between them.

Checked against each release's own ``megatron/training/arguments.py`` (``versions.py``) and Megatron-Bridge
``v0.3.1`` (whose Megatron-LM submodule is core_v0.16.1). See docs/megatron.md.
"""

from .config import MegatronConfig, NotExpressible, Recompute
from .expressible import check_expressible, megatron_config

BRIDGE_VERSION = "v0.3.1"

__all__ = ["BRIDGE_VERSION", "MegatronConfig", "NotExpressible", "Recompute", "check_expressible", "megatron_config"]
