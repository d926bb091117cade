"""The constants that depend on the software release, each fitted on that release's published rows.

The same configuration got faster from container to container with the same flags (transformer-engine's grouped
and low-precision GEMMs, megatron-core's host path), so the efficiencies of those kernels are keyed on the release
the user states (``search/settings/releases.py``: a container or a megatron-core version; default the newest). Releases that
ship the same megatron-core and transformer-engine share one fit (26.02 / 26.02.01; 26.04 / 26.04.01: the point
releases change only Megatron-Bridge's recipes). Each entry says on how many published rows it was fitted
(``python bench/published_runs.py --fit-release``, least ``release_fit.objective`` on the release's rows not kept out:
the MAE plus 3x the mean excess beyond 15%, the MoE constants jointly; the bf16 dense
constants, ``kernels.SUSTAINED_*``, are fitted once on the dense BF16 calibration and are not per release):

    HOST_LAUNCH_MS      host time of one kernel launch of a layer's forward (``host.py``)
    GROUPED_K0_LP       a quantized grouped GEMM of inner depth k costs the tile model's time x (1 + K0 / k)
                        (``moe_cost._experts``: TE's GroupedLinear quantizes, scales and, for the weight gradient,
                        transposes each expert's operands on its own)
    LOWPREC_GEMM_SCALE  the achieved FP8 / FP4 GEMM fraction of the bf16 ceiling, per GPU generation
                        (``kernels.lowprec_kernels``)
    NVFP4_GEMM_SCALE    the NVFP4 GEMM's rate relative to the per-tensor FP8 GEMM of the same shape (the MXFP8 one
                        is ``kernels.RECIPE_GEMM_SCALE``, fitted on 25.11's four pairs)
    HYBRIDEP_NVL_EFF    HybridEP's achieved fraction of NVLink on Blackwell (``moe_cost.flex_dispatch``; its SM count
                        changes with the release: megatron-core 0.16 runs it on 16 SMs, 0.17+ on HybridEP's own default,
                        32): not fitted, its benchmark at the release's SM count (``SOURCED``)
    SINK_ATTN_SCALE     the fused attention's rate with a softmax offset (attention sinks) relative to the vanilla
                        kernel, per GPU generation (``analytic.sink_attention_scale``: cuDNN's sink kernels, which no
                        benchmark in our sources measures)

A release whose own fit has too few rows of a kind (no NVFP4 row in 25.x) takes that constant from the nearest
older release that has it, else from ``POOLED`` (fitted on every release's rows together: attention sinks, 11
GPT-OSS rows over three releases) or ``BASE`` (its source in ``VALUE_SOURCES``); ``table`` says which for each.
"""

from __future__ import annotations

from search.settings.releases import BY_NAME, NEWEST, _order  # noqa: F401  (_order: bench/release_fit.py)
from .moe_primitives import HYBRIDEP_32SM_NVL_EFF

# One fit per group of releases that ship the same megatron-core and transformer-engine: (the containers it covers,
# {constant: value fitted on the group's rows}, {constant: the published rows it was fitted on}). A constant a group
# has too few rows for (``bench/release_fit.MIN_ROWS``) is not in its dict: the nearest older group's is used, else
# ``BASE`` (``value``).
FITS: dict[str, tuple[tuple[str, ...], dict, dict]] = {
    "25.09": (("25.09",), {"HOST_LAUNCH_MS": 0.03, "GROUPED_K0_LP": 6000.0,
                           "LOWPREC_GEMM_SCALE": {"blackwell": 0.84}},
              {"HOST_LAUNCH_MS": 13, "GROUPED_K0_LP": 13, "LOWPREC_GEMM_SCALE.blackwell": 9}),
    "25.11": (("25.11",), {"HOST_LAUNCH_MS": 0.05, "GROUPED_K0_LP": 1500.0,
                           "LOWPREC_GEMM_SCALE": {"blackwell": 0.88}},
              {"HOST_LAUNCH_MS": 14, "GROUPED_K0_LP": 9, "LOWPREC_GEMM_SCALE.blackwell": 15}),
    # 26.02.01: release_fit.fit's joint scan gives 0.045 / 1250, carried by the 26.04.01 configurations the table
    # also publishes as 26.02 (most of its 34 MoE rows); it puts two of the group's own rows past 15% (Qwen3-30B
    # B200 micro-batch 1 +19.8%, H100 +15.9%): the least-MAE values of before are kept until the fit weighs them
    "26.02.01": (("26.02", "26.02.01"), {"HOST_LAUNCH_MS": 0.05, "GROUPED_K0_LP": 0.0,
                                         "LOWPREC_GEMM_SCALE": {"blackwell": 0.92},
                                         "NVFP4_GEMM_SCALE": 0.65},
                 {"HOST_LAUNCH_MS": 34, "GROUPED_K0_LP": 25, "LOWPREC_GEMM_SCALE.blackwell": 20, "NVFP4_GEMM_SCALE": 6}),
    "26.04.01": (("26.04", "26.04.01"), {"HOST_LAUNCH_MS": 0.045, "GROUPED_K0_LP": 1000.0,
                                         "LOWPREC_GEMM_SCALE": {"blackwell": 0.96},
                                         "NVFP4_GEMM_SCALE": 0.7, "HYBRIDEP_NVL_EFF": HYBRIDEP_32SM_NVL_EFF},
                 {"HOST_LAUNCH_MS": 39, "GROUPED_K0_LP": 29, "LOWPREC_GEMM_SCALE.blackwell": 24, "NVFP4_GEMM_SCALE": 8}),
}
# Values of a group taken from a source, not fitted (``table`` names the source instead of a row count)
SOURCED = {"26.04.01": {"HYBRIDEP_NVL_EFF": "HybridEP's GB200 NVL72 benchmark at its default 32 SMs, which megatron-core "
                                            "0.17+ runs it on (moe_primitives.HYBRIDEP_32SM_NVL_EFF)"}}
# Constants fitted on every release's rows together (too few rows in any one release), with their row counts
POOLED: dict[str, tuple[dict, dict]] = {
    "SINK_ATTN_SCALE": ({"hopper": 0.85, "blackwell": 0.16}, {"hopper": 4, "blackwell": 17}),
}
# What a constant is where no fit has it, and its source
BASE = {"HOST_LAUNCH_MS": 0.04, "GROUPED_K0_LP": 6000.0, "LOWPREC_GEMM_SCALE": {"hopper": 0.98, "blackwell": 0.86},
        "NVFP4_GEMM_SCALE": 1.0, "HYBRIDEP_NVL_EFF": 0.49, "SINK_ATTN_SCALE": {"hopper": 1.0, "blackwell": 1.0}}
VALUE_SOURCES = {
    "HYBRIDEP_NVL_EFF": "HybridEP's own benchmark on GB200 NVL72 at megatron-core 0.16's 16 SMs (moe_primitives."
                        "FLEX_NVL_EFF)",
    "NVFP4_GEMM_SCALE": "1: the FP4 datasheet peak as the per-tensor FP8 GEMM reaches its own",
    "SINK_ATTN_SCALE": "1: the vanilla fused attention's rate",
    "HOST_LAUNCH_MS": "the 25.x MoE calibration's host time per MoE layer over its launches",
    "GROUPED_K0_LP": "the 25.x MoE calibration",
    "LOWPREC_GEMM_SCALE": "the 25.x low-precision calibration",
}
NAMES = ("HOST_LAUNCH_MS", "GROUPED_K0_LP", "LOWPREC_GEMM_SCALE", "NVFP4_GEMM_SCALE", "HYBRIDEP_NVL_EFF",
         "SINK_ATTN_SCALE")


def fit_of(release: str) -> str:
    """The fit a release is priced with: its own group's, else the nearest older group's (else the oldest)."""
    name = release or NEWEST
    for key, (covers, _, _) in FITS.items():
        if name in covers:
            return key
    older = [k for k in FITS if _order(k) <= _order(name)] if name in BY_NAME else []
    return max(older, key=_order) if older else min(FITS, key=_order)


def value(name: str, release: str):
    """The value of constant ``name`` for ``release`` (module docstring): the release's fit, else the nearest older
    fit that has it, else ``BASE``; a per-generation constant (a dict) key by key."""
    if isinstance(BASE[name], dict):
        return {g: _pick(name, release, g) for g in BASE[name]}
    if source_of(name, release):
        return FITS[source_of(name, release)][1][name]
    return POOLED[name][0] if name in POOLED else BASE[name]


def _pick(name: str, release: str, key: str):
    src = source_of(name, release, key)
    if src:
        return FITS[src][1][name][key]
    pooled = POOLED.get(name, ({}, {}))[0]
    return pooled.get(key, BASE[name][key])


def source_of(name: str, release: str, sub: str | None = None) -> str | None:
    """The fit ``value`` takes ``name`` (``name[sub]`` of a per-generation one) from for ``release`` (None:
    ``BASE``)."""
    key = fit_of(release)
    order = sorted(FITS, key=_order)
    i = order.index(key)
    return next((k for k in [key] + order[:i][::-1] if name in FITS[k][1]
                 and (sub is None or sub in FITS[k][1][name])), None)


def note(release: str) -> str | None:
    """What the release is priced with when not its own fit (None: its own)."""
    name = release or NEWEST
    key = fit_of(name)
    if name in FITS[key][0]:
        return None
    return f"release {name} has no fit of its own: priced with {key}'s"


def row_counts(release: str) -> dict[str, int]:
    """The published rows each constant of the release's fit was fitted on."""
    return dict(FITS[fit_of(release)][2])


def table(release: str) -> list[tuple[str, object, str]]:
    """(constant, value, where it comes from) of every constant for ``release``: its fit with the row count, the
    nearest release's fit, or its base source."""
    out = []
    for name in NAMES:
        for sub in (list(BASE[name]) if isinstance(BASE[name], dict) else [None]):
            label = f"{name}.{sub}" if sub else name
            src = source_of(name, release, sub)
            v = value(name, release)
            v = v[sub] if sub else v
            pooled = POOLED.get(name, ({}, {}))
            if src is None and (sub in pooled[0] if sub else name in POOLED):
                n = pooled[1].get(sub) if sub else pooled[1]
                out.append((label, v, f"fitted on {n} rows of every release together"))
            elif src is None:
                out.append((label, v, VALUE_SOURCES.get(name, "base")))
            elif label in SOURCED.get(src, {}):
                out.append((label, v, SOURCED[src][label] + ("" if src == fit_of(release) else f" ({src}'s)")))
            elif src == fit_of(release):
                out.append((label, v, f"fitted on {FITS[src][2].get(label, '?')} rows of {src}"))
            else:
                out.append((label, v, f"from {src}'s fit (the nearest older with rows)"))
    return out
