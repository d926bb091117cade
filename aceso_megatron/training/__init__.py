"""Training with a plan: the runtime and its step (``engine``), ``aceso train`` (``train``, ``train_log``), the
datasets and tokenizers (``data``, ``tokenizer``) and checkpoints (``checkpoint``).
"""
