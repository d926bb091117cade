"""The descriptions the search reads and writes: the model (``model.py``, its megatron block, RoPE scaling and
megatron-core's refusals), the cluster and its GPU records, the training settings, the plan (``plan.py``); model
presets and the Hugging Face import.
"""
