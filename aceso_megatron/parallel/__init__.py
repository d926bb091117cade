"""Ranks, process groups and what crosses them: the rank layout of a plan (``layout``), which piece of a boundary
activation each rank holds (``shards``), stage-to-stage activations and gradients (``p2p``), gradient
finalisation and clipping over the world (``grads``), full-model tensors for tests (``gather``), and the
rendezvous environment of a process started without torchrun (``distenv``).
"""
