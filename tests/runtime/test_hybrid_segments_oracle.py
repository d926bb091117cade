"""``search.layers.hybrid.pipeline_refusal`` against the installed megatron-core's own ``select_pipeline_segment``
(0.19: ``models/hybrid/hybrid_layer_allocation.py``; 0.17: ``ssm/mamba_hybrid_layer_allocation.py``): for each
pattern, pp and vp, megatron-core places a segment on every (pipeline rank, virtual stage) exactly when aceso accepts
the pattern, and the segments it places are the pattern's ``|`` segments in model order (segment vp x pp + rank).
VPP with ``|`` segments runs; VPP without them raises. Skipped on megatron-core 0.16.1 (no ``|`` segments)."""

from __future__ import annotations

import sys

import pytest

from search.layers.hybrid import parse_pattern, pipeline_refusal

torch = pytest.importorskip("torch")
try:
    from megatron.core.models.hybrid.hybrid_layer_allocation import select_pipeline_segment
except ImportError:
    try:
        from megatron.core.ssm.mamba_hybrid_layer_allocation import select_pipeline_segment
    except ImportError:
        pytest.skip("megatron-core before 0.17 has no '|' pipeline segments", allow_module_level=True)

CASES = [("M*M*|M-M-", 2, 1), ("M*|M*|M-|M-", 2, 2), ("M*M*M-M-", 2, 1), ("M*M*M-M-", 2, 2), ("M*M*M-M-", 3, 1),
         ("M*|M*|M-", 2, 1), ("M*|M*|M-|M-", 4, 1), ("M*|M*|M-|M-", 1, 4), ("ME*E|MEM*|E", 3, 1)]


class _Group:
    def __init__(self, rank, size):
        self.rank_, self.size_ = rank, size


def _placed(monkeypatch, pattern, pp, vp):
    """The layers megatron-core places on each (virtual stage, rank) in model order, or None if it raises."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: g.rank_ if g is not None else 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: g.size_ if g is not None else 1)
    module = sys.modules[select_pipeline_segment.__module__]
    for name in ("log_on_each_pipeline_stage", "log_single_rank"):      # they need a process group
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: None)
    out = []
    try:
        for v in range(vp):
            for r in range(pp):
                layers, _ = select_pipeline_segment(pattern, _Group(r, pp), v if vp > 1 else None)
                out.append("".join(layers))
    except (ValueError, AssertionError):
        return None
    return out


@pytest.mark.parametrize("pattern, pp, vp", CASES)
def test_pipeline_refusal_is_megatron_cores_placement(monkeypatch, pattern, pp, vp):
    placed = _placed(monkeypatch, pattern, pp, vp)
    p = parse_pattern(pattern)
    why = pipeline_refusal(p, pp, vp)
    if why is None:
        assert placed is not None, (pattern, pp, vp)
        assert placed == (list(p.segments) if len(p.segments) > 1 else
                          [p.layers[i * len(p.layers) // pp:(i + 1) * len(p.layers) // pp] for i in range(pp)])
    elif len(p.segments) > 1 and len(p.segments) % pp == 0 and len(p.segments) // pp > vp:
        pass    # megatron-core would place the first vp x pp segments only (Megatron-LM derives vp from them)
    else:
        assert placed is None, (pattern, pp, vp, why)
