"""YaRN on standard attention (GPT-OSS's rope scaling) across stages on gloo against a single-process stock
megatron-core ``GPTModel(position_embedding_type="yarn")``: a tiny Llama with GPT-OSS's YaRN (tests/runtime/
test_yarn_runtime.py's, 4 layers) cut mid-layer into tp 2 | tp 1 dp 2, each stage holding attention units and
building its own ``YarnRotaryEmbedding``; loss and every gradient, 3 clipped optimizer steps and the weights after
them, as ``test_plans.py``. The control runs the same plan with the runtime's YaRN off (plain RoPE) in the same launch
and compares it with the same stock YaRN model: it fails on the loss and the attention gradients."""

from __future__ import annotations

import torch

from aceso_megatron.testing import run_plans, spawn
from tests.distributed.test_modern_plans import TC, plan, st
from tests.distributed.test_plans import SEED, STEPS, compare, reference_process  # noqa: F401 (fixture)
from tests.runtime.test_yarn_runtime import MODEL

YARN4 = MODEL.model_copy(update={"name": "tiny-llama-yarn-4", "num_layers": 4})
CUT = (st(2, 1, 0, 3, ["selective", "none", "full"]), st(1, 2, 3, 8, ["none", "selective", "none", "full", "none"]))


def test_yarn_across_stages_matches_single_process(tmp_path, reference_process):  # noqa: F811
    yarn = plan(YARN4, *CUT)
    plain = plan(YARN4.model_copy(update={"rope_scaling": None}), *CUT)
    out = tmp_path / "results.pt"
    spawn(4, run_plans, [yarn, plain], str(out), SEED, STEPS, TC)
    got, control = torch.load(out)
    failures = compare(["yarn tp 2 | tp 1 dp 2"], [yarn], [got])
    assert not failures, "\n".join(failures)
    # the control against the stock YaRN model: plain RoPE in the runtime is caught
    failures = compare(["plain RoPE in the runtime"], [yarn], [control])
    assert any("loss of step 1" in f for f in failures), failures
    assert any("linear_qkv.weight" in f for f in failures), failures
