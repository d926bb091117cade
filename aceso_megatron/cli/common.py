"""Output helpers of the runtime's subcommands, with the same behaviour as the planner's (``search/cli/common.py``):
``-o``/``--slurm`` files are written by ``search.io.files`` (checked first, atomic, devices and FIFOs in place). Kept
here so that ``aceso_megatron`` never imports the planner's CLI layer.
"""

from __future__ import annotations

from search.io.files import check_output, write_output  # noqa: F401  (re-exported for the subcommands)
