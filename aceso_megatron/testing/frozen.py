"""Imported last by the forkserver (``testing.PRELOAD``): what the server imported moves to the garbage
collector's permanent generation (``gc.freeze``), so a collection in a forked rank (``teardown.destroy_groups``'s,
or one the allocation count starts) no longer walks torch's and megatron-core's objects. Walking them wrote to
every page holding one (copy-on-write: the fork's shared pages copied) and took seconds per rank, more than a tiny
test's training; the ranks' own objects are collected as before."""

import gc

gc.freeze()
