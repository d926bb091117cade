"""Which collectives, groups and message sizes the network benchmarks measure (pure, no torch).

Groups are ranks ``[0, n)`` for n = 2, 4, ... up to the world (intra node while n <= processes per node), plus,
with several nodes, the two-rank group ``{0, per_node}`` across nodes and the whole world.
"""

from __future__ import annotations

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
KB = 1024


def message_sizes(lo: int, hi: int, factor: int = 4) -> list[int]:
    """Sizes from ``lo`` to ``hi`` bytes, multiplying by ``factor`` (``hi`` included)."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= factor
    return out + [hi]


def group_plan(world: int, per_node: int) -> list[tuple[list[int], bool]]:
    """(ranks, inter) of every measured group: powers of two from 2 to the node (and beyond, spanning nodes)."""
    groups = []
    n = 2
    while n <= world:
        groups.append((list(range(n)), n > per_node))
        n *= 2
    if world > per_node >= 1 and world % per_node == 0:
        if per_node > 1:
            groups.append(([0, per_node], True))
        if world not in [len(g) for g, _ in groups]:
            groups.append((list(range(world)), True))
    elif world > 2 and world not in [len(g) for g, _ in groups]:
        groups.append((list(range(world)), world > per_node))
    return groups


def group_key(ranks: list[int], inter: bool) -> str:
    return f"g{len(ranks)}{'x' if inter else ''}" + ("" if ranks == list(range(len(ranks))) else "s")
