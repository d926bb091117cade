"""The plan's one settings record (``plan_settings.py``) and the switch records it holds: precision recipes, DP
synchronization, Megatron FSDP and offload, the software-stack switches, the MoE settings and expert shapes, and the
software releases a plan runs on.
"""
