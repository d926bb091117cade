"""A stage's model chunk on megatron-core: the chunk itself (``stage_model``), the one translation of our short
names into megatron-core's config (``config``), per-unit recompute (``recompute``, ``attention``),
plan-independent initialisation and TP sharding (``init``) and the vocab-parallel loss (``loss``).
"""
