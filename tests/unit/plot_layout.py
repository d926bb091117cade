"""Overlapping text in a matplotlib figure, from the renderer's own extents (test helper for the pictures).

``capture(monkeypatch)`` makes every figure module's ``save`` record the figure's overlapping text pairs before it
writes the file; ``text_overlaps(fig)`` lists them: two visible, non-empty texts (titles, labels, tick labels,
legend entries, annotations) whose window extents share more than ``min_px`` pixels each way.
"""

from __future__ import annotations


def text_overlaps(fig, min_px: float = 1.0) -> list[tuple[str, str]]:
    import numpy as np
    from matplotlib.text import Text
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    fw, fh = fig.canvas.get_width_height()
    undrawn = set()            # tick labels of ticks outside their axis' view limits (kept by matplotlib, not drawn)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = 1e-9 * max(abs(lo), abs(hi), 1.0)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if loc is None or not lo - eps <= loc <= hi + eps:
                    undrawn.update((id(tick.label1), id(tick.label2)))
    items = []
    for t in fig.findobj(Text):
        if id(t) in undrawn or not t.get_visible() or not t.get_text().strip():
            continue
        bb = t.get_window_extent(renderer)
        if bb.width <= 0 or bb.height <= 0 or bb.x1 < 0 or bb.y1 < 0 or bb.x0 > fw or bb.y0 > fh:
            continue
        clip = t.get_clip_box() if t.get_clip_on() else None
        if clip is not None and (bb.x0 >= clip.x1 or bb.x1 <= clip.x0):
            continue                                    # clipped away: not drawn
        items.append((t.get_text(), bb.x0, bb.y0, bb.x1, bb.y1))
    if len(items) < 2:
        return []
    box = np.array([i[1:] for i in items])
    x0, y0, x1, y1 = (box[:, k] for k in range(4))
    w = np.minimum(x1[:, None], x1[None, :]) - np.maximum(x0[:, None], x0[None, :])
    h = np.minimum(y1[:, None], y1[None, :]) - np.maximum(y0[:, None], y0[None, :])
    hit = np.triu((w > min_px) & (h > min_px), k=1)
    return [(items[a][0], items[b][0]) for a, b in zip(*np.nonzero(hit))]


def capture(monkeypatch) -> list[list[tuple[str, str]]]:
    """Patch the figure modules' ``save``: each saved figure appends its overlaps to the returned list."""
    from search import plots
    from search.plots import explain, search_progress, training
    found: list[list[tuple[str, str]]] = []
    real = plots.save

    def checked(fig, out, *a, **kw):
        found.append(text_overlaps(fig))
        return real(fig, out, *a, **kw)
    for mod in (explain, search_progress, training):
        monkeypatch.setattr(mod, "save", checked)
    return found
