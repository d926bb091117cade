"""Short text pieces every summary line shares, so that one stage reads the same in ``search``, ``validate``,
``explain`` and the pictures: a stage's shape (``tp2 cp4 dp2 sp``: cp and sp only where they apply) and a count with
its noun (``1 stage``, ``2 stages``)."""

from __future__ import annotations


def shape(stage) -> str:
    """``tp2 cp4 dp2`` (+ `` sp``) of anything with ``tp``, ``dp`` and optionally ``cp``/``sp``/``sequence_parallel``;
    a dict works too."""
    get = stage.get if isinstance(stage, dict) else lambda k, d=None: getattr(stage, k, d)
    cp = get("cp", 1) or 1
    sp = get("sp", None)
    sp = get("sequence_parallel", False) if sp is None else sp
    return f"tp{get('tp')}" + (f" cp{cp}" if cp > 1 else "") + f" dp{get('dp')}" + (" sp" if sp else "")


def plural(n: int, noun: str) -> str:
    """``1 stage``, ``2 stages``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
