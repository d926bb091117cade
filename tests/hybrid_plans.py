"""Plans cut at any unit (inside layers too) with one stage shape: what a Megatron-LM hybrid-pattern run
(``search/megatron/hybrid_pattern.py``) runs. Used by the unit tests and the Megatron-LM parser checks.

Each case: (model, chunk bounds in units (model order), pp, tp, dp, recompute per unit (one choice, or per chunk),
per-rank micro-batch, global batch, the pattern a reader writes by hand from the bounds, the first release with
it).
"""

from __future__ import annotations

from search.spec.plan import ChunkSpec, ParallelPlan, StageSpec
from search.settings.plan_settings import PlanSettings
from search.settings.precision import LowPrecision
from search.spec.presets import load_model

LLAMA4 = load_model("llama3-8b", num_layers=4)
MIXTRAL4 = load_model("mixtral-8x7b", num_layers=4)
# a DeepSeek-style first dense layer and an MTP layer on an MoE model (no Q/K norms: HybridModel has none)
MIXED4 = MIXTRAL4.model_copy(update={"name": "custom", "aceso_db_key": None, "mtp_num_layers": 1,
                                     "moe": MIXTRAL4.moe.model_copy(update={"first_k_dense_layers": 1})})



def _hybrid(preset: str, pattern: str):
    """A preset hybrid model at the depth of ``pattern`` (its Mamba-2 mixer, widths and MoE)."""
    d = load_model(preset).model_dump()
    return type(load_model(preset)).model_validate({**d, "name": "custom", "aceso_db_key": None,
                                                    "nominal_params_b": None, "hybrid_layer_pattern": pattern,
                                                    "num_layers": len(pattern)})


MAMBA8 = _hybrid("nemotron-h-8b", "M-M*-M-M")               # Nemotron-H's Mamba-2 / MLP / attention layers
NANO8 = _hybrid("nemotron-3-nano", "MEM*EMEM")              # Nemotron-3 Nano's Mamba-2 / MoE / attention layers
# Gated DeltaNet layers (megatron-core's 'G') in Nemotron-H 8B's widths, Qwen3-Next's GDN heads (16 key / 32 value
# heads of 128, conv 4: its config.json) but a key head dim of 64, so the export writes a non-default value
GDN8 = type(MAMBA8).model_validate({**MAMBA8.model_dump(), "mamba": None, "hybrid_layer_pattern": "G-G*-G-G",
                                   "gdn": {"linear_key_head_dim": 64}})


def cut_plan(model, bounds, pp: int, tp: int = 1, dp: int = 1, rc="none", mbs: int = 1, gbs: int = 16,
             sp: bool = False, **plan_fields) -> ParallelPlan:
    """Chunk k spans units ``bounds[k]`` to ``bounds[k + 1]`` on stage ``k % pp``; ``rc``: every unit's choice, or
    a function of (start, end) giving the chunk's choices."""
    stages = []
    for s in range(pp):
        chunks = [ChunkSpec(start_unit=a, end_unit=b, recompute=rc(a, b) if callable(rc) else [rc] * (b - a))
                  for a, b in zip(bounds[s:-1:pp], bounds[s + 1::pp])]
        stages.append(StageSpec(num_gpus=tp * dp, tp=tp, cp=1, dp=dp, sequence_parallel=sp, chunks=chunks))
    return ParallelPlan(model=model, micro_batch_size=mbs * dp, global_batch_size=gbs, stages=stages, **plan_fields)


def first_full(n: int):
    """The first ``n`` units of every chunk fully recomputed (``--recompute-method block`` over hybrid layers)."""
    return lambda a, b: ["full" if i < n else "none" for i in range(b - a)]


# id -> (plan, the pattern by hand, the oldest release that runs it)
CASES = {
    "llama-pp3-mid-layer": (cut_plan(LLAMA4, [0, 3, 5, 8], 3, tp=2), "*-*|-*|-*-", "0.17"),
    "llama-pp2-vpp2-selective": (cut_plan(LLAMA4, [0, 1, 4, 5, 8], 2, dp=2, rc=lambda a, b: [
        "selective" if u % 2 == 0 else "none" for u in range(a, b)]), "*|-*-|*|-*-", "0.17"),
    "llama-pp3-full": (cut_plan(LLAMA4, [0, 3, 5, 8], 3, tp=2, rc="full"), "*-*|-*|-*-", "0.18"),
    "llama-pp2-block3": (cut_plan(LLAMA4, [0, 5, 8], 2, rc=first_full(3)), "*-*-*|-*-", "0.18"),
    "moe-mtp-pp2": (cut_plan(MIXED4, [0, 3, 9], 2, dp=2, gbs=32), "*-*|E*E*E/*E", "0.17"),
    # FP8 with the first and last GPT layer in bf16: the first / last 2 hybrid layers
    "llama-fp8-bf16-ends": (cut_plan(LLAMA4, [0, 5, 8], 2, settings=PlanSettings(low_precision=LowPrecision(
        recipe="fp8-tensorwise", bf16_layers_start=1, bf16_layers_end=1))), "*-*-*|-*-", "0.17"),
    # hybrid models with Mamba-2 layers: VPP and an uneven cut, MoE with tp 2 and sequence parallelism
    "mamba-pp2-vpp2": (cut_plan(MAMBA8, [0, 1, 4, 5, 8], 2, tp=2), "M|-M*|-|M-M", "0.17"),
    "nano-moe-pp2-tp2": (cut_plan(NANO8, [0, 3, 8], 2, tp=2, dp=2, sp=True, gbs=32), "MEM|*EMEM", "0.17"),
    # GDN layers: core_v0.17's hybrid stack has the 'G' slot (gdn_layer) and the linear_* fields
    "gdn-pp2-vpp2": (cut_plan(GDN8, [0, 1, 4, 5, 8], 2, tp=2), "G|-G*|-|G-G", "0.17"),
}
