"""What each target runs: the capability table (``capabilities.py``), the aceso runtime's rules (``runtime_rules.py``)
and the one pre-flight (``preflight.py``).
"""
