"""Argument types for the ``aceso`` subcommands: numbers checked by argparse itself, so ``--workers -2`` or
``--memory-limit-mb nan`` is one usage line (``aceso X: error: argument --workers: ...``), exit 2, before any work.

Shared by the planner's subcommands and the runtime's (the ``aceso.subcommands`` entry points); torch-free.
"""

from __future__ import annotations

import argparse
import math

# Upper bounds of command-line counts (the schemas have their own, see docs/inputs.md)
MAX_COUNT = 1 << 24


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _count(text: str, low: int) -> int:
    """An integer in [low, 2^24]."""
    value = _int(text)
    if not low <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} must be at least {low}" if value < low else
                                         f"{value} is above the limit {MAX_COUNT}")
    return value


def positive_int(text: str) -> int:
    """An integer in [1, 2^24]."""
    return _count(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer in [0, 2^24]."""
    return _count(text, 0)


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2^32)."""
    value = _int(text)
    if not 0 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"{value} is not a seed in [0, 2^32)")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number, 0 or above."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or above")
    return value


def headroom(text: str) -> float:
    """A share of the GPU's memory kept free: 0 or above, below 0.5."""
    value = _float(text)
    if not 0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"{text} must be a fraction in [0, 0.5), e.g. 0.03 for 3%")
    return value


def finite_float(text: str) -> float:
    return _float(text)


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value
