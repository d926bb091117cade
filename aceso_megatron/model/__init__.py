"""A stage's model chunks on megatron-core: the chunk itself (``stage_model``), the one translation of our short
names into megatron-core's config (``config``), the fast-path choice (``fast_path``, torch-free), norms of
sequence-parallel stages (``norms``), per-unit recompute (``recompute``, ``attention``), plan-independent
initialisation and TP sharding (``init``) and the vocab-parallel loss (``loss``).
"""
