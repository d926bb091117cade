"""The planner: Aceso's iterative bottleneck alleviation plus exact recompute and partition refinements.

Code map: ``state`` (compact states, cached evaluation, shape space), ``recompute`` (exact per-stage recompute),
``partition`` (exact DP over contiguous cuts), ``bottleneck`` (bottleneck, classification, primitive order),
``primitives`` (the moves), ``aceso`` (the search loop and its orchestration), ``baseline`` (best uniform Megatron
config), ``exhaustive`` (tiny-problem enumerator), ``synthetic`` (a random cost model for tests), ``api`` (the
one-call entry points used by the CLI and the bench), ``report`` (what the CLI prints). See docs/search.md.
"""
