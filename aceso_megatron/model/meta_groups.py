"""Process groups for a build on the meta device that never communicates: each reports a size and a rank, nothing else.

Used by the pre-flight's layer build (``model.build_check``) and by ``testing.meta_params``' per-rank parameter counts.
"""

from __future__ import annotations


class Group:
    """A process group as megatron-core's constructors read it: a size and this rank's index, nothing else."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def meta_groups(tp: int, pp: int, pp_rank: int):
    """The groups of one rank of a tp x pp layout, for a build that never communicates (DP, CP of 1)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    g = ProcessGroupCollection()
    g.tp, g.pp, g.cp, g.dp = Group(tp), Group(pp, pp_rank), Group(1), Group(1)
    g.tp_cp, g.dp_cp, g.embd, g.pos_embd, g.hcp = Group(tp), Group(1), None, None, None
    return g
