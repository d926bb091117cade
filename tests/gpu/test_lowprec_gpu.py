"""GPU tier (skipped without CUDA and transformer-engine): a low-precision plan trains like its bf16 twin.

One GPU, a bf16 GPT with transformer-engine specs; the plan's ``settings.low_precision`` is the recipe this GPU has
(FP8 current scaling on Ada/Hopper, MXFP8 on Blackwell), with the first and last layer kept in bf16, and once
without them (every layer quantized). 3 optimizer steps from the same weights and batches as the bf16 plan: every
loss finite, within 2 % of the bf16 losses (FP8 GEMMs of a 4-layer model at initialisation), and the losses fall.
Megatron-core's quantized layers are really used: each TE linear of an FP8 layer ran in an FP8 context
(``FP8GlobalStateManager``), checked through a forward hook.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the GPU tier runs on a machine with an NVIDIA GPU)", allow_module_level=True)
pytest.importorskip("transformer_engine")

from aceso_megatron.testing import make_batches, spawn  # noqa: E402
from search.spec.model import ModelSpec  # noqa: E402

STEPS, SEED = 3, 5
MODEL = ModelSpec(name="gpu-llama-lowprec", family="llama", num_layers=4, hidden_size=256, num_attention_heads=8,
                  ffn_hidden_size=1024, seq_length=128, vocab_size=1024, activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", tied_embeddings=False, add_bias_linear=False, params_dtype="bf16")


def _recipe() -> str:
    return "mxfp8" if torch.cuda.get_device_capability() >= (10, 0) else "fp8-tensorwise"


def _plan(low: dict | None) -> dict:
    raw = {"model": MODEL.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": [
        {"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": 8, "recompute": ["none"] * 8}]}
    if low is not None:
        raw["settings"] = {"framework": "megatron-lm", "low_precision": low}
    return raw


def _run(rank: int, world: int, out: str) -> None:
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    from aceso_megatron.training.engine import TrainConfig, build_runtime

    batches = make_batches(MODEL, 4, 8, SEED)
    recipe = _recipe()
    res = {}
    for name, low in (("bf16", None), ("kept", {"recipe": recipe, "bf16_layers_start": 1, "bf16_layers_end": 1}),
                      ("all", {"recipe": recipe})):
        rt = build_runtime(_plan(low), rank, world, seed=SEED, device="cuda", train_config=TrainConfig(clip_grad=1.0))
        quantized = set()
        for u in rt.chunks[0].units:   # the TransformerLayer runs inside the unit's FP8 context
            u.layer.register_forward_hook(lambda m, a, o, n=u.unit.layer: quantized.add(n)
                                          if FP8GlobalStateManager.is_fp8_enabled() else None)
        res[name] = [rt.train_step(iter(batches)) for _ in range(STEPS)]
        res[name + "_layers"] = sorted(quantized)
    torch.save(res, out)


def test_low_precision_plan_trains_like_bf16(tmp_path):
    out = tmp_path / "res.pt"
    spawn(1, _run, str(out), backend="nccl")
    res = torch.load(out)
    for name in ("kept", "all"):
        assert all(math.isfinite(x) for x in res[name]), res
        assert res[name] == pytest.approx(res["bf16"], rel=2e-2), res
        assert res[name][-1] < res[name][0], res
    assert res["bf16_layers"] == []
    assert res["kept_layers"] == [1, 2]         # layers 0 and 3 kept in bf16 (global layer numbers)
    assert res["all_layers"] == [0, 1, 2, 3]
