"""The runtime's ``aceso`` subcommands: ``profile``, ``train``, ``launch``, ``data``.

The planner's dispatcher (``search.cli``) finds them through the ``aceso.subcommands`` entry points in setup.py
and imports a module only when its subcommand (or the full help) is needed. Each module keeps the dispatcher's
contract: a docstring (its first line is the help), ``add_arguments(parser)`` and ``run(args) -> int``; importing
one imports no torch. Patch refusals and a worker's bad input are turned into one line by ``aceso_megatron.errors``.

Importing this package silences the import-time notices of torch's CUDA build on a CPU machine
(``patches.compat.quiet_cuda_build_notices``): every runtime subcommand and the pre-flight are reached through it.
"""

from __future__ import annotations

from patches.compat import quiet_cuda_build_notices

# before any subcommand imports torch: torch's CUDA build on a CPU machine would print a notice (patches.compat)
quiet_cuda_build_notices()
