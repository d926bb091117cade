"""Each Megatron-LM release's own argument parser (core_v0.16.1 to core_v0.19.0) accepts every command line exported
for it and builds each pipeline rank's model chunks with exactly the plan's layers, recompute setting and
vocabulary; and does what aceso's release rules say (search/megatron/versions.py RULES).

Needs Megatron-LM checkouts (megatron/training is not in every megatron-core wheel): ``ACESO_MEGATRON_LM`` names one,
with ``{tag}`` standing for the release (``/src/{tag}``: one per tag; a path without ``{tag}`` is core_v0.16.1's);
a release without its checkout, or whose ``requires-python`` this Python does not meet (0.17 and later need 3.12),
is skipped. The checkout's own megatron-core runs (PYTHONPATH).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from search.megatron import megatron_config
from search.megatron.script import args_line
from search.megatron.versions import release, tags
from tests.megatron_plans import CASES, case_plan

TAGS = tags()


def _checkout(tag: str) -> Path:
    env = os.environ.get("ACESO_MEGATRON_LM")
    root = (env.replace("{tag}", tag) if "{tag}" in env else (env if tag == "core_v0.16.1" else None)) if env else None
    if not root or not (Path(root) / "megatron" / "training").is_dir():
        pytest.skip(f"set ACESO_MEGATRON_LM to a Megatron-LM {tag} checkout ({{tag}} for each release)")
    m = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', (Path(root) / "pyproject.toml").read_text())
    if m and sys.version_info[:2] < (int(m.group(1)), int(m.group(2))):
        pytest.skip(f"Megatron-LM {tag} needs Python >= {m.group(1)}.{m.group(2)}")
    return Path(root)


def _oracle(plans, tag: str, lines=None) -> list[dict]:
    """What Megatron-LM ``tag`` (its checkout) makes of each plan's command line exported for it
    (megatron_lm_oracle.py), or of ``lines`` when given."""
    root = _checkout(tag)
    plans = list(plans.values() if isinstance(plans, dict) else plans)
    lines = lines or [args_line(megatron_config(p), release(tag)) for p in plans]
    cases = [{"line": line, "world": p.world_size} for line, p in zip(lines, plans)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_oracle.py"))], input=json.dumps(cases),
                       capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_takes_the_fsdp_and_offload_flags(tag):
    """Megatron FSDP (each strategy) and CPU activation offload as exported: parsed, validated (fsdp_dtensor,
    CUDA_DEVICE_MAX_CONNECTIONS unset) and in megatron-core's TransformerConfig (offload: one stage, no recompute)."""
    from search.settings.fsdp import ActivationOffload, MegatronFSDP
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    model = load_model("llama3-8b", num_layers=4)
    plans = [uniform_plan(model, 1, 2, 4, 4, 16, "none", overlap_grad_reduce=True, overlap_param_gather=s != "no_shard",
                          megatron_fsdp=MegatronFSDP(data_parallel_sharding_strategy=s),
                          activation_offload=ActivationOffload(num_layers=2) if s == "optim_grads_params" else None)
             for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    for plan, got in zip(plans, _oracle(plans, tag)):
        assert "error" not in got, got
        s = plan.megatron_fsdp.data_parallel_sharding_strategy
        assert got["fsdp"] == [True, s, "fsdp_dtensor"]
        assert got["offload"] == ([True, 2] if plan.activation_offload else [False, 0])


@pytest.mark.parametrize("tag", TAGS)
def test_the_releases_rules_are_what_its_validate_args_and_tokenizer_do(tag):
    """The command line without --data-parallel-sharding-strategy and --use-distributed-optimizer: the strategy is
    the release's parser default, the distributed optimizer what validate_args leaves (RULES
    fsdp_forces_distributed_optimizer), as the importer reads them; NullTokenizer's vocabulary (RULES
    null_tokenizer_counts_eod) is the plan's on every exported line."""
    from search.settings.fsdp import MegatronFSDP
    from search.megatron.importer import read_megatron
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    rel = release(tag)
    plan = uniform_plan(load_model("llama3-8b", num_layers=4), 1, 1, 8, 8, 16, "none", overlap_grad_reduce=True,
                        megatron_fsdp=MegatronFSDP(data_parallel_sharding_strategy="optim"))
    line = re.sub(r" --data-parallel-sharding-strategy \S+| --use-distributed-optimizer", "",
                  args_line(megatron_config(plan), rel))
    (got,) = _oracle([plan], tag, [line])
    imp = read_megatron(line, world_size=8, version=tag)
    assert got["fsdp"] == [True, imp.plan.megatron_fsdp.data_parallel_sharding_strategy, "fsdp_dtensor"]
    assert got["distributed_optimizer"] == imp.plan.distributed_optimizer == rel.rule(
        "fsdp_forces_distributed_optimizer")
    plans = [case_plan(n) for n in sorted(CASES)]
    for p, got in zip(plans, _oracle(plans, tag)):
        assert got["vocab"] == [p.model.vocab_size, p.model.padded_vocab_size], p.model.name


@pytest.mark.parametrize("tag", TAGS)
def test_a_te_loss_fusion_plan_is_written_as_the_release_validates_it(tag):
    """A plan with transformer-engine's cross-entropy fusion (a Bridge recipe's) exports a line the release's
    validate_args takes: te up to core_v0.17.1, native from core_v0.18.2 (RULES te_cross_entropy_refused), and the
    raw te line is refused by exactly the releases the rule names."""
    from search.settings.stack import StackSettings
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    rel = release(tag)
    plan = uniform_plan(load_model("llama3-8b", num_layers=4), 1, 1, 8, 8, 16, "none",
                        stack=StackSettings(cross_entropy_fusion="te"))
    line = args_line(megatron_config(plan), rel)
    impl = "native" if rel.rule("te_cross_entropy_refused") else "te"
    assert f"--cross-entropy-fusion-impl {impl}" in line
    raw = line.replace("--cross-entropy-fusion-impl native", "--cross-entropy-fusion-impl te")
    written, te = _oracle([plan, plan], tag, [line, raw])
    assert "error" not in written, written
    assert ("error" in te) == rel.rule("te_cross_entropy_refused"), te


def _local_graphs_ep2_plan(offload: bool = False):
    """A drop-and-pad MoE plan on 4 ranks with expert parallelism 2 and megatron-core's own full-iteration graph
    (what the search offers drop-and-pad MoE: ``dispatchers.graph_candidates``), or with the expert offload."""
    from search.settings.stack import CudaGraphs, FineGrainedOffload, StackSettings
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    from tests.unit.test_moe_cost import tiny_moe
    m = tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    data = uniform_plan(m, 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-h100")).model_dump()
    data["stages"][0]["ep"] = 2
    stack = StackSettings(offload=FineGrainedOffload(modules=("expert_fc1",))) if offload else \
        StackSettings(cuda_graphs=CudaGraphs(impl="local", scope=("full_iteration",)))
    data["settings"]["stack"] = stack.model_dump()
    from search.spec.plan import ParallelPlan
    return ParallelPlan.model_validate(data)


@pytest.mark.parametrize("tag", TAGS)
def test_local_graphs_with_ep_are_written_as_the_release_validates_them(tag):
    """megatron-core's own CUDA graphs with ep 2: the exported line passes the release's validate_args (core_v0.16.1
    and core_v0.17.1 assert --moe-pad-experts-for-cuda-graph-inference, an inference-only flag: RULES
    local_graphs_ep_need_no_inference_pad), the line without the flag is refused by exactly the releases the rule
    names, and the import refuses it there too (one line naming the flag)."""
    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    rel = release(tag)
    plan = _local_graphs_ep2_plan()
    line = args_line(megatron_config(plan), rel)
    pad = "--moe-pad-experts-for-cuda-graph-inference"
    assert (pad in line) == (not rel.rule("local_graphs_ep_need_no_inference_pad"))
    bare = line.replace(" " + pad, "")
    written, raw = _oracle([plan, plan], tag, [line, bare])
    assert "error" not in written, written
    assert ("error" in raw) == (not rel.rule("local_graphs_ep_need_no_inference_pad")), raw
    assert read_megatron(line, world_size=4, version=tag).plan.stages[0].ep == 2
    if "error" in raw:
        with pytest.raises(AcesoError, match=pad):
            read_megatron(bare, world_size=4, version=tag)
    else:
        read_megatron(bare, world_size=4, version=tag)


@pytest.mark.parametrize("tag", TAGS)
def test_offload_with_local_layers_is_refused_as_the_release_refuses_it(tag, monkeypatch):
    """The fine-grained offload with --transformer-impl local: the release's validate_args refuses it, and so does
    the import (one line). (``NVTE_CPU_OFFLOAD_V1=1``: the exported script's own export line.)"""
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    rel = release(tag)
    plan = _local_graphs_ep2_plan(offload=True)
    line = args_line(megatron_config(plan), rel)          # transformer_engine: the plan was not priced unfused
    local = line.replace("--transformer-impl transformer_engine", "--transformer-impl local")
    assert local != line
    te, got = _oracle([plan, plan], tag, [line, local])
    assert "error" not in te, te
    assert "error" in got and "transformer_engine" in got["error"], got
    with pytest.raises(AcesoError, match="--transformer-impl local"):
        read_megatron(local, world_size=4, version=tag)


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_parses_validates_and_builds_the_plans_layers(tag):
    plans = {n: case_plan(n) for n in sorted(CASES)}
    for (name, plan), got in zip(plans.items(), _oracle(plans, tag)):
        assert "error" not in got, (name, got)
        c = megatron_config(plan)
        assert got["dp"] == c.dp and got["micro_batch_size"] == c.micro_batch_size, name
        if not plan.model.is_t5:                  # T5's two blocks are built by pretrain_t5.py, not from the config
            starts = [0]
            for n in c.chunk_layers:
                starts.append(starts[-1] + n)
            assert got["chunks"] == [[a, n] for a, n in zip(starts, c.chunk_layers)], name
        rc = c.recompute
        assert got["recompute"] == [rc.granularity, rc.method, rc.num_layers,
                                    list(rc.modules) if rc.granularity == "selective" else None], name
        assert got["sequence_parallel"] == c.sequence_parallel, name
        m = plan.model                            # GPT-OSS's layer fields (search.layers.layer_variants) as megatron-core's
        assert got["kv_channels"] == m.head_dim, name
        assert got["layer_variants"] == {
            "window_size": m.window_size, "window_attn_skip_freq": m.window_attn_skip_freq,
            "softmax_type": m.softmax_type or "vanilla", "glu_linear_offset": m.glu_linear_offset or 0.0,
            "activation_func_clamp_value": m.activation_func_clamp_value,
            "activation": {"gelu": "gelu", "swiglu": "silu", "quick_geglu": "quick_gelu"}[m.activation],
            "gated": m.gated_mlp}, name


def _expected_moe(c) -> dict:
    """What megatron-core's config must hold for the MoE plan's MegatronConfig (our fields, its names)."""
    from search.megatron.moe_flags import freq_list
    m, moe, s = c.model, c.model.moe, c.settings.moe
    mla = m.mla.model_dump() if m.mla else dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                           "qk_pos_emb_head_dim", "v_head_dim"))
    freq = moe.moe_layer_freq if isinstance(moe.moe_layer_freq, int) and not moe.first_k_dense_layers \
        else freq_list(moe, m.num_layers)
    return {"num_moe_experts": moe.num_experts, "moe_router_topk": moe.moe_router_topk,
            "moe_ffn_hidden_size": moe.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size, "moe_layer_freq": freq,
            "moe_router_score_function": moe.moe_router_score_function,
            "moe_router_num_groups": moe.moe_router_num_groups, "moe_router_group_topk": moe.moe_router_group_topk,
            "moe_router_enable_expert_bias": moe.moe_router_enable_expert_bias,
            "moe_aux_loss_coeff": moe.moe_aux_loss_coeff,
            # the exported --moe-router-load-balancing-type: the type, none for an aux-loss type at coefficient 0
            "moe_router_load_balancing_type": moe.moe_router_load_balancing_type
            if moe.moe_aux_loss_coeff or moe.moe_router_load_balancing_type == "sinkhorn" else "none",
            "moe_expert_capacity_factor": moe.moe_expert_capacity_factor,
            "moe_router_force_load_balancing": moe.moe_router_force_load_balancing,
            "expert_model_parallel_size": c.ep, "expert_tensor_parallel_size": c.etp or c.tp,
            "moe_token_dispatcher_type": s.token_dispatcher, "moe_grouped_gemm": s.grouped_gemm,
            "moe_permute_fusion": s.permute_fusion, "moe_shared_expert_overlap": s.shared_expert_overlap,
            "overlap_moe_expert_parallel_comm": s.overlap_ep_comm, "moe_flex_dispatcher_backend": s.flex_backend,
            "moe_pad_expert_input_to_capacity": moe.moe_pad_expert_input_to_capacity,
            "multi_latent_attention": m.mla is not None,
            **mla, "qk_layernorm": bool((m.megatron or {}).get("qk_layernorm")), "mtp_num_layers": m.mtp_num_layers}


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_reads_the_moe_mla_mtp_plans_as_planned(tag):
    from tests.megatron_moe_plans import MOE_CASES, moe_case_plan
    plans = {n: moe_case_plan(n) for n in sorted(MOE_CASES)}
    for (name, plan), got in zip(plans.items(), _oracle(plans, tag)):
        assert "error" not in got, (name, got)
        c = megatron_config(plan)
        starts = [0]
        for n in c.chunk_layers:
            starts.append(starts[-1] + n)
        assert got["chunks"] == [[a, n] for a, n in zip(starts, c.chunk_layers)], name
        assert got["moe"] == _expected_moe(c), name
        rc = c.recompute                      # moe_act / mla_up_proj as megatron-core's TransformerConfig holds them
        assert got["recompute"] == [rc.granularity, rc.method, rc.num_layers,
                                    list(rc.modules) if rc.granularity == "selective" else None], name
        assert got["mtp_chunk"] == (len(c.chunk_layers) - 1 if c.model.mtp_num_layers else None), name
        assert got["dp"] == c.dp and got["micro_batch_size"] == c.micro_batch_size, name
        # the preset's norm epsilon and YaRN (its config.json's: tests/unit/test_preset_hf_fields.py) as Megatron-LM's
        # parser and config builder read the exported line
        a, rs = got["arch"], c.model.rope_scaling
        assert a["layernorm_epsilon"] == (c.model.megatron or {}).get("layernorm_epsilon", 1e-5), name
        if rs is not None and rs.type == "yarn":
            assert (a["rotary_scaling_factor"], a["mscale_all_dim"]) == (rs.factor, rs.yarn("mscale_all_dim")), name


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_builds_the_imported_hf_models_fields(tag):
    """The published Hugging Face configs (tests/unit/data/hf) as imported and exported: Megatron-LM's own parser
    and config builder give each the QKV bias, QK norm, norm epsilon, top-k scaling, rotary percent and RoPE scaling
    the config.json has."""
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    from tests.unit.test_hf_real_configs import IMPORTED, spec

    plans = [uniform_plan(spec(n).model_copy(update={"num_layers": 5}), 1, 1, 8, 8, 64,
                          cluster=parse_cluster("1x8-h100")) for n in IMPORTED]
    got = {n: g for n, g in zip(IMPORTED, _oracle(plans, tag))}
    for n, g in got.items():
        assert "error" not in g, (n, g)
    arch = {n: g["arch"] for n, g in got.items()}
    want_eps = {"qwen2.5-7b": 1e-6, "qwen3-8b": 1e-6, "qwen3-30b-a3b": 1e-6, "deepseek-v3": 1e-6}
    for n, a in arch.items():
        assert a["layernorm_epsilon"] == want_eps.get(n, 1e-5), n
        assert a["add_qkv_bias"] is (n in ("qwen2.5-7b", "glm-4.5")) and a["add_bias_linear"] is False, n
        assert a["qk_layernorm"] is (n in ("qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "glm-4.5")), n
        assert a["rotary_percent"] == (0.5 if n == "glm-4.5" else 1.0), n
        assert a["use_rope_scaling"] is (n == "llama-3.1-8b"), n
        assert a["moe_router_topk_scaling_factor"] == (2.5 if n in ("deepseek-v3", "glm-4.5") else None), n
    assert arch["llama-3.1-8b"]["rope_scaling_factor"] == 8.0 and arch["llama-3.1-8b"]["rotary_base"] == 500000
    ds = arch["deepseek-v3"]       # DeepSeek-V3's config.json: yarn, factor 40, 4096, beta 32 / 1, mscale 1 / 1
    assert (ds["rope_type"], ds["rotary_scaling_factor"], ds["original_max_position_embeddings"], ds["beta_fast"],
            ds["beta_slow"], ds["mscale"], ds["mscale_all_dim"]) == ("yarn", 40.0, 4096, 32, 1, 1.0, 1.0)


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_runs_the_alignment_each_plan_was_priced_with(tag):
    """A runtime plan (bucket hooks: neither aligned), a Bridge plan (v0.3.1: gradients aligned, parameters not) and
    a Megatron-LM plan, interleaved with both DP overlaps, exported for Megatron-LM: its parser leaves
    ``align_grad_reduce`` / ``align_param_gather`` as the plan's price assumed (``run_settings``)."""
    from search.costmodel.plan_view import run_settings
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    base = uniform_plan(load_model("llama3-8b", num_layers=4), 2, 1, 4, 4, 16, "none", num_virtual_stages=2,
                        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    plans = [base.model_copy(update={"settings": base.settings.model_copy(update={"framework": f})})
             for f in ("runtime", "megatron-bridge", "megatron-lm")]
    for plan, got in zip(plans, _oracle(plans, tag)):
        rs = run_settings(plan.settings, "bf16")
        assert got["align"] == [rs.align_grad_reduce, rs.align_param_gather], plan.settings.framework


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_reads_the_router_and_init_std_as_exported(tag):
    """The softmax router each preset has (Qwen2-57B-A14B pre-softmax: its config.json's norm_topk_prob false;
    Qwen3 and Mixtral not; DeepSeek-V3's sigmoid router not written) and a stated init std, as Megatron-LM's parser
    and config builder read the exported line (tests/unit/test_router_pre_softmax.py, test_nemotron_init_std.py)."""
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    want = {"qwen2-57b-a14b": True, "qwen3-30b-a3b": False, "mixtral-8x7b": False, "deepseek-v3": False}
    plans = []
    for name in want:
        m = load_model(name, num_layers=4)
        m = m.model_copy(update={"megatron": {**(m.megatron or {}), "init_method_std": 0.0173}})
        plans.append(uniform_plan(m, 1, 1, 8, 8, 64))
    for name, got in zip(want, _oracle(plans, tag)):
        assert "error" not in got, (name, got)
        assert got["arch"]["moe_router_pre_softmax"] is want[name], name
        assert got["arch"]["init_method_std"] == 0.0173, name
        qwen2 = name == "qwen2-57b-a14b"      # q/k/v biases and the shared expert's sigmoid gate: its config.json's
        assert (got["arch"]["add_qkv_bias"], got["arch"]["moe_shared_expert_gate"]) == (qwen2, qwen2), name


@pytest.mark.parametrize("tag", TAGS)
def test_the_precision_aware_optimizer_is_written_as_the_release_reads_it(tag):
    """The optimizer state dtypes (settings.precision_aware_optimizer) as exported: the release's validate_args takes
    them (adam, the distributed optimizer) and its args hold the dtypes the plan was priced with; and the deprecated
    --enable-cuda-graph / --external-cuda-graph are the cuda_graph_impl the import reads them as
    (search/megatron/deprecated.py)."""
    from search.megatron.importer import read_megatron
    from search.settings.optimizer_state import PrecisionAwareOptimizer
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    model = load_model("llama3-8b", num_layers=4)
    states = [PrecisionAwareOptimizer(), PrecisionAwareOptimizer(main_params_dtype="fp16", exp_avg_dtype="bf16",
                                                                 exp_avg_sq_dtype="fp8")]
    plans = [uniform_plan(model, 1, 2, 4, 4, 16, "none", distributed_optimizer=True, precision_aware_optimizer=st)
             for st in states]
    rel = release(tag)
    lines = [args_line(megatron_config(p), rel) for p in plans]
    base = lines[0]
    graphs = [base + " --enable-cuda-graph", base + " --external-cuda-graph"]
    got = _oracle(plans + plans, tag, lines + graphs)
    for st, g in zip(states, got[:2]):
        assert "error" not in g, g
        assert g["optimizer_state"][0] == "True"
        # validate_args maps the names to torch dtypes (arguments.py map_dtype; fp8 is torch.uint8)
        torch_names = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16", "fp8": "torch.uint8"}
        assert g["optimizer_state"][1:] == [torch_names[d] for d in (st.main_params_dtype, st.exp_avg_dtype,
                                                                     st.exp_avg_sq_dtype)], g
    for line, g in zip(graphs, got[2:]):
        assert "error" not in g, g
        imp = read_megatron(line, world_size=plans[0].world_size, version=tag)
        assert imp.plan.settings.stack.cuda_graphs.impl == g["cuda_graph_impl"]
