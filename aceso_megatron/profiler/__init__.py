"""The profiler behind ``aceso profile``: measures the runtime's own megatron-core modules on this machine.

- ``units``: each unit kind (attention / MLP / T5 cross-attention halves, embedding, head + loss) at each tp
  and per-rank micro-batch, on real TP groups, under each recompute choice: forward/backward time, activation
  bytes kept for backward, weight bytes (GPU: backward transient peaks); ``moe``: an MoE model's moe unit per
  expert-parallel degree (expert shape, expert weight bytes, the forward split into MoELayer's parts).
- ``comm``: collectives (all-reduce, all-gather, reduce-scatter, all-to-all) by group and message size; p2p.
- ``timing``: warm-up, repeats, median and spread (CUDA events / perf_counter); ``memory``: saved-tensor hooks
  and allocator counters; ``progress``: the resumable partial file and the progress bar; ``tasks``: the ordered
  measurements and the database rows; ``fingerprint``: the hardware block; ``run``: the per-rank worker.
The database format is the cost model's (docs/profile-db.md, ``search.costmodel.profiledb``).
"""
