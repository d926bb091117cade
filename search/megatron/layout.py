"""How transformer layers are spread over (virtual) pipeline stages, in Megatron-LM's three ways.

1. even: ``num_layers / (pp * vpp)`` per model chunk (``--num-virtual-stages-per-pipeline-rank`` for vpp > 1);
2. uneven first / last rank: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``,
   the middle ranks share the rest evenly, each rank's layers split evenly over its vpp chunks;
   ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` (read only) count the
   embedding / loss as one layer of the first / last chunk;
3. ``--pipeline-model-parallel-layout``: one entry per model chunk in model order (virtual stage major), ``|``
   between chunks, ``E`` the embedding, ``L`` the loss, ``t`` a transformer layer, ``m`` an MTP layer, ``x*n``
   and ``(...)*n`` repeat, commas are cosmetic (grammar of megatron-core's ``PipelineParallelLayerLayout.
   parse_str_to_list``, checks of its ``validate_layer_layout``).

MTP layers: without a layout megatron-core builds them on the last pipeline rank's last model chunk
(``get_mtp_num_layers_to_build``), and that is where a plan has the MTP unit (after the last decoder layer); a layout
must put every ``m`` there too (megatron-core would also take another rank's last chunk before a loss-only chunk,
"standalone MTP", which a plan does not express). The last chunk may hold the MTP block alone (``...|mL``).

Chunks without a transformer layer: the first model chunk may hold only the embedding (``E|...``, a plan chunk
``holds_only: "embedding"``) and the last only the loss (``...|L``, ``holds_only: "loss"``), as megatron-core
builds them (``TransformerBlock`` with zero layers; ``chunk_layers`` 0 there). A middle chunk with nothing
(megatron-core's "(empty stage)") is refused: it would only pass activations on.

``chunk_layers`` (layers per model chunk, model order, ``pp * vpp`` entries) is the common form;
``distribution`` reproduces megatron-core's ``get_num_layers_to_build`` for ways 1 and 2 (tested against it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from search.io.errors import AcesoError


@dataclass(frozen=True)
class Split:
    """The Megatron-LM arguments of one layer distribution (None: not set)."""

    vpp: int = 1
    first: int | None = None
    last: int | None = None
    layout: str | None = None


def split_for(chunk_layers: tuple[int, ...], pp: int, vpp: int, mtp: int = 0) -> Split:
    """The simplest Megatron-LM arguments giving exactly ``chunk_layers`` (and ``mtp`` MTP layers in the last
    chunk): even, else first/last counts, else the layout string."""
    total = sum(chunk_layers)
    if 0 in chunk_layers:                                # an end chunk holds only E, L or the MTP block
        return Split(vpp, layout=format_layout(chunk_layers, mtp))
    per_rank = [chunk_layers[s::pp] for s in range(pp)]
    if all(len(set(c)) == 1 for c in per_rank):          # every rank's chunks are equal
        n = [sum(c) for c in per_rank]
        if len(set(n)) == 1:
            return Split(vpp)
        first, last = _first_last(n)
        if (first, last) != (None, None) and distribution(total, pp, vpp, first, last) == chunk_layers:
            return Split(vpp, first, last)
    return Split(vpp, layout=format_layout(chunk_layers, mtp))


def _first_last(n: list[int]) -> tuple[int | None, int | None]:
    pp = len(n)
    if pp == 2:
        return n[0], None
    middle = n[1:-1]
    if len(set(middle)) != 1:
        return None, None
    m = middle[0]
    return (n[0] if n[0] != m else None), (n[-1] if n[-1] != m else None)


def format_layout(chunk_layers: tuple[int, ...], mtp: int = 0) -> str:
    """``E`` + the first chunk's layers ``|`` ... ``|`` the last chunk's layers + the MTP layers + ``L``
    (``t*n`` for n layers)."""
    parts = [("" if n == 0 else "t" if n == 1 else f"t*{n}") for n in chunk_layers]
    parts[0] = "E" + parts[0]
    parts[-1] += "m" * mtp + "L"
    return "|".join(parts)


_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def parse_layout(text: str) -> list[str]:
    """The layout string unrolled: one string of layer characters per model chunk (``AcesoError`` if invalid)."""
    s = text.replace(",", "")
    for pat in _REPEATS:
        s = pat.sub(lambda x: x.group(1) * int(x.group(2)), s)
    chunks = s.split("|")
    bad = sorted({c for c in s if c not in "ELtm|"})
    if bad:
        raise AcesoError(f"--pipeline-model-parallel-layout {text!r}: unknown layer character {bad[0]!r} "
                         "(E embedding, L loss, t transformer layer, m MTP layer)")
    return chunks


def layout_chunk_layers(text: str, pp: int, mtp: int = 0) -> tuple[tuple[int, ...], int]:
    """``(transformer layers per model chunk, vpp)`` of a layout string, checked as megatron-core checks it, plus
    what a plan needs (the ``mtp`` MTP layers in the last chunk; a chunk without a transformer layer only at the
    ends: the first holding only ``E``, the last only ``L`` or the MTP block)."""
    chunks = parse_layout(text)
    flat = "".join(chunks)
    where = f"--pipeline-model-parallel-layout {text!r}"
    if len(chunks) % pp:
        raise AcesoError(f"{where}: {len(chunks)} stages is not a multiple of --pipeline-model-parallel-size ({pp})")
    if not flat.startswith("E") or flat.count("E") != 1 or not flat.endswith("L") or flat.count("L") != 1:
        raise AcesoError(f"{where}: the layout must start with the embedding E and end with the loss L, once each")
    if flat.count("m") != mtp:
        raise AcesoError(f"{where}: {flat.count('m')} MTP layers (m) but --mtp-num-layers is {mtp} (megatron-core "
                         "asserts they match)")
    if "t" in flat[flat.find("m"):] and mtp:
        raise AcesoError(f"{where}: decoder layers (t) after an MTP layer (m); megatron-core places MTP layers after "
                         "every decoder layer")
    if mtp and chunks[-1].count("m") != mtp:
        k = next(i for i, c in enumerate(chunks) if "m" in c)
        raise AcesoError(f"{where}: the MTP layers are in model chunk {k}, not the last one ({len(chunks) - 1}); a "
                         "plan holds the MTP block in the last chunk (move every m before the final L)")
    counts = tuple(c.count("t") for c in chunks)
    empty = [k for k, n in enumerate(counts) if n == 0 and 0 < k < len(chunks) - 1]
    if empty:
        raise AcesoError(f"{where}: model chunk {empty[0]} holds nothing (neither a transformer layer nor the "
                         "embedding or loss); only the first chunk may hold just E and the last just L (or the "
                         "MTP block): give it a layer")
    if len(chunks) == 1 and counts[0] == 0:
        raise AcesoError(f"{where}: the only model chunk holds no transformer layer")
    return counts, len(chunks) // pp


def distribution(num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
                 embedding_counts: bool = False, loss_counts: bool = False) -> tuple[int, ...]:
    """Layers per model chunk (model order) as megatron-core 0.16.1 builds them without a layout
    (``transformer_block.get_num_layers_to_build``); ``AcesoError`` where megatron-core would assert."""
    if (first is not None or last is not None) and (embedding_counts or loss_counts):
        raise AcesoError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                         "--account-for-embedding/loss-in-pipeline-split (megatron-core refuses it)")
    if first is not None or last is not None:
        rest, left = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if left and rest % left or (left == 0) != (rest == 0) or rest < 0:
            raise AcesoError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}): the other {rest} of "
                             f"{num_layers} layers must split evenly over the other {left} pipeline ranks")
        ranks = [rest // left if left else 0] * pp
        if first is not None:
            ranks[0] = first
        if last is not None:
            ranks[-1] = last
    else:
        total = num_layers + embedding_counts + loss_counts
        if total % pp:
            raise AcesoError(f"--num-layers ({num_layers}"
                             + (" + embedding/loss" if embedding_counts or loss_counts else "")
                             + f") must be a multiple of --pipeline-model-parallel-size ({pp}), or give "
                             "--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout")
        ranks = [total // pp] * pp
    for s, n in enumerate(ranks):
        if n % vpp:
            raise AcesoError(f"pipeline rank {s} has {n} layers, not a multiple of the {vpp} virtual stages "
                             "(--num-virtual-stages-per-pipeline-rank)")
    chunks = [ranks[k % pp] // vpp for k in range(pp * vpp)]
    chunks[0] -= embedding_counts
    chunks[-1] -= loss_counts
    if min(chunks) < 0:      # megatron-core asserts "Not enough layers in the first/last virtual pipeline stage"
        raise AcesoError(f"model chunk {chunks.index(min(chunks))} has no layer to give to the embedding / loss "
                         "(--account-for-embedding/loss-in-pipeline-split); use fewer pipeline stages")
    empty = [k for k, n in enumerate(chunks) if n == 0 and 0 < k < len(chunks) - 1]
    if empty:
        raise AcesoError(f"model chunk {empty[0]} would hold nothing (no transformer layer, not an end chunk "
                         "holding the embedding or loss); give every middle (virtual) pipeline stage a layer")
    return tuple(chunks)
