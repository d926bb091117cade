"""Megatron-LM's overrides of transformer-engine's TP communication overlap methods, read with ``--tp-comm-overlap``.

aceso prices ``--tp-comm-overlap`` (``settings.tp_comm_overlap``) as transformer-engine's default ``initialize_ub``
methods (``search/costmodel/tpcomm.py``: ring-exchange all-gathers, pipelined forward reduce-scatter, bulk
re-gather / reduce-scatter behind the backward GEMMs). These flags change those methods (megatron-core
``ModelParallelConfig`` tp_comm_* fields, core_v0.19.0 core/model_parallel_config.py:271-312, passed to TE's
linears as ``ub_overlap_ag`` / ``ub_overlap_rs`` / ``ub_bulk_*`` / ``ub_overlap_rs_dgrad``,
core/extensions/transformer_engine.py:934-956, 1199-1223; ``--tp-comm-overlap-cfg``: a YAML of per-GEMM methods,
training/initialize.py:204-207), which aceso does not price: with ``--tp-comm-overlap`` each is refused in one line.
Without it megatron-core reads none of them ("Don't care if tp_comm_overlap is False"): accepted, nothing priced.
``--no-tp-comm-split-ag`` / ``-rs`` are deprecated since TE 1.6 (megatron-core passes ``tp_comm_overlap_ag`` /
``_rs`` instead from TE 1.5, transformer_engine.py:936-946): accepted, nothing priced. The ``--disable-`` spellings
are read as these (``cmdline._aliases``: same parser field).
"""

from __future__ import annotations

OVERLAP = "--tp-comm-overlap"
# flag -> what it changes (refused with --tp-comm-overlap)
METHOD_FLAGS: dict[str, str] = {
    "--tp-comm-overlap-cfg": "a userbuffers config file sets per-GEMM overlap methods",
    "--no-tp-comm-overlap-ag": "the all-gathers run without their ring-exchange overlap",
    "--no-tp-comm-overlap-rs": "the forward reduce-scatter runs without its pipelined overlap",
    "--no-tp-comm-bulk-dgrad": "the backward re-gather runs without its bulk overlap",
    "--no-tp-comm-bulk-wgrad": "the backward reduce-scatter runs without its bulk overlap",
    "--tp-comm-overlap-rs-dgrad": "the input-gradient reduce-scatter is pipelined with its GEMM",
}
NO_EFFECT = ("--no-tp-comm-split-ag", "--no-tp-comm-split-rs")
FLAG_KINDS: dict[str, str] = {**{f: "bool" for f in (*METHOD_FLAGS, *NO_EFFECT)}, "--tp-comm-overlap-cfg": "str"}


def refusal(f) -> str | None:
    """One line for the first method override given with ``--tp-comm-overlap`` (``f``: ``cmdline.Flags``), else None."""
    if not f.has(OVERLAP):
        return None
    for flag, what in METHOD_FLAGS.items():
        if f.has(flag):
            shown = " ".join([flag, *f.values[flag]])
            return (f"{shown} with --tp-comm-overlap: {what}; aceso prices transformer-engine's default overlap "
                    "methods (search/costmodel/tpcomm.py); drop the flag")
    return None
