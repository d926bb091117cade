"""Runtime plugin: execute a ``ParallelPlan`` on stock megatron-core (see docs/runtime.md).

Import the submodules you need (``aceso_megatron.training.engine.build_runtime``); importing this package imports
no torch.
"""
