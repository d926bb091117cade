"""Small named changes to megatron-core behaviour, each with ``apply()``/``revert()`` and a version check.

Nothing is patched on import; see docs/patches.md for the table of patches.
"""
