"""The planner: Aceso's iterative bottleneck alleviation over the modern Megatron space, plus exact refinements.

Code map: ``space`` (what shapes, micro-batches, chunkings and switches a plan may take, per target), ``state``
(compact states, the cached evaluator, its pipeline lower bound, conversion to plans), ``recompute`` (exact
per-stage recompute), ``megatron_lm`` (Megatron-LM's recompute settings and check, for ``--target megatron-lm`` and
the baseline), ``partition`` (exact DP over contiguous cuts), ``bottleneck`` (bottleneck, classification, primitive
order), ``primitives`` and ``shapes`` (the moves), ``aceso`` (the search loop and its orchestration), ``polish``
(exact refinements of the final plans), ``baseline`` (best uniform Megatron-LM config), ``exhaustive``
(tiny-problem enumerator), ``synthetic`` (a random cost model for tests), ``api`` (the one-call entry points: the
three report lines), ``report`` (what the CLI prints). See docs/search.md.
"""
