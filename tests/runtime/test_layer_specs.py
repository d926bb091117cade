"""A user's own layer spec and megatron block in one process: the provider's faults as one line, the block checked
against the imported ``TransformerConfig``, carving and the whole-layer rule, and one-stage plans of custom specs
equal to a single-process stock megatron-core ``GPTModel`` / ``T5Model`` built with the same spec (loss and every
gradient)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from search.io.errors import AcesoError
from search.spec.megatron_fields import transformer_config_fields
from search.spec.plan import ParallelPlan
from tests.conftest import ROOT
from tests.tiny_models import GPT, T5

QK = GPT.model_copy(update={"layer_spec": "tests.custom_specs:qk_norm_squared_relu",
                            "megatron": {"qk_layernorm": True, "layernorm_epsilon": 1e-6, "softmax_scale": 0.3,
                                         "init_method_std": 0.05}})
PARALLEL = GPT.model_copy(update={"layer_spec": "tests.custom_specs:parallel_block"})
T5_CUSTOM = T5.model_copy(update={"layer_spec": {"encoder": "tests.custom_specs:t5_encoder",
                                                 "decoder": "tests.custom_specs:t5_decoder"}})


def plan(model, *spans, mb=2, gbs=4) -> dict:
    """A plan of one-GPU stages over ``spans`` = [(start, end, recompute list), ...]."""
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": lo, "end_unit": hi, "recompute": rc}
                       for lo, hi, rc in spans]}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


# ----- the megatron block --------------------------------------------------------------------------------------------
def test_planner_reads_the_same_field_names_as_the_dataclass():
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert transformer_config_fields() == {f.name for f in dataclasses.fields(TransformerConfig)}


def test_block_values_are_converted_to_the_field_types():
    from megatron.core.transformer.enums import AttnBackend

    from model_specs.extensions import megatron_kwargs

    m = GPT.model_copy(update={"megatron": {"attention_backend": "unfused", "softmax_scale": 1,
                                            "qk_layernorm": True}})
    assert megatron_kwargs(m) == {"attention_backend": AttnBackend.unfused, "softmax_scale": 1.0,
                                  "qk_layernorm": True}
    from typing import Optional, Tuple

    from model_specs.extensions import _convert      # a tuple field (0.16.1's window_size is a spec field now)
    assert _convert([4, 0], Optional[Tuple[int, int]]) == (4, 0)


@pytest.mark.parametrize("block, message", [
    ({"softmax_scale": "big"}, "megatron.softmax_scale: 'big' is not a Optional[float]"),
    ({"qk_layernorm": 1}, "megatron.qk_layernorm: 1 is not a bool"),
    ({"attention_backend": "fastest"}, "megatron.attention_backend: 'fastest' is not a AttnBackend"),
    ({"autocast_dtype": "bf16"}, "callables and objects go in your layer_spec"),
])
def test_bad_block_values_are_one_line(block, message):
    from model_specs.extensions import megatron_kwargs

    with pytest.raises(AcesoError) as e:
        megatron_kwargs(GPT.model_copy(update={"megatron": block}))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_megatron_core_refusals_are_one_line():
    from aceso_megatron.model.layers import check_model

    m = GPT.model_copy(update={"megatron": {"activation_func_fp8_input_store": True}})
    with pytest.raises(AcesoError, match="megatron block: megatron-core's TransformerConfig refused it: Storing "
                                         "activation input in FP8 is supported only for SwiGLU"):
        check_model(ParallelPlan.model_validate(plan(m, (0, 4, ["none"] * 4))))


def test_fusions_stay_off_on_cpu_and_pass_through_on_gpu():
    from aceso_megatron.model.config import stage_config

    m = GPT.model_copy(update={"megatron": {"bias_activation_fusion": True, "apply_rope_fusion": True}})
    cpu = stage_config(m, 1, "cpu")
    assert not cpu.bias_activation_fusion and not cpu.apply_rope_fusion
    # on a GPU (described, not detected: config only, no kernel runs here) the block overrides the fast path's
    # choice both ways, and the fusions it does not name stay as the fast path chose them
    from aceso_megatron.model.fast_path import Environment, choose
    fast = choose(Environment(cuda=True, compute_capability=(9, 0)), GPT)
    assert fast.config["bias_activation_fusion"] and not fast.config["cross_entropy_loss_fusion"]
    block = {"bias_activation_fusion": False, "cross_entropy_loss_fusion": True}
    gpu = stage_config(GPT.model_copy(update={"megatron": block}), 1, "cuda", fast=fast)
    assert not gpu.bias_activation_fusion and gpu.cross_entropy_loss_fusion
    assert gpu.bias_dropout_fusion == fast.config["bias_dropout_fusion"] and not gpu.masked_softmax_fusion


# ----- the provider ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, message", [
    ("tests.no_such_module:f", "layer_spec 'tests.no_such_module:f': no module named tests.no_such_module; make "
                               "tests.no_such_module importable (installed, on PYTHONPATH or in the current folder)"),
    ("tests.custom_specs:nope", "tests.custom_specs has no attribute nope; check the name after ':'"),
    ("tests.custom_specs:not_a_spec", "layer_spec 'tests.custom_specs:not_a_spec' returned dict, not a "
                                      "megatron-core ModuleSpec"),
    ("tests.custom_specs:raises", "layer_spec 'tests.custom_specs:raises' raised RuntimeError: no spec for you"),
    ("tests.custom_specs:not_a_layer", "builds MLP, not a transformer layer"),
    ("tests.custom_specs:moe", "submodule mlp is an MoE layer (MoELayer); aceso prices and builds MoE layers from "
                              "the model's moe field"),
    ("tests.custom_specs:squared_relu", "layer_spec 'tests.custom_specs:squared_relu' raised TypeError"),
])
def test_provider_faults_are_one_line(path, message):
    from model_specs.extensions import provided_spec

    with pytest.raises(AcesoError) as e:
        provided_spec(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_provider_from_the_current_folder_and_as_a_spec_object(tmp_path, monkeypatch):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from model_specs.extensions import provided_spec

    (tmp_path / "team_specs_cwd.py").write_text("from tests.custom_specs import qk_norm_squared_relu as spec\n")
    (tmp_path / "team_specs_broken.py").write_text("import no_such_dependency\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert isinstance(provided_spec("team_specs_cwd:spec"), ModuleSpec)
    with pytest.raises(AcesoError, match="importing team_specs_broken failed: No module named 'no_such_dependency'"):
        provided_spec("team_specs_broken:spec")
    assert provided_spec("tests.custom_specs:SPEC_OBJECT").submodules.self_attention.submodules.q_layernorm


def test_qk_norms_need_the_qk_layernorm_flag():
    from aceso_megatron.model.layers import check_model

    bare = GPT.model_copy(update={"layer_spec": "tests.custom_specs:qk_norm_squared_relu"})
    with pytest.raises(AcesoError, match="self_attention.q_layernorm is a norm but the megatron block lacks "
                                         "qk_layernorm; add megatron: {qk_layernorm: true}"):
        check_model(ParallelPlan.model_validate(plan(bare, (0, 4, ["none"] * 4))))
    check_model(ParallelPlan.model_validate(plan(QK, (0, 4, ["none"] * 4))))


# ----- carving -------------------------------------------------------------------------------------------------------
def test_carving_rule():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.T5 import t5_spec

    from model_specs.extensions import provided_spec, whole_layer_reason

    for stock in (get_gpt_layer_local_spec(), t5_spec.encoder_model_with_local_spec(),
                  t5_spec.decoder_model_with_local_spec()):
        assert whole_layer_reason(stock) is None
    assert whole_layer_reason(provided_spec("tests.custom_specs:qk_norm_squared_relu")) is None
    assert whole_layer_reason(provided_spec("tests.custom_specs:parallel_block")) == \
        "ParallelBlock.forward is its own, not TransformerLayer's"


@pytest.mark.parametrize("spans, message", [
    ([(0, 1, ["full"]), (1, 4, ["full", "none", "none"])], "decoder layer 0 runs whole (layer_spec "
     "'tests.custom_specs:parallel_block': ParallelBlock.forward is its own, not TransformerLayer's), but the plan "
     "cuts it between units 0 and 2; put stage boundaries at layer edges (units 0, 2, 4, ...)"),
    ([(0, 4, ["none", "none", "full", "none"])], "decoder layer 1 runs whole"),
    ([(0, 4, ["selective"] * 4)], "but its units take recompute ['selective', 'selective']; give all its units none "
                                  "or all full"),
])
def test_whole_layer_plans_are_refused_before_any_group(monkeypatch, single_process, spans, message):
    from aceso_megatron.model.layers import check_model
    from aceso_megatron.training import build_steps, engine

    raw = plan(PARALLEL, *spans)
    with pytest.raises(AcesoError) as e:
        check_model(ParallelPlan.model_validate(raw))
    assert message in str(e.value) and "\n" not in str(e.value)
    if len(spans) == 1:   # one process: through the runtime's entry, which must stop before building groups
        def no_groups(*a, **k):
            raise AssertionError("process groups were built")

        monkeypatch.setattr(build_steps, "build_groups", no_groups)   # the groups step's call
        with pytest.raises(AcesoError, match="runs whole"):
            engine.build_runtime(raw, 0, 1)


def test_attn_dropout_needs_dot_product_attention(tmp_path, monkeypatch):
    from aceso_megatron.model.layers import check_model

    (tmp_path / "flash_specs.py").write_text(
        "import dataclasses\n"
        "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"
        "from megatron.core.transformer.dot_product_attention import DotProductAttention\n"
        "class MyCore(DotProductAttention):\n    pass\n"
        "def spec():\n    s = get_gpt_layer_local_spec()\n    a = s.submodules.self_attention\n"
        "    a = dataclasses.replace(a, submodules=dataclasses.replace(a.submodules, core_attention=MyCore))\n"
        "    return dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=a))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    m = GPT.model_copy(update={"layer_spec": "flash_specs:spec"})
    check_model(ParallelPlan.model_validate(plan(m, (0, 4, ["selective", "none", "full", "none"]))))
    with pytest.raises(AcesoError, match="unit 2: attn_dropout needs megatron-core's DotProductAttention as "
                                         "self_attention's core attention, but layer_spec 'flash_specs:spec' "
                                         "has MyCore"):
        check_model(ParallelPlan.model_validate(plan(m, (0, 4, ["none", "none", "attn_dropout", "none"]))))


# ----- one-stage plans equal the stock model built with the same spec ----------------------------------------------
def run_both(raw: dict, seed: int = 3, reference_model=None):
    """The runtime on ``raw`` and the stock model (of ``reference_model``, default the plan's) on the same batches."""
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.training.engine import TrainConfig, build_runtime

    tc = TrainConfig(lr=1e-3)
    rt = build_runtime(raw, 0, 1, seed=seed, train_config=tc)
    m = rt.plan.model
    batches = make_batches(m, rt.plan.micro_batch_size, rt.plan.global_batch_size, seed)
    loss, grads = rt.forward_backward(iter(batches)), rt.full_grads()
    ref = Reference(reference_model or m, seed=seed, train_config=tc)
    return rt, (loss, grads), (ref.forward_backward(batches), ref.grads())


def assert_equal(got, want, tol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert set(grads) == set(ref_grads)
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    for k, g in ref_grads.items():
        err = float((grads[k] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= tol, f"{k}: rel err {err:.2e}"


def test_custom_spec_one_stage_equals_stock_model(single_process):
    raw = plan(QK, (0, 4, ["attn_dropout", "selective", "full", "selective"]))
    rt, got, want = run_both(raw)
    assert_equal(got, want)
    names = set(got[1])
    assert {"decoder.layers.1.self_attention.q_layernorm.weight", "decoder.layers.0.mlp.linear_in.weight"} <= names
    cfgs = [rt.stage_module.config] + [u.layer.config for u in rt.stage_module.units]
    assert all((c.qk_layernorm, c.layernorm_epsilon, c.softmax_scale, c.init_method_std) == (True, 1e-6, 0.3, 0.05)
               for c in cfgs)
    assert all(u.layer.self_attention.core_attention.softmax_scale == 0.3 for u in rt.stage_module.units[0::2])
    # the block's init std and the user's activation really are used: the stock model gives another loss
    _, (stock_loss, _), _ = run_both(plan(GPT, (0, 4, ["none"] * 4)))
    assert abs(stock_loss - got[0]) > 1e-3


@pytest.mark.parametrize("style", ["v016", "v019"])
def test_spec_written_for_a_release_equals_stock_model(single_process, style):
    """The same custom layer written in megatron-core 0.16's style (the MLP slot a ``ModuleSpec`` of the subclass)
    and in 0.19's (``partial(ProjectedMLP.as_mlp_submodule, submodules=...)``). 0.19-style specs need 0.19; a
    0.16-style one runs on 0.19 too (its slot becomes the subclass's builder, ``patches.compat.mlp_on_group``),
    where stock megatron-core cannot build it: the reference there is the 0.19-style spec, the same modules."""
    from patches.compat import at_least

    if style == "v019" and not at_least("0.19"):
        pytest.skip("a 0.19-style spec (as_mlp_submodule) needs megatron-core 0.19")
    model = QK.model_copy(update={"layer_spec": f"tests.custom_specs:qk_norm_squared_relu_{style}"})
    reference = QK.model_copy(update={"layer_spec": "tests.custom_specs:qk_norm_squared_relu"})
    rt, got, want = run_both(plan(model, (0, 4, ["none", "selective", "full", "none"])), reference_model=reference)
    assert_equal(got, want)
    assert "decoder.layers.1.mlp.linear_in.weight" in got[1]
    assert all(type(u.layer.mlp).__name__ == "ProjectedMLP" for u in rt.stage_module.units[1::2])


def test_selective_recompute_frees_a_custom_activation(single_process):
    from aceso_megatron.profiler.memory import SavedTensors
    from aceso_megatron.training.engine import build_runtime

    def kept(rc: str) -> int:
        rt = build_runtime(plan(QK, (0, 4, ["none", rc, "none", "none"])), 0, 1, seed=1)
        unit = rt.stage_module.units[1]
        x = torch.randn(GPT.seq_length, 2, GPT.hidden_size, requires_grad=True)
        with SavedTensors(exclude=[x], params=list(rt.stage_module.parameters())) as saved:
            out = unit(x)
        nbytes = saved.nbytes   # while the graph holds them
        out.sum().backward()
        return nbytes

    assert kept("none") - kept("selective") == GPT.seq_length * 2 * GPT.ffn_hidden_size * 4   # squared ReLU output


def test_whole_layers_one_stage_equal_stock_model(single_process):
    rt, got, want = run_both(plan(PARALLEL, (0, 4, ["full", "full", "none", "none"])))
    assert_equal(got, want)
    assert [u.num_units for u in rt.stage_module.units] == [2, 2]


def test_t5_custom_specs_one_stage_equal_stock_model(single_process):
    rc = ["selective", "full", "none", "selective", "attn_dropout", "selective", "selective", "none", "none", "full"]
    _, got, want = run_both(plan(T5_CUSTOM, (0, 10, rc)))
    assert_equal(got, want)


# ----- the command line ----------------------------------------------------------------------------------------------
def cuda_home_env(tmp_path) -> dict:
    """The environment with ``CUDA_HOME`` set to a folder: torch's CUDA build (Python 3.12's, from PyPI) then logs
    "No CUDA runtime is found, using CUDA_HOME=..." on this GPU-less machine when megatron-core 0.19 imports
    ``torch.utils.cpp_extension``; the bad input must still be one line (``patches.compat.quiet_cuda_build_notices``)."""
    import os

    (tmp_path / "cuda").mkdir(exist_ok=True)
    return {**os.environ, "CUDA_HOME": str(tmp_path / "cuda")}


@pytest.mark.parametrize("model, rc, message", [
    (GPT.model_copy(update={"layer_spec": "tests.no_such_module:f"}), ["none"] * 4,
     "no module named tests.no_such_module"),
    (GPT.model_copy(update={"layer_spec": "tests.custom_specs:not_a_spec"}), ["none"] * 4,
     "returned dict, not a megatron-core ModuleSpec"),
    (PARALLEL, ["full", "none", "none", "none"], "decoder layer 0 runs whole"),
])
def test_train_exits_2_with_one_line(tmp_path, model, rc, message):
    (tmp_path / "plan.json").write_text(json.dumps(plan(model, (0, 4, rc))))
    r = subprocess.run([sys.executable, "-m", "search", "train", str(tmp_path / "plan.json"), "--cpu",
                        "--mock-data", "--train-iters", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=cuda_home_env(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("aceso train: error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("layer_spec, message", [
    ("tests.custom_specs:not_a_spec", "returned dict, not a megatron-core ModuleSpec"),
    ("tests.custom_specs:parallel_block", "so its layers run whole; the profiler measures attention and MLP units one "
                                          "by one and cannot profile it yet"),
])
def test_profile_exits_2_with_one_line_before_any_worker(tmp_path, layer_spec, message):
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({**GPT.model_dump(exclude_unset=True), "layer_spec": layer_spec}))
    r = subprocess.run([sys.executable, "-m", "search", "profile", "--model", str(spec), "--cpu", "-o",
                        str(tmp_path / "db.json"), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=cuda_home_env(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr   # no torchrun started, no traceback
    assert not list(tmp_path.glob("db.json*"))
