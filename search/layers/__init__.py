"""Layer kinds as data and formulas, one module per kind (issue 36 groundwork; the registry of issue 35 plugs them in).

``mamba``: megatron-core's Mamba-2 mixer (``M`` in a hybrid layer pattern).
"""
