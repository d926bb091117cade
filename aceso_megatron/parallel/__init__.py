"""Ranks, process groups and what crosses them: the rank layout of a plan (``layout``), stage-to-stage
activations and gradients (``p2p``), gradient finalisation and clipping over the world (``grads``), and the
rendezvous environment of a process started without torchrun (``distenv``).
"""
