"""A corpus of bad inputs across every subcommand and file format (issue 15): each must exit 2 with at most two
lines on stderr naming the field or path, no traceback, nothing on stdout, nothing written or changed, and
without importing torch (bad input is caught before the runtime's heavy imports).

Each case runs ``aceso`` in-process (``search.cli.main``) in a fresh temporary folder holding the good files
below (``BASE``); a case adds or replaces files (a good file with one field broken) and names the text its
error line must contain. The fault tests (FIFOs, links, full disk, read-only folder, signals) are in
``test_faults.py``.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.compat.mapping import plan_to_ref
from search.costmodel.profiledb import ProfileDBWriter
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 512, "params_dtype": "fp32"}
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 32, "intermediate_size": 11008, "max_position_embeddings": 4096,
         "vocab_size": 32000, "rope_theta": 10000.0, "tie_word_embeddings": False}
DELETE = object()
MOE = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}


def _tiny_plan() -> dict:
    model = ModelSpec.model_validate(TINY)
    return json.loads(uniform_plan(model, 1, 1, 2, 2, 8, cluster=parse_cluster("1x2-cpu")).to_json())


def _preflight_plan(tp=1, cp=1, dp=2, **model) -> dict:
    """A tiny CPU plan for the one pre-flight's cases (issue 25)."""
    spec = ModelSpec.model_validate({**TINY, **model})
    return json.loads(uniform_plan(spec, 1, tp, dp, 2, 8, cluster=parse_cluster(f"1x{tp * cp * dp}-cpu"),
                                   cp=cp).to_json())


def _gpu_plan(dtype: str = "bf16") -> dict:
    """gpt-1.3b on 8 H100s in bf16 (the aceso runtime trains fp16 nowhere but a V100: runtime_rules.fp16_on_gpu)."""
    model = load_model("gpt-1.3b").model_copy(update={"params_dtype": dtype})
    return json.loads(uniform_plan(model, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100")).to_json())


def _dropout_plan() -> dict:
    """Attention dropout 0.1, attn_dropout on the attention units, one V100 (unfused attention)."""
    model = ModelSpec.model_validate({**TINY, "attention_dropout": 0.1})
    plan = json.loads(uniform_plan(model, 1, 1, 1, 2, 8, cluster=parse_cluster("1x1-v100")).to_json())
    plan["stages"][0]["chunks"][0]["recompute"] = ["attn_dropout", "none"] * 4
    return plan


def _profile_db() -> dict:
    w = ProfileDBWriter(ModelSpec.model_validate(TINY), gpu="cpu", dtype="fp32")
    for b in (1, 2):
        for kind in ("attention", "mlp"):
            w.add_unit("decoder", kind, 64, b, 1, fwd_us=10.0 * b, bwd_us=20.0 * b, recompute_us=(0, 2, 10),
                       act_bytes=(1e5 * b, 6e4 * b, 2e4 * b), weight_bytes=4e4)
        w.add_part("embedding", 64, b, 1, fwd_us=1.0 * b, bwd_us=3.0 * b, act_bytes=1e4 * b, weight_bytes=3e4)
        w.add_part("head", 64, b, 1, fwd_us=5.0 * b, bwd_us=9.0 * b, act_bytes=5e4 * b, weight_bytes=1e3)
    w.add_collective("all_reduce", 2, False, [(1e6, 30.0), (4e6, 90.0)])
    w.add_p2p(False, [(1e6, 100.0), (8e6, 800.0)])
    return w.data


def _ref_config() -> dict:
    return json.loads(plan_to_ref(uniform_plan(load_model("gpt-1.3b"), 2, 1, 2, 4, 16)).to_json())


BASE: dict[str, object] = {}   # file name -> JSON-able content (built once, lazily)


def base_files() -> dict[str, object]:
    if not BASE:
        BASE.update({"spec.json": TINY, "plan.json": _tiny_plan(), "gpu-plan.json": _gpu_plan(),
                     "fp16-gpu-plan.json": _gpu_plan("fp16"),
                     "dropout-plan.json": _dropout_plan(), "hf.json": GPT2, "llama.json": LLAMA,
                     "db.json": _profile_db(), "ref.json": _ref_config(),
                     "corpus.jsonl": '{"text": "a small corpus"}\n' * 20,
                     "data/corpus.bin": "", "data/corpus.idx": "", "ckpt/latest_checkpointed_iteration.txt": "20\n",
                     "bad-ckpt/latest_checkpointed_iteration.txt": "twenty\n", "a-file": "not a folder\n"})
    return BASE


def edit(base: str, **changes) -> dict:
    """A copy of base file ``base`` with dotted paths replaced (``"stages.0.dp": True``; DELETE removes)."""
    data = copy.deepcopy(base_files()[base])
    for dotted, value in changes.items():
        keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
        node = data
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return data


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@dataclass
class Case:
    id: str
    argv: list[str]
    needle: str                                   # text the error must contain (the field, path or fix)
    files: dict[str, object] = field(default_factory=dict)
    mock_ram_mb: float | None = None              # available RAM seen by `aceso launch --cpu`


def C(id, argv, needle, **files):
    return Case(id, argv.split() if isinstance(argv, str) else argv, needle, dict(files))


_MLM = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --vocab-size 100 --tokenizer-type NullTokenizer "
SEARCH = "search --model spec.json --cluster 1x2-cpu --global-batch-size 8 --workers 1 --budget-evals 50"
LAUNCH = "launch plan.json --cpu --dry-run --"
TRAIN_OK = "--mock-data --train-iters 2"
CAL_SCRIPT = ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
              "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 8 --bf16 "
              "--vocab-size 50257\n")

CASES = [
    # ----- the dispatcher and argparse: one usage line, did-you-mean ---------------------------------------------
    C("unknown-subcommand", "serch", "did you mean search"),
    C("unknown-option", "models --bogus", "unrecognized arguments: --bogus"),
    C("search-missing-required", "search --model spec.json", "--cluster, --global-batch-size"),
    C("search-workers-negative", SEARCH + " --workers -2", "--workers: -2 must be at least 1"),
    C("search-workers-word", SEARCH + " --workers many", "--workers: 'many' is not an integer"),
    C("search-budget-s-zero", SEARCH + " --budget-s 0", "--budget-s: 0 must be above 0"),
    C("search-budget-s-nan", SEARCH + " --budget-s nan", "--budget-s: 'nan' is not a finite number"),
    C("search-budget-evals-zero", SEARCH + " --budget-evals 0", "--budget-evals: 0 must be at least 1"),
    C("search-top-k-zero", SEARCH + " --top-k 0", "--top-k: 0 must be at least 1"),
    C("search-gbs-zero", "search --model spec.json --cluster 1x2-cpu --global-batch-size 0",
      "--global-batch-size: 0 must be at least 1"),
    C("search-gbs-huge", "search --model spec.json --cluster 1x2-cpu --global-batch-size " + "1" + "0" * 30,
      "above the limit"),
    C("search-mbs-zero", SEARCH + " --micro-batch-sizes 0 2", "--micro-batch-sizes: 0 must be at least 1"),
    C("search-memory-negative", SEARCH + " --memory-limit-mb -5", "--memory-limit-mb: -5 must be above 0"),
    C("search-memory-inf", SEARCH + " --memory-limit-mb inf", "'inf' is not a finite number"),
    C("search-headroom-half", SEARCH + " --memory-headroom 0.5", "--memory-headroom: 0.5 must be a fraction in [0, 0.5)"),
    C("validate-headroom-nan", "validate plan.json --memory-headroom nan", "'nan' is not a finite number"),
    C("explain-headroom-negative", "explain plan.json --memory-headroom -0.1", "must be a fraction in [0, 0.5)"),
    C("search-precision-typo", SEARCH + " --precision bf17", "did you mean bf16"),
    C("search-cost-model-typo", SEARCH + " --cost-model analytical", "did you mean analytic"),
    C("search-attention-typo", SEARCH + " --attention flsh", "did you mean flash"),
    C("search-seed-negative", SEARCH + " --seed -1", "--seed: -1 is not a seed"),
    C("search-num-layers-zero", SEARCH + " --num-layers 0", "--num-layers: 0 must be at least 1"),
    C("search-num-layers-huge", SEARCH + " --num-layers 5000", "--num-layers (5000) must be in [1, 4096]"),
    C("search-trace-missing-value", SEARCH + " --trace", "--trace: expected one argument"),
    # candidate constraints (issue 20): each names its option and what to choose instead
    C("search-tp-not-power-of-two", SEARCH + " --tp 3", "--tp 3: not a usable tensor-parallel size"),
    C("search-tp-above-node", SEARCH + " --tp 1 4", "--tp 4: not a usable tensor-parallel size"),
    C("search-tp-zero", SEARCH + " --tp 0", "--tp: 0 must be at least 1"),
    C("search-max-tp-excludes-tp", SEARCH + " --tp 2 --max-tp 1", "--max-tp 1: no tensor-parallel degree is left"),
    C("search-max-tp-zero", SEARCH + " --max-tp 0", "--max-tp: 0 must be at least 1"),
    C("search-pp-above-gpus", SEARCH + " --pp 1 3", "--pp 3: more pipeline stages than the 2 GPUs"),
    C("search-pp-word", SEARCH + " --pp two", "--pp: 'two' is not an integer"),
    C("search-vpp-too-many", SEARCH + " --vpp 9", "--virtual-stages 9: tiny-gpt has 8 units"),
    C("search-vpp-zero", SEARCH + " --vpp 0", "--vpp: 0 must be at least 1"),
    C("search-cp-odd", SEARCH + " --cp 3", "2 cp must divide seq_length (64)"),
    C("search-seq-length-zero", SEARCH + " --seq-length 0", "--seq-length: 0 must be at least 1"),
    C("baseline-tp-not-usable", "baseline --model spec.json --cluster 1x2-cpu --global-batch-size 8 --tp 8",
      "--tp 8: not a usable tensor-parallel size"),
    C("explain-gbs-zero", "explain plan.json --global-batch-size 0", "--global-batch-size: 0 must be at least 1"),
    C("explain-memory-zero", "explain plan.json --memory-limit-mb 0", "--memory-limit-mb: 0 must be above 0"),
    C("explain-no-plan", "explain", "give a plan file, or --megatron-args / --megatron-args-file"),
    C("validate-world-size-zero", "validate plan.json --world-size 0", "--world-size: 0 must be at least 1"),
    C("baseline-mbs-negative", "baseline --model spec.json --cluster 1x2-cpu --global-batch-size 8 "
      "--micro-batch-sizes -1", "--micro-batch-sizes: -1 must be at least 1"),
    C("export-to-typo", "export plan.json --to aceso", "invalid choice: 'aceso'"),
    C("import-hf-seq-zero", "import-hf hf.json --seq-length 0", "--seq-length: 0 must be at least 1"),
    C("models-from-hf-no-value", "models --from-hf", "--from-hf: expected one argument"),
    C("clusters-extra", "clusters extra", "unrecognized arguments: extra"),
    C("launch-no-plan", "launch", "the following arguments are required: plan"),
    C("launch-port-range", "launch plan.json --master-port 70000 --", "--master-port: 70000 is not a TCP port"),
    C("launch-node-rank-negative", "launch plan.json --node-rank -1 --", "--node-rank: -1 must be at least 0"),
    C("launch-train-args-without-dashes", "launch plan.json --cpu --mock-data --train-iters 2",
      "go after a literal --"),
    C("data-no-action", "data", "required: ACTION"),
    C("data-action-typo", "data prepar corpus.jsonl -o x", "did you mean prepare"),
    C("data-missing-output", "data prepare corpus.jsonl", "-o/--output-prefix"),
    C("train-iters-zero", "train plan.json --train-iters 0 --mock-data", "--train-iters: 0 must be at least 1"),
    C("train-lr-nan", "train plan.json --train-iters 2 --mock-data --lr nan", "--lr: 'nan' is not a finite number"),
    C("train-beta-one", "train plan.json --train-iters 2 --mock-data --adam-beta2 1", "--adam-beta2: 1 must be below 1"),
    C("train-decay-style-typo", "train plan.json --train-iters 2 --mock-data --lr-decay-style cosin",
      "did you mean cosine"),
    C("profile-tp-word", "profile --model spec.json --tp two -o db2.json --cpu", "invalid int value: 'two'"),
    C("profile-seed-negative", "profile --model spec.json -o db2.json --cpu --seed -3", "--seed: -3 is not a seed"),
    C("profile-max-bytes-huge", "profile --model spec.json -o db2.json --cpu --max-bytes 99999999999999",
      "--max-bytes: '99999999999999' is not a size"),

    # ----- --model: presets, spec files, strict types, bounds -----------------------------------------------------
    C("model-preset-case", "search --model gpt-1.3B --cluster 1x8-h100 --global-batch-size 8",
      "did you mean gpt-1.3b"),
    C("model-preset-near", "search --model llama-7b --cluster 1x8-h100 --global-batch-size 8",
      "did you mean llama2-7b"),
    C("model-unknown", "search --model bert --cluster 1x8-h100 --global-batch-size 8", "not a preset or a spec"),
    C("model-missing-file", "search --model nope.json --cluster 1x8-h100 --global-batch-size 8", "no such spec file"),
    C("model-folder", "search --model data.json --cluster 1x8-h100 --global-batch-size 8", "is a folder",
      **{"data.json/x": ""}),
    C("model-hf-config", "search --model hf.json --cluster 1x8-h100 --global-batch-size 8",
      "aceso models --from-hf hf.json"),
    C("model-is-a-plan", "search --model plan.json --cluster 1x8-h100 --global-batch-size 8",
      "a plan, not a model spec"),
    C("spec-not-json", SEARCH.replace("spec.json", "s.json"), "s.json: not valid JSON", **{"s.json": "{oops"}),
    C("spec-binary", SEARCH.replace("spec.json", "s.json"), "not UTF-8", **{"s.json": b"\xff\xfe\x00"}),
    C("spec-empty", SEARCH.replace("spec.json", "s.json"), "s.json: not valid JSON", **{"s.json": ""}),
    C("spec-list", SEARCH.replace("spec.json", "s.json"), "must be a mapping", **{"s.json": [1, 2]}),
    C("spec-deep", SEARCH.replace("spec.json", "s.json"), "nested too deeply", **{"s.json": nested(100000)}),
    C("spec-unknown-field", SEARCH.replace("spec.json", "s.json"), "num_layer: unknown field",
      **{"s.json": {**TINY, "num_layer": 4}}),
    C("spec-missing-field", SEARCH.replace("spec.json", "s.json"), "hidden_size: field required",
      **{"s.json": edit("spec.json", hidden_size=DELETE)}),
    C("spec-layers-string", SEARCH.replace("spec.json", "s.json"), "num_layers: Input should be a valid integer",
      **{"s.json": edit("spec.json", num_layers="4")}),
    C("spec-layers-bool", SEARCH.replace("spec.json", "s.json"), "num_layers: Input should be a valid integer",
      **{"s.json": edit("spec.json", num_layers=True)}),
    C("spec-layers-float", SEARCH.replace("spec.json", "s.json"), "num_layers: Input should be a valid integer",
      **{"s.json": edit("spec.json", num_layers=4.5)}),
    C("spec-layers-zero", SEARCH.replace("spec.json", "s.json"), "num_layers: Input should be greater than 0",
      **{"s.json": edit("spec.json", num_layers=0)}),
    C("spec-hidden-huge", SEARCH.replace("spec.json", "s.json"), "hidden_size: Input should be less than or equal",
      **{"s.json": edit("spec.json", hidden_size=10**30)}),
    C("spec-seq-huge", SEARCH.replace("spec.json", "s.json"), "seq_length: Input should be less than or equal",
      **{"s.json": edit("spec.json", seq_length=2**40)}),
    C("spec-vocab-huge", SEARCH.replace("spec.json", "s.json"), "vocab_size: Input should be less than or equal",
      **{"s.json": edit("spec.json", vocab_size=10**12)}),
    C("spec-rotary-nan", SEARCH.replace("spec.json", "s.json"), "rotary_base: Input should be a finite number",
      **{"s.json": '{"name": "t", "family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,'
                   ' "ffn_hidden_size": 128, "seq_length": 64, "vocab_size": 512, "rotary_base": NaN}'}),
    C("spec-dropout-infinity", SEARCH.replace("spec.json", "s.json"), "attention_dropout: Input should be a finite",
      **{"s.json": json.dumps(TINY)[:-1] + ', "attention_dropout": Infinity}'}),
    C("spec-dropout-one", SEARCH.replace("spec.json", "s.json"), "attention_dropout: Input should be less than 1",
      **{"s.json": edit("spec.json", attention_dropout=1.0)}),
    C("spec-family", SEARCH.replace("spec.json", "s.json"), "family: Input should be 'gpt', 't5' or 'llama'",
      **{"s.json": edit("spec.json", family="bert")}),
    C("spec-activation", SEARCH.replace("spec.json", "s.json"), "activation: Input should be 'gelu', 'swiglu', 'quick_geglu' or 'squared_relu'",
      **{"s.json": edit("spec.json", activation="relu")}),
    C("spec-heads-divide", SEARCH.replace("spec.json", "s.json"), "must be a multiple of num_attention_heads",
      **{"s.json": edit("spec.json", num_attention_heads=3)}),
    C("spec-groups-divide", SEARCH.replace("spec.json", "s.json"), "multiple of num_query_groups",
      **{"s.json": edit("spec.json", num_query_groups=3)}),
    C("spec-t5-fields", SEARCH.replace("spec.json", "s.json"), "t5 models need num_decoder_layers",
      **{"s.json": edit("spec.json", family="t5")}),
    C("spec-gpt-decoder-field", SEARCH.replace("spec.json", "s.json"), "are for t5 only",
      **{"s.json": edit("spec.json", num_decoder_layers=2)}),
    C("spec-name-empty", SEARCH.replace("spec.json", "s.json"), "name: String should have at least 1 character",
      **{"s.json": edit("spec.json", name="")}),
    C("spec-name-long", SEARCH.replace("spec.json", "s.json"), "name: String should have at most 200",
      **{"s.json": edit("spec.json", name="x" * 500)}),
    C("spec-dtype", SEARCH.replace("spec.json", "s.json"), "params_dtype: Input should be 'bf16', 'fp16' or 'fp32'",
      **{"s.json": edit("spec.json", params_dtype="float32")}),
    C("spec-yaml-invalid", SEARCH.replace("spec.json", "s.yaml"), "s.yaml: not valid YAML",
      **{"s.yaml": "family: [gpt\n"}),
    C("spec-yaml-scalar", SEARCH.replace("spec.json", "s.yaml"), "must be a mapping", **{"s.yaml": "just text\n"}),
    C("spec-yaml-string-int", SEARCH.replace("spec.json", "s.yaml"), "num_layers: Input should be a valid integer",
      **{"s.yaml": "".join(f"{k}: {v!r}\n" if k == "num_layers" else f"{k}: {v}\n"
                           for k, v in {**TINY, "num_layers": "4"}.items())}),

    # ----- MoE / MLA / MTP (search.layers.moe_spec): spec errors name the field; the profile-db model refuses them ---------
    C("spec-moe-topk-above-experts", SEARCH.replace("spec.json", "s.json"), "moe_router_topk (9) must be at most",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_router_topk": 9}}}),
    C("spec-moe-unknown-field", SEARCH.replace("spec.json", "s.json"), "moe.num_expert: unknown field",
      **{"s.json": {**TINY, "moe": {"num_expert": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}}}),
    C("spec-moe-freq-list-length", SEARCH.replace("spec.json", "s.json"), "moe.moe_layer_freq lists 3 layers",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_layer_freq": [0, 1, 1]}}}),
    C("spec-moe-groups-alone", SEARCH.replace("spec.json", "s.json"), "set both or neither",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_router_num_groups": 4}}}),
    C("spec-moe-imbalance-forced", SEARCH.replace("spec.json", "s.json"), "moe_router_force_load_balancing false",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_imbalance_factor": 1.5, "moe_router_force_load_balancing": True}}}),
    C("spec-mla-missing-rank", SEARCH.replace("spec.json", "s.json"), "kv_lora_rank: field required",
      **{"s.json": {**TINY, "mla": {"qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}}}),
    C("search-moe-profile-dense-db", SEARCH.replace("spec.json", "s.json") + " --cost-model profile --db db.json "
      "--target megatron-lm",   # (the aceso runtime refuses an MoE model with linear biases before any pricing)
      "profiled for another model (moe None vs {'num_experts': 8", **{"s.json": {**TINY, "moe": MOE}}),
    C("search-mtp-profile-unpriced", SEARCH.replace("spec.json", "s.json") + " --cost-model profile --db d.json",
      "1 MTP layer(s): the profile cost model does not price them",
      **{"s.json": {**TINY, "mtp_num_layers": 1, "position_embedding": "rope"}}),
    # issue 32: the MoE search options (--ep / --max-ep / --etp / --dispatcher) against the model and cluster
    C("search-moe-ep-not-dividing", SEARCH.replace("spec.json", "s.json") + " --ep 3 --target megatron-lm",
      "--ep 3: must divide num_experts (8) of tiny-gpt; choose from 1 2", **{"s.json": {**TINY, "moe": MOE}}),
    C("search-moe-max-ep-leaves-none", SEARCH.replace("spec.json", "s.json") + " --ep 2 --max-ep 1 --target megatron-lm",
      "--max-ep 1: no expert-parallel degree of 2 is left", **{"s.json": {**TINY, "moe": MOE}}),
    C("search-moe-etp-not-a-tp", SEARCH.replace("spec.json", "s.json") + " --etp 3",
      "--etp 3: a stage's expert tp is 1 or its tp", **{"s.json": {**TINY, "add_bias_linear": False, "moe": MOE}}),
    C("search-moe-etp-with-biases", SEARCH.replace("spec.json", "s.json") + " --etp 2 --target megatron-lm",
      "--etp 2: megatron-core runs tiny-gpt's linear biases with expert tp 1 only", **{"s.json": {**TINY, "moe": MOE}}),
    C("search-moe-flex-on-cpu", SEARCH.replace("spec.json", "s.json") + " --dispatcher flex --target megatron-lm",
      "--dispatcher flex: DeepEP / HybridEP need CUDA GPUs", **{"s.json": {**TINY, "moe": MOE}}),
    C("baseline-dense-ep", "baseline --model spec.json --cluster 1x2-cpu --global-batch-size 8 --ep 2",
      "--ep: tiny-gpt is a dense model (no experts); drop --ep"),
    C("search-moe-ep-zero", SEARCH + " --ep 0", "--ep: 0 must be at least 1"),
    # issue 32: what megatron-core (or Megatron-LM's validate_args) refuses at model build (search/spec/model_rules.py)
    C("spec-moe-expert-bias-softmax", SEARCH.replace("spec.json", "s.json"),
      "moe.moe_router_enable_expert_bias (aux-loss-free routing) needs moe.moe_router_score_function sigmoid",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_router_enable_expert_bias": True}}}),
    C("spec-moe-pad-without-capacity", SEARCH.replace("spec.json", "s.json"),
      "moe.moe_pad_expert_input_to_capacity needs moe.moe_expert_capacity_factor",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_pad_expert_input_to_capacity": True}}}),
    C("spec-moe-groups-indivisible", SEARCH.replace("spec.json", "s.json"),
      "moe.num_experts must be a multiple of moe.moe_router_num_groups",
      **{"s.json": {**TINY, "moe": {**MOE, "moe_router_num_groups": 3, "moe_router_group_topk": 1}}}),
    C("spec-mla-query-groups", SEARCH.replace("spec.json", "s.json"),
      "mla and num_query_groups (grouped-query attention) are mutually exclusive",
      **{"s.json": {**TINY, "position_embedding": "rope", "num_query_groups": 2,
                    "mla": {"kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}}}),
    C("spec-mtp-learned-positions", SEARCH.replace("spec.json", "s.json"),
      "mtp_num_layers with learned absolute positions (position_embedding)",
      **{"s.json": {**TINY, "mtp_num_layers": 1}}),
    C("spec-mla-rotary-interleaved", SEARCH.replace("spec.json", "s.json"),
      "rotary_interleaved does not work with mla",
      **{"s.json": {**TINY, "position_embedding": "rope", "megatron": {"rotary_interleaved": True},
                    "mla": {"kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}}}),
    C("import-mlm-expert-bias-softmax", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                                         _MLM + "--num-experts 8 --moe-router-enable-expert-bias"],
      "--moe-router-enable-expert-bias (aux-loss-free routing) needs --moe-router-score-function sigmoid"),
    C("import-mlm-capacity-sinkhorn", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                                       _MLM + "--num-experts 8 --moe-expert-capacity-factor 1.5 "
                                       "--moe-router-load-balancing-type sinkhorn"],
      "not --moe-router-load-balancing-type sinkhorn"),
    C("import-mlm-mtp-learned", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                                 _MLM + "--mtp-num-layers 1"], "--mtp-num-layers with learned absolute positions"),
    C("import-hf-scoring-func", "import-hf ds.json", "scoring_func 'relu' is not one aceso's import knows (softmax, sigmoid)",
      **{"ds.json": {**LLAMA, "model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 64, "scoring_func": "relu", "kv_lora_rank": 16,
                     "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}}),
    C("explain-moe-plan-profile-dense-db", "explain moe-plan.json --cost-model profile --db db.json",
      "profiled for another model (moe None vs", **{"moe-plan.json": edit("plan.json", **{"model.moe": MOE})}),
    C("import-hf-moe-bad-experts", "import-hf mx.json", "num_local_experts is \"8\"",
      **{"mx.json": {**LLAMA, "model_type": "mixtral", "num_local_experts": "8", "num_experts_per_tok": 2}}),

    # ----- --cluster strings -----------------------------------------------------------------------------------
    C("cluster-gpu-typo", "search --model spec.json --cluster 1x8-h10 --global-batch-size 8",
      "did you mean 1x8-h100"),
    C("cluster-gpu-only", "search --model spec.json --cluster h100 --global-batch-size 8", "did you mean 1x8-h100"),
    C("cluster-no-dash", "search --model spec.json --cluster 2x8h100 --global-batch-size 8", "did you mean 2x8-h100"),
    C("cluster-unknown-gpu", "search --model spec.json --cluster 1x8-tpu --global-batch-size 8", "unknown gpu 'tpu'"),
    C("cluster-zero-nodes", "search --model spec.json --cluster 0x8-h100 --global-batch-size 8",
      "nodes and gpus per node must be at least 1"),
    C("cluster-zero-gpus", "search --model spec.json --cluster 1x0-h100 --global-batch-size 8",
      "nodes and gpus per node must be at least 1"),
    C("cluster-huge-nodes", "search --model spec.json --cluster 99999999999x8-h100 --global-batch-size 8",
      "num_nodes: Input should be less than or equal to 65536"),
    C("cluster-huge-node", "search --model spec.json --cluster 1x4096-h100 --global-batch-size 8",
      "gpus_per_node: Input should be less than or equal to 1024"),
    C("cluster-too-many-gpus", "search --model spec.json --cluster 65536x1024-h100 --global-batch-size 8",
      "above the limit of 1048576 GPUs"),
    C("cluster-empty", ["search", "--model", "spec.json", "--cluster", "", "--global-batch-size", "8"],
      "expected NODESxGPUS-gpu"),
    C("cluster-memory-over", "search --model spec.json --cluster 1x8-h100 --global-batch-size 8 "
      "--memory-limit-mb 1000000", "exceeds the h100's"),
    C("validate-cluster-typo", "validate plan.json --cluster 1x2-cpus", "unknown gpu 'cpus'"),

    # ----- training settings and the search itself ----------------------------------------------------------
    C("search-mbs-no-divisor", SEARCH.replace("--global-batch-size 8", "--global-batch-size 7") +
      " --micro-batch-sizes 2 4", "none of [2, 4] divides global_batch_size (7)"),
    C("search-too-many-candidates", SEARCH + " --micro-batch-sizes " + " ".join(["1"] * 70),
      "micro_batch_sizes: List should have at most 64 items"),
    C("search-does-not-fit", SEARCH + " --memory-limit-mb 1", "no plan fits in memory"),
    C("search-profile-without-db", SEARCH + " --cost-model profile", "--cost-model profile needs --db"),
    C("search-profile-db-missing", SEARCH + " --cost-model profile --db nope.json", "--db nope.json: no profile"),
    C("search-compat-db-missing", "search --model gpt-1.3b --cluster 1x8-v100 --global-batch-size 8 "
      "--cost-model aceso-compat --db nope", "nope"),
    C("search-compat-no-db-key", SEARCH + " --cost-model aceso-compat --db nope", "has no aceso_db_key"),
    C("baseline-does-not-fit", "baseline --model spec.json --cluster 1x2-cpu --global-batch-size 8 "
      "--memory-limit-mb 1", "no uniform configuration fits"),

    # ----- plan files: explain, validate, export, launch, train ---------------------------------------------
    C("plan-missing", "validate nope.json", "nope.json: no such plan file"),
    C("plan-folder", "validate data", "data: is a folder"),
    C("plan-empty", "validate p.json", "p.json: not valid JSON", **{"p.json": ""}),
    C("plan-not-json", "validate p.json", "p.json: not valid JSON", **{"p.json": "{stages: []}"}),
    C("plan-binary", "explain p.json", "p.json: not valid JSON (not UTF-8", **{"p.json": b"\x89PNG\r\n\x1a\n"}),
    C("plan-list", "validate p.json", "p.json", **{"p.json": [1, 2]}),
    C("plan-deep", "explain p.json", "nested too deeply", **{"p.json": nested(50000)}),
    C("plan-schema-version", "validate p.json", "schema_version 5 is not supported",
      **{"p.json": edit("plan.json", schema_version=5)}),
    C("plan-mbs-string", "validate p.json", "micro_batch_size: Input should be a valid integer (got '2')",
      **{"p.json": edit("plan.json", micro_batch_size="2")}),
    C("plan-dp-bool", "validate p.json", "stages[0].dp: Input should be a valid integer (got True)",
      **{"p.json": edit("plan.json", **{"stages.0.dp": True})}),
    C("plan-tp-float", "validate p.json", "stages[0].tp: Input should be a valid integer",
      **{"p.json": edit("plan.json", **{"stages.0.tp": 1.0})}),
    C("plan-mbs-huge", "explain p.json", "micro_batch_size: Input should be less than or equal to 16777216",
      **{"p.json": edit("plan.json", micro_batch_size=10**30)}),
    C("plan-gbs-huge", "explain p.json", "global_batch_size: Input should be less than or equal",
      **{"p.json": edit("plan.json", global_batch_size=10**30)}),
    C("plan-dp-huge", "validate p.json", "Input should be less than or equal to 1048576",
      **{"p.json": edit("plan.json", **{"stages.0.dp": 10**30, "stages.0.num_gpus": 10**30})}),
    C("plan-no-stages", "validate p.json", "stages: List should have at least 1 item",
      **{"p.json": edit("plan.json", stages=[])}),
    C("plan-stages-null", "validate p.json", "stages: Input should be a valid list",
      **{"p.json": edit("plan.json", stages=None)}),
    C("plan-num-gpus", "validate p.json", "must equal num_gpus (3)",
      **{"p.json": edit("plan.json", **{"stages.0.num_gpus": 3})}),
    C("plan-gap", "validate p.json", "stages[0].start_unit (1) leaves a gap",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.start_unit": 1,
                                         "stages.0.chunks.0.recompute": ["none"] * 7})}),
    C("plan-past-end", "validate p.json", "is past the model's 8 units",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.end_unit": 9,
                                         "stages.0.chunks.0.recompute": ["none"] * 9})}),
    C("plan-short-cover", "validate p.json", "must be 8: the model tiny-gpt has 8 units",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.end_unit": 6,
                                         "stages.0.chunks.0.recompute": ["none"] * 6})}),
    C("plan-recompute-length", "validate p.json", "recompute has 2 entries for 8 units",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute": ["none", "none"]})}),
    C("plan-recompute-typo", "validate p.json",
      "Input should be 'none', 'selective', 'full', 'attn_dropout' or 'mla_up_proj'",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "ful"})}),
    C("plan-mla-up-proj-without-mla", "validate p.json", "is 'mla_up_proj' but the model has no MLA (mla)",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "mla_up_proj"})}),
    C("plan-attn-dropout-on-mlp", "validate p.json", "unit 1 is an MLP unit",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.1": "attn_dropout"})}),
    C("plan-attn-dropout-no-dropout", "validate p.json", "has no attention dropout (attention_dropout 0)",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "attn_dropout"})}),
    C("plan-attn-dropout-explain", "explain p.json", "it frees nothing",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "attn_dropout"})}),
    C("plan-attn-dropout-flash-assumed", "validate p.json", "assumed flash attention (predicted.attention)",
      **{"p.json": edit("dropout-plan.json", predicted={
          "cost_model": "analytic", "iteration_time_ms": 1.0, "samples_per_s": 8000.0, "stage_time_ms": [1.0],
          "stage_memory_mb": [10.0], "attention": "flash"}, cluster=DELETE)}),
    C("plan-attn-dropout-flash-gpu", "explain dropout-plan.json --cluster 1x1-h100", "flash attention on h100"),
    C("plan-unknown-field", "validate p.json", "stages[0].pp: unknown field",
      **{"p.json": edit("plan.json", **{"stages.0.pp": 1})}),
    C("plan-missing-field", "validate p.json", "global_batch_size: field required",
      **{"p.json": edit("plan.json", global_batch_size=DELETE)}),
    C("plan-model-layers-string", "validate p.json", "model.num_layers: Input should be a valid integer",
      **{"p.json": edit("plan.json", **{"model.num_layers": "4"})}),
    C("plan-gpu-memory-nan", "validate p.json", "cluster.gpu.memory_gib: Input should be a finite number",
      **{"p.json": re.sub(r'"memory_gib": [0-9.e+-]+', '"memory_gib": NaN', json.dumps(base_files()["plan.json"]))}),
    C("plan-gpu-legacy-memory-nan", "validate p.json", "cluster.gpu.memory_gib: Input should be a finite number",
      **{"p.json": re.sub(r'"memory_gib": [0-9.e+-]+', '"memory_gb": NaN', json.dumps(base_files()["plan.json"]))}),
    C("plan-bandwidth-infinity", "validate p.json", "cluster.intra_node_gbps: Input should be a finite number",
      **{"p.json": json.dumps(base_files()["plan.json"]).replace('"intra_node_gbps": 5.0',
                                                                 '"intra_node_gbps": Infinity')}),
    C("plan-bandwidth-negative", "validate p.json", "cluster.inter_node_gbps: Input should be greater than 0",
      **{"p.json": edit("plan.json", **{"cluster.inter_node_gbps": -1.0})}),
    C("plan-nodes-string", "validate p.json", "cluster.num_nodes: Input should be a valid integer",
      **{"p.json": edit("plan.json", **{"cluster.num_nodes": "1"})}),
    C("plan-tflops-huge", "validate p.json", "cluster.gpu.peak_tflops_fp16: Input should be less than or equal",
      **{"p.json": edit("plan.json", **{"cluster.gpu.peak_tflops_fp16": 1e30})}),
    C("plan-predicted-negative", "validate p.json", "predicted.iteration_time_ms: Input should be greater than 0",
      **{"p.json": edit("plan.json", predicted={"cost_model": "analytic", "iteration_time_ms": -1.0,
                                                "samples_per_s": 1.0, "stage_time_ms": [1.0],
                                                "stage_memory_mb": [1.0]})}),
    C("plan-predicted-nan", "validate p.json", "predicted.samples_per_s: Input should be a finite number",
      **{"p.json": json.dumps(edit("plan.json", predicted={
          "cost_model": "analytic", "iteration_time_ms": 1.0, "samples_per_s": 0.5, "stage_time_ms": [1.0],
          "stage_memory_mb": [1.0]})).replace('"samples_per_s": 0.5', '"samples_per_s": NaN')}),
    C("plan-tp-heads", "validate p.json", "stages[0].tp (8) must divide num_attention_heads (4)",
      **{"p.json": edit("plan.json", **{"stages.0.tp": 8, "stages.0.dp": 1, "stages.0.num_gpus": 8},
                        cluster=DELETE)}),
    C("plan-sp-tp1", "validate p.json", "sequence_parallel needs tp > 1",
      **{"p.json": edit("plan.json", **{"stages.0.sequence_parallel": True})}),
    C("plan-dp-divides-mbs", "validate p.json", "stages[0].dp (2) must divide micro_batch_size (3)",
      **{"p.json": edit("plan.json", micro_batch_size=3, global_batch_size=9)}),
    C("plan-gbs-multiple", "validate p.json", "must be a multiple of micro_batch_size",
      **{"p.json": edit("plan.json", global_batch_size=9)}),
    C("plan-overlap-param", "validate p.json", "overlap_param_gather needs distributed_optimizer",
      **{"p.json": edit("plan.json", **{"settings.overlap_param_gather": True})}),
    C("plan-cluster-gpus", "validate p.json", "stages use 2 GPUs but the cluster 1x4-cpu has 4",
      **{"p.json": edit("plan.json", **{"cluster.gpus_per_node": 4})}),
    C("plan-v1-bad", "validate p.json", "stages[0].start_unit (2) leaves a gap", **{"p.json": {
        "schema_version": 1, "model": TINY, "micro_batch_size": 2, "global_batch_size": 8,
        "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 2, "end_unit": 8, "recompute": ["none"] * 6}]}}),
    C("validate-world-size", "validate plan.json --world-size 3", "needs 2 processes"),
    C("validate-other-cluster", "validate plan.json --cluster 1x4-cpu", "stages use 2 GPUs but the cluster 1x4-cpu"),
    C("validate-memory", "validate gpu-plan.json --memory-limit-mb 1000", "stages[0] needs"),
    C("validate-memory-attention", "validate fp16-gpu-plan.json --cluster 1x8-v100 --attention flash",
      "v100 has no flash attention"),
    C("explain-spec", "explain spec.json", "a model spec, not a plan"),
    C("explain-hf-config", "explain hf.json", "hf.json"),
    C("explain-model-units", "explain plan.json --model gpt-1.3b", "has 48 units but the plan covers 8"),
    C("explain-no-cluster", "explain p.json", "the plan names no cluster; give --cluster",
      **{"p.json": edit("plan.json", cluster=DELETE)}),
    C("explain-gbs-override", "explain plan.json --global-batch-size 7", "global_batch_size (7) must be a multiple"),
    C("explain-memory-over", "explain plan.json --memory-limit-mb 1e9", "exceeds the cpu's"),
    C("explain-db-corrupt", "explain plan.json --cost-model profile --db d.json", "corrupt profile database",
      **{"d.json": "{"}),
    C("export-bad-plan", "export p.json", "stages[0].dp: Input should be a valid integer",
      **{"p.json": edit("plan.json", **{"stages.0.dp": "2"})}),
    C("export-no-db-key", "export plan.json --to aceso-legacy", "has no aceso_db_key"),
    C("launch-bad-plan", LAUNCH + " " + TRAIN_OK, "micro_batch_size: Input should be a valid integer",
      **{"plan.json": edit("plan.json", micro_batch_size="2")}),
    C("train-bad-plan", "train p.json --train-iters 2 --mock-data", "p.json: no such plan file"),
    # ----- the one pre-flight (search/targets/preflight.py): what the runtime would refuse late is refused here -------------
    C("validate-vocab-per-tp", "validate v.json", "stages[0].tp (2): the padded vocabulary (511",
      **{"v.json": _preflight_plan(tp=2, dp=1, vocab_size=511, make_vocab_size_divisible_by=1)}),
    C("launch-vocab-per-tp", LAUNCH + " " + TRAIN_OK, "the padded vocabulary (511",
      **{"plan.json": _preflight_plan(tp=2, dp=1, vocab_size=511, make_vocab_size_divisible_by=1)}),
    C("validate-cp-on-cpu", "validate c.json", "stages[0].cp (2): megatron-core runs context parallelism only",
      **{"c.json": _preflight_plan(cp=2, dp=1)}),
    C("launch-cpu-cp", LAUNCH + " " + TRAIN_OK, "search the plan for a CPU cluster with cp 1",
      **{"plan.json": _preflight_plan(cp=2, dp=1)}),

    # ----- Hugging Face config.json (import-hf, models --from-hf) -------------------------------------------
    C("hf-missing", "import-hf nope/config.json", "nope/config.json: no such file"),
    C("hf-not-json", "import-hf c.json", "c.json: not valid JSON", **{"c.json": "model_type: gpt2"}),
    C("hf-not-object", "import-hf c.json", "a config.json must be a JSON object", **{"c.json": ["gpt2"]}),
    C("hf-model-type", "import-hf c.json", "model_type 'bert' is not supported",
      **{"c.json": {**GPT2, "model_type": "bert"}}),
    C("hf-model-type-number", "import-hf c.json", "model_type is 5; it must be a string",
      **{"c.json": {**GPT2, "model_type": 5}}),
    C("hf-layers-string", "import-hf c.json", 'n_layer is "12"; it must be a positive integer',
      **{"c.json": {**GPT2, "n_layer": "12"}}),
    C("hf-layers-zero", "import-hf c.json", "n_layer is 0; it must be a positive integer",
      **{"c.json": {**GPT2, "n_layer": 0}}),
    C("hf-layers-bool", "import-hf c.json", "n_layer is true", **{"c.json": {**GPT2, "n_layer": True}}),
    C("hf-hidden-fraction", "import-hf c.json", "n_embd is 768.5", **{"c.json": {**GPT2, "n_embd": 768.5}}),
    C("hf-hidden-huge", "import-hf c.json", "n_embd: Input should be less than or equal",
      **{"c.json": {**GPT2, "n_embd": 10**30}}),
    C("hf-vocab-missing", "import-hf c.json", "field vocab_size is missing",
      **{"c.json": {k: v for k, v in GPT2.items() if k != "vocab_size"}}),
    C("hf-dropout-nan", "import-hf c.json", "attn_pdrop is NaN; it must be a finite number",
      **{"c.json": json.dumps(GPT2)[:-1] + ', "attn_pdrop": NaN}'}),
    C("hf-dropout-string", "import-hf c.json", 'attn_pdrop is "0.1"', **{"c.json": {**GPT2, "attn_pdrop": "0.1"}}),
    C("hf-rope-string", "import-hf c.json", 'rope_theta is "fast"', **{"c.json": {**LLAMA, "rope_theta": "fast"}}),
    C("hf-tied-string", "import-hf c.json", 'tie_word_embeddings is "false"; it must be true or false',
      **{"c.json": {**LLAMA, "tie_word_embeddings": "false"}}),
    C("hf-heads-divide", "import-hf c.json", "must be a multiple of num_query_groups",
      **{"c.json": {**LLAMA, "num_key_value_heads": 5}}),
    C("hf-via-models", "models --from-hf c.json", 'n_head is "12"', **{"c.json": {**GPT2, "n_head": "12"}}),

    # ----- profile databases (--cost-model profile --db) ----------------------------------------------------
    *[C(f"db-{name}", "explain plan.json --cost-model profile --db d.json", needle, **{"d.json": content})
      for name, needle, content in [
          ("not-json", "corrupt profile database, not valid JSON", "{"),
          ("format", "not a profile database", {"format": "other"}),
          ("version", "version 7 is not supported", edit("db.json", version=7)),
          ("no-units", "field 'units' is missing", edit("db.json", units=DELETE)),
          ("units-not-list", "units: Input should be a valid list", edit("db.json", units={"a": 1})),
          ("entry-not-object", "units[0]: Input should be a valid dictionary", edit("db.json", **{"units.0": 5})),
          ("fwd-string", "units[0].fwd_us: Input should be a valid number (got 'fast')",
           edit("db.json", **{"units.0.fwd_us": "fast"})),
          ("fwd-negative", "units[0].fwd_us: Input should be greater than or equal to 0",
           edit("db.json", **{"units.0.fwd_us": -1.0})),
          ("bwd-huge", "units[1].bwd_us: Input should be less than or equal",
           edit("db.json", **{"units.1.bwd_us": 1e30})),
          ("fwd-missing", "units[0] lacks fwd_us", edit("db.json", **{"units.0.fwd_us": DELETE})),
          ("batch-zero", "units[0].batch: Input should be greater than 0", edit("db.json", **{"units.0.batch": 0})),
          ("tp-string", "units[0].tp: Input should be a valid integer", edit("db.json", **{"units.0.tp": "1"})),
          ("seq-float", "embedding[0].seq: Input should be a valid integer",
           edit("db.json", **{"embedding.0.seq": 64.5})),
          ("kind", "units[0].kind: Input should be 'attention', 'cross_attention', 'mlp' or 'moe'",
           edit("db.json", **{"units.0.kind": "ffn"})),
          ("act-negative", "units[0].act_bytes: every entry must be bytes",
           edit("db.json", **{"units.0.act_bytes.1": -5.0})),
          ("act-empty", "head[0].act_bytes: List should have at least 1 item",
           edit("db.json", **{"head.0.act_bytes": []})),
          ("recompute-string", "units[0].recompute_us[1]: Input should be a valid number",
           edit("db.json", **{"units.0.recompute_us.1": "x"})),
          ("weight-bool", "units[0].weight_bytes: Input should be a valid number",
           edit("db.json", **{"units.0.weight_bytes": True})),
          ("dtype", "dtype: Input should be 'bf16', 'fp16' or 'fp32'", edit("db.json", dtype="float")),
          ("gpu-name", "hardware.gpu: Input should be a valid string", edit("db.json", **{"hardware.gpu": 100})),
          ("collective-kind", "collectives[0].kind: Input should be 'all_reduce'",
           edit("db.json", **{"collectives.0.kind": "broadcast"})),
          ("collective-group", "collectives[0].group: Input should be greater than or equal to 2",
           edit("db.json", **{"collectives.0.group": 1})),
          ("collective-points", "collectives[0].points: points must be pairs",
           edit("db.json", **{"collectives.0.points.0": [-1, 5]})),
          ("p2p-points-string", "p2p[0].points[0][1]: Input should be a valid number",
           edit("db.json", **{"p2p.0.points.0.1": "slow"})),
          ("optimizer-nan", "optimizer.us_per_param: Input should be a finite number",
           json.dumps(edit("db.json", optimizer={"us_per_param": 0.5})).replace("0.5}", "NaN}")),
      ]],
    C("db-folder-without-db", "explain plan.json --cost-model profile --db data", "no profile database at"),
    C("db-wrong-gpu", "explain gpu-plan.json --cost-model profile --db db.json",
      "profiled on gpu 'cpu' but the cluster has 'h100'"),

    # ----- reference (Aceso legacy) configs: import, explain ------------------------------------------------
    C("ref-missing", "import nope.json", "no such reference config file"),
    C("ref-not-object", "import r.json", "a reference config is a JSON object", **{"r.json": [1]}),
    C("ref-field-missing", "import r.json", "recompute_ops is missing",
      **{"r.json": edit("ref.json", recompute_ops=DELETE)}),
    C("ref-ops-int", "import r.json", "num_ops_in_each_stage must be a non-empty list of positive integers",
      **{"r.json": edit("ref.json", num_ops_in_each_stage=315)}),
    C("ref-gpus-string", "import r.json", "num_gpus must be a non-empty list of positive integers",
      **{"r.json": edit("ref.json", num_gpus=["2", "2"])}),
    C("ref-mbs-string", "import r.json", "micro_batch_size must be a positive integer",
      **{"r.json": edit("ref.json", micro_batch_size="4")}),
    C("ref-unknown-model", "import r.json", "no preset has this aceso_db_key",
      **{"r.json": edit("ref.json", model_size="9B")}),
    C("ref-op-tp", "import r.json", "tp (4) * dp (2) must equal num_gpus[0] (2)",
      **{"r.json": edit("ref.json", **{"model_parallel_size_of_each_op.0.0": 4})}),
    C("ref-via-explain", "explain r.json --cost-model aceso-compat --db nope", "recompute_ops is missing",
      **{"r.json": edit("ref.json", recompute_ops=DELETE)}),
    C("import-cluster-typo", "import ref.json --cluster 1x4-h1000", "unknown gpu 'h1000'"),
    C("import-script-without-from", "import run.sh", "run.sh: not valid JSON (Expecting value: line 1 column 1 "
      "(char 0)); a Megatron-LM launch script or argument file: add --from megatron-lm",
      **{"run.sh": "#!/bin/bash\ntorchrun pretrain_gpt.py --num-layers 2\n"}),

    # ----- outputs: checked before the work, named as given ---------------------------------------------------
    C("out-folder", SEARCH + " -o data", "-o data: is a folder"),
    C("out-empty", SEARCH.split() + ["-o", ""], "-o '': empty path"),
    C("out-blank", SEARCH.split() + ["-o", "  "], "-o '  ': empty path"),
    C("out-missing-folder", SEARCH + " -o nope/plan.json", "-o nope/plan.json: folder nope does not exist"),
    C("out-under-file", SEARCH + " -o a-file/plan.json", "-o a-file/plan.json: folder a-file does not exist"),
    C("trace-folder", SEARCH + " -o plan2.json --trace data", "--trace data: is a folder"),
    C("trace-missing-folder", SEARCH + " -o plan2.json --trace nope/t.json", "--trace nope/t.json: folder nope"),
    C("baseline-out-folder", "baseline --model spec.json --cluster 1x2-cpu --global-batch-size 8 -o data",
      "-o data: is a folder"),
    C("export-out-folder", "export gpu-plan.json -o data", "-o data: is a folder"),
    C("import-out-folder", "import ref.json -o data", "-o data: is a folder"),
    C("import-hf-out-folder", "import-hf hf.json -o data", "-o data: is a folder"),
    C("import-hf-out-missing", "import-hf hf.json -o nope/spec.json", "folder nope does not exist"),
    C("models-from-hf-out-folder", "models --from-hf hf.json -o data", "-o data: is a folder"),
    C("slurm-folder", "launch plan.json --slurm data -- " + TRAIN_OK, "--slurm data: is a folder"),
    C("slurm-missing-folder", "launch plan.json --slurm nope/job.sbatch -- " + TRAIN_OK, "--slurm nope/job.sbatch"),
    C("profile-out-missing-folder", "profile --model spec.json -o nope/db.json --cpu", "folder nope does not exist"),
    C("train-log-file-folder", LAUNCH + " " + TRAIN_OK + " --log-file data", "--log-file data: is a folder"),

    # ----- Megatron-LM: export --to megatron-lm|megatron-bridge, import --from megatron-lm, explain --megatron-args
    C("export-mlm-inexpressible", "export p.json --to megatron-lm -o run.sh", "stages[0].recompute[0:2] (full, none) "
      "mixes choices inside layer 0", **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "full"})}),
    C("export-bridge-inexpressible", "export p.json --to megatron-bridge -o b.yaml", "search with --target megatron-lm",
      **{"p.json": edit("plan.json", **{"stages.0.chunks.0.recompute.0": "full"})}),
    C("export-legacy-args-only", "export plan.json --to aceso-legacy --args-only", "--args-only is for --to "
      "megatron-lm / megatron-bridge"),
    C("export-mlm-out-folder", "export plan.json --to megatron-lm -o data", "-o data: is a folder"),
    C("import-mlm-missing", "import nope.sh --from megatron-lm", "nope.sh: no such file"),
    C("import-mlm-no-world", ["import", "--from", "megatron-lm", "--args", "--num-layers 4"],
      "the world size is not in the command line"),
    C("import-mlm-tp-zero", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                             "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --tensor-model-parallel-size 0"],
      "--tensor/pipeline-model-parallel-size and --context-parallel-size must be at least 1"),
    C("import-mlm-not-int", ["import", "--from", "megatron-lm", "--world-size", "8", "--args", "--num-layers x"],
      "--num-layers 'x': expected an integer"),
    C("import-mlm-world", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                           "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --tensor-model-parallel-size 3"],
      "the world size (8) is not a multiple of tp x pp x cp (3 x 1 x 1)"),
    C("import-mlm-moe", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                         _MLM + "--num-experts 6 --expert-model-parallel-size 4"],
      "stages[0].ep (4) must divide num_experts (6)"),
    C("import-mlm-moe-freq", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                              _MLM + "--num-experts 8 --moe-layer-freq [1]*3"],
      "--moe-layer-freq '[1]*3': the pattern has 3 entries but --num-layers is 4"),
    # issue 32: what a V100 has (fp16 tensor cores, no bf16, FP8 or flash attention), with fixes the command takes
    C("import-mlm-v100-flash", ["import", "--from", "megatron-lm", "--world-size", "8", "--cluster", "1x8-v100",
                                "--args", _MLM + "--fp16"], "add --transformer-impl local"),
    C("import-mlm-v100-bf16", ["import", "--from", "megatron-lm", "--world-size", "8", "--cluster", "1x8-v100",
                               "--args", _MLM + "--bf16 --transformer-impl local"],
      "the v100 has no bf16 tensor cores (bf16 needs an A100 or newer); train in fp16"),
    C("search-v100-bf16", "search --model gpt-1.3b --num-layers 2 --cluster 1x8-v100 --global-batch-size 8 "
      "--precision bf16", "precision bf16: the v100 has no bf16 tensor cores"),
    C("search-v100-fp8", "search --model gpt-1.3b --num-layers 2 --cluster 1x8-v100 --global-batch-size 8 "
      "--precision fp8-tensorwise --target megatron-lm", "the v100 has no FP8 tensor cores (H100/H200 have FP8, "
      "B200/B300/GB200/GB300 FP8 and FP4); train in fp16"),
    C("baseline-v100-bf16", "baseline --model gpt-1.3b --num-layers 2 --cluster 1x8-v100 --global-batch-size 8 "
      "--precision bf16", "train in fp16"),
    C("import-mlm-out-folder", ["import", "--from", "megatron-lm", "--world-size", "8", "--args", "--num-layers 4",
                                "-o", "data"], "-o data: is a folder"),
    # launch scripts read as bash reads them (issue 21) and Megatron-LM's strict parser (issue 25)
    *[C(f"import-mlm-typo-{k}", ["import", "--from", "megatron-lm", "--world-size", "8", "--args", _MLM + typo],
        f"{typo.split()[0]}: not a flag of Megatron-LM core_v0.19.0 (its parser exits on it: unrecognized "
        f"arguments){hint}") for k, (typo, hint) in enumerate((
            ("--sequence-paralel", "; did you mean --sequence-parallel?"),
            ("--recompute-activatons", "; did you mean --recompute-activations?"), ("--foo-bar 3", "")))],
    C("explain-mlm-typo", ["explain", "--cluster", "1x8-h100", "--megatron-args", _MLM + "--sequence-paralel"],
      "--sequence-paralel: not a flag of Megatron-LM core_v0.19.0"),
    C("import-mlm-no-pos-emb", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                                _MLM + "--no-position-embedding", "--megatron-version", "0.16"], "--no-position-embedding "
      "with --position-embedding-type learned_absolute: Megatron-LM core_v0.16.1 raises"),
    # a script read under the release it was written for (issue 33): a flag of another release names those
    C("import-mlm-removed-flag", ["import", "--from", "megatron-lm", "--world-size", "8", "--args",
                                  _MLM + "--use-legacy-models"], "--use-legacy-models: not a flag of Megatron-LM "
      "core_v0.19.0 (its parser exits on it: unrecognized arguments); did you mean --use-mcore-models? "
      "(--use-legacy-models is a flag of core_v0.16.1, core_v0.17.1: give --megatron-version 0.17"),
    C("import-mlm-newer-flag", ["import", "--from", "megatron-lm", "--world-size", "8", "--megatron-version",
                                "0.16", "--args", _MLM + "--megatron-fsdp-main-params-dtype fp32"],
      "--megatron-fsdp-main-params-dtype: not a flag of Megatron-LM core_v0.16.1 (its parser exits on it: "
      "unrecognized arguments) (--megatron-fsdp-main-params-dtype is a flag of core_v0.17.1, core_v0.18.2, "
      "core_v0.19.0: give --megatron-version 0.19 for a script written for it)"),
    C("import-mlm-bad-version", ["import", "--from", "megatron-lm", "--world-size", "8", "--megatron-version",
                                 "0.15", "--args", _MLM], "--megatron-version 0.15: aceso knows Megatron-LM 0.16 "
      "(core_v0.16.1), 0.17 (core_v0.17.1), 0.18 (core_v0.18.2), 0.19 (core_v0.19.0); give one of them"),
    C("export-version-bridge", "export plan.json --to megatron-bridge --megatron-version 0.16",
      "--megatron-version is for --to megatron-lm"),
    C("import-mlm-bert", "import bert.sh --from megatron-lm", "bert.sh: runs pretrain_bert.py: BERT pretraining",
      **{"bert.sh": "torchrun --nproc_per_node 8 pretrain_bert.py " + _MLM + "\n"}),
    C("import-mlm-inference", "import gen.sh --from megatron-lm", "runs tools/run_text_generation_server.py: "
      "inference / text generation, not training", **{"gen.sh": "torchrun --nproc_per_node 8 "
                                                                  "tools/run_text_generation_server.py --tp 8\n"}),
    C("import-mlm-loop", "import loop.sh --from megatron-lm", "loop.sh: line 1: a 'for' loop that sets variables or runs the command",
      **{"loop.sh": "for tp in 1 2; do\n torchrun --nproc_per_node 8 pretrain_gpt.py " + _MLM + "; done\n"}),
    C("import-mlm-cmd-subst", "import cs.sh --from megatron-lm", "--num-layers is the command substitution "
      "$(cat layers.txt), which aceso cannot expand", **{"cs.sh": "L=$(cat layers.txt)\ntorchrun --nproc_per_node 8 "
                                                        "pretrain_gpt.py " + _MLM.replace("--num-layers 4", "--num-layers $L") + "\n"}),
    C("import-mlm-unclosed-quote", "import q.sh --from megatron-lm", 'q.sh: line 1: a double quote (") is never closed',
      **{"q.sh": 'ARGS="--num-layers 4\ntorchrun pretrain_gpt.py $ARGS\n'}),
    C("import-mlm-source", "import s.sh --from megatron-lm", "s.sh: line 1: 'source conf.sh' reads another file",
      **{"s.sh": "source conf.sh\ntorchrun --nproc_per_node 8 pretrain_gpt.py $ARGS\n"}),
    C("import-mlm-vars-only", "import v.sh --from megatron-lm", "v.sh: no command: the file only sets variables (A, B)",
      **{"v.sh": "A=1\nB=(--num-layers 4)\n"}),
    C("import-mlm-unset-args", "import u.sh --from megatron-lm", "the arguments include $GPT_ARGS, which the file "
      "does not set", **{"u.sh": "torchrun --nproc_per_node 8 pretrain_gpt.py $GPT_ARGS\n"}),
    C("import-mlm-fp8-append", "import f.sh --from megatron-lm", "--fp8-format with fp32: aceso prices low precision",
      **{"f.sh": "A=(" + _MLM + ")\nA+=(\n  \"--fp8-format hybrid\"\n)\ntorchrun --nproc_per_node 8 pretrain_gpt.py "
                 "${A[@]}\n"}),
    C("explain-mlm-no-cluster", ["explain", "--megatron-args", "--num-layers 4"], "--megatron-args needs --cluster"),
    C("explain-mlm-and-plan", ["explain", "plan.json", "--megatron-args", "--num-layers 4", "--cluster", "1x2-cpu"],
      "give PLAN or --megatron-args/--megatron-args-file, not both"),
    C("explain-mlm-file-missing", "explain --megatron-args-file nope.sh --cluster 1x8-h100", "nope.sh: no such file"),
    C("search-target-typo", SEARCH + " --target megatron", "did you mean megatron-lm"),

    # ----- pictures: --plot and aceso plot (the checks that need no matplotlib come first) ---------------------
    C("explain-plot-gif", "explain plan.json --plot out.gif", "--plot out.gif: unknown image format .gif"),
    C("explain-plot-folder", "explain plan.json --plot data", "--plot data: is a folder"),
    C("explain-plot-stdout", "explain plan.json --plot -", "a picture cannot go to stdout"),
    C("explain-plot-format", "explain plan.json --plot out.png --plot-format jpg", "invalid choice: 'jpg'"),
    C("search-plot-missing-folder", SEARCH + " -o plan2.json --plot nope/s.png", "--plot nope/s.png: folder nope"),
    C("plot-no-log", "plot nope.jsonl", "nope.jsonl: no such log file"),
    C("plot-not-json", "plot corpus.bad", "corpus.bad:2: not a JSON line", **{
        "corpus.bad": '{"kind": "train", "iteration": 1, "loss": 2.0}\nnot json\n'}),
    C("plot-no-records", "plot m.jsonl -o m.png", "no train, eval or summary records",
      **{"m.jsonl": '{"kind": "message", "text": "hi"}\n'}),
    C("plot-bad-record", "plot b.jsonl -o b.png", "b.jsonl:1: a train record needs an integer iteration",
      **{"b.jsonl": '{"kind": "train", "iteration": "one", "loss": 2.0}\n'}),
    C("plot-out-gif", "plot corpus.jsonl -o out.gif", "-o out.gif: unknown image format .gif"),
    C("plot-out-folder", "plot corpus.jsonl -o data", "-o data: is a folder"),
    C("train-plot-no-log-file", "train plan.json --train-iters 2 --cpu --mock-data --plot t.png", "add --log-file"),
    C("launch-plot-gif", "launch plan.json --cpu --dry-run --plot t.gif -- " + TRAIN_OK + " --log-file t.jsonl",
      "--plot t.gif: unknown image format"),
    C("launch-plot-no-log-file", "launch plan.json --cpu --dry-run --plot t.png -- " + TRAIN_OK, "add --log-file"),

    # ----- aceso launch: the train arguments and the machine, before anything starts ---------------------------
    C("launch-no-train-iters", LAUNCH + " --mock-data", "required: --train-iters"),
    C("launch-no-data", LAUNCH + " --train-iters 2", "no training data: give --data-path"),
    C("launch-mock-and-data", LAUNCH + " " + TRAIN_OK + " --data-path data/corpus", "give one of them"),
    C("launch-data-bin", LAUNCH + " --train-iters 2 --data-path data/corpus.bin",
      "give the prefix without .bin: --data-path data/corpus"),
    C("launch-data-missing", LAUNCH + " --train-iters 2 --data-path data/other", "no data/other.bin"),
    C("launch-data-weights", LAUNCH + " --train-iters 2 --data-path 0.5 data/corpus 0.5",
      "a weighted blend alternates WEIGHT PREFIX"),
    C("launch-data-weight-negative", LAUNCH + " --train-iters 2 --data-path 0.5 data/corpus -1 data/corpus",
      "weight '-1' is not a non-negative number"),
    C("launch-split-words", LAUNCH + " --train-iters 2 --data-path data/corpus --split a,b,c", "--split a,b,c"),
    C("launch-split-four", LAUNCH + " --train-iters 2 --data-path data/corpus --split 1,1,1,1", "--split 1,1,1,1"),
    C("launch-split-zero", LAUNCH + " --train-iters 2 --data-path data/corpus --split 0,0,0", "--split 0,0,0"),
    C("launch-tokenizer", LAUNCH + " --train-iters 2 --data-path data/corpus --tokenizer sentencepiece",
      "--tokenizer sentencepiece: unknown tokenizer"),
    C("launch-tokenizer-hf-missing", LAUNCH + " --train-iters 2 --data-path data/corpus --tokenizer hf:nope",
      "--tokenizer hf:nope: nope does not exist"),
    C("launch-byte-vocab", "launch p.json --cpu --dry-run -- --train-iters 2 --data-path data/corpus",
      "vocab_size 300 but tokenizer byte has 363 ids",
      **{"p.json": edit("plan.json", **{"model.vocab_size": 300})}),
    C("launch-resume-done", LAUNCH + " " + TRAIN_OK + " --load ckpt",
      "the checkpoint is at iteration 20, and --train-iters is 2: nothing left to train; raise --train-iters"),
    C("launch-resume-marker", LAUNCH + " " + TRAIN_OK + " --load bad-ckpt", "holds 'twenty', not an iteration"),
    C("launch-load-file", LAUNCH + " " + TRAIN_OK + " --load a-file", "--load a-file: not a folder"),
    C("launch-save-file", LAUNCH + " " + TRAIN_OK + " --save a-file", "--save a-file: not a folder"),
    C("launch-save-interval-alone", LAUNCH + " " + TRAIN_OK + " --save-interval 5", "--save-interval needs --save"),
    C("launch-config-unknown-key", LAUNCH + " --mock-data --config bad.yaml",
      "bad.yaml: unknown key 'trian-iters'; did you mean 'train-iters'?", **{"bad.yaml": "trian-iters: 3\n"}),
    C("launch-config-missing", LAUNCH + " --mock-data --config nope.yaml", "nope.yaml: no such file"),
    C("launch-keep-last-alone", LAUNCH + " " + TRAIN_OK + " --keep-last 2", "--keep-last needs --save"),
    C("launch-keep-last-zero", LAUNCH + " " + TRAIN_OK + " --save ckpt2 --keep-last 0", "--keep-last"),
    C("launch-scheduler-both", LAUNCH + " " + TRAIN_OK + " --override-opt_param-scheduler "
      "--use-checkpoint-opt_param-scheduler", "give one of them"),
    C("launch-wandb-no-name", LAUNCH + " " + TRAIN_OK + " --wandb-project p", "--wandb-project needs --wandb-exp-name"),
    C("launch-wandb-name-alone", LAUNCH + " " + TRAIN_OK + " --wandb-exp-name r", "--wandb-exp-name needs"),
    C("launch-tensorboard-file", LAUNCH + " " + TRAIN_OK + " --tensorboard-dir a-file", "--tensorboard-dir a-file: "
      "not a folder"),
    # an output folder under a regular file (was NotADirectoryError in the workers; issue 32)
    C("launch-tensorboard-under-file", LAUNCH + " " + TRAIN_OK + " --tensorboard-dir a-file/tb",
      "--tensorboard-dir a-file/tb: a-file is a file, not a folder"),
    C("launch-save-under-file", LAUNCH + " " + TRAIN_OK + " --save a-file/ckpt", "--save a-file/ckpt: a-file is a file"),
    C("launch-data-cache-under-file", LAUNCH + " " + TRAIN_OK + " --data-cache-path a-file/x/y",
      "--data-cache-path a-file/x/y: a-file is a file"),
    C("launch-wandb-dir-under-file", LAUNCH + " " + TRAIN_OK + " --wandb-project p --wandb-exp-name r "
      "--wandb-save-dir a-file/w", "--wandb-save-dir a-file/w: a-file is a file"),
    C("launch-warmup", LAUNCH + " " + TRAIN_OK + " --lr-warmup-iters 2", "--lr-warmup-iters (2) must be below"),
    C("launch-min-lr", LAUNCH + " " + TRAIN_OK + " --min-lr 1 --lr 0.1", "--min-lr (1.0) must not exceed --lr"),
    C("launch-train-option-typo", LAUNCH + " " + TRAIN_OK + " --train-itres 5", "unrecognized arguments: --train-itres"),
    C("launch-world-size", "launch plan.json --cpu --nproc-per-node 3 --dry-run -- " + TRAIN_OK,
      "the plan needs 2 GPUs"),
    C("launch-nodes", "launch gpu-plan.json --nnodes 4 --dry-run -- " + TRAIN_OK,
      "the plan was made for 1x8-h100 (8 GPUs per node)"),
    C("launch-node-rank", "launch gpu-plan.json --node-rank 1 --dry-run -- " + TRAIN_OK,
      "--node-rank (1) must be in [0, 1)"),
    C("launch-cpu-too-big", "launch gpu-plan.json --cpu -- " + TRAIN_OK,
      "the plan was made for 1x8-h100; its 8 CPU processes need about"),
    C("launch-cpu-tiny-ram", "launch plan.json --cpu -- " + TRAIN_OK, "but this machine has 0.1 GiB available"),
    C("launch-slurm-data-missing", "launch gpu-plan.json --slurm job.sbatch -- --train-iters 2 --data-path x",
      "--data-path x: no x.bin"),

    # ----- aceso train (one process), data prepare, profile: before torch -----------------------------------
    C("train-world-size", "train plan.json --train-iters 2 --mock-data --cpu", "needs 2 processes"),
    C("train-no-data", "train plan.json --train-iters 2 --cpu", "no training data"),
    C("train-data-bin", "train plan.json --train-iters 2 --cpu --data-path data/corpus.bin", "without .bin"),
    C("train-resume-done", "train plan.json --train-iters 5 --cpu --mock-data --load ckpt", "raise --train-iters"),
    C("data-input-missing", "data prepare nope.jsonl -o out/corpus", "nope.jsonl: no such input file"),
    C("data-input-folder", "data prepare data -o out/corpus", "data: is a folder"),
    C("data-tokenizer", "data prepare corpus.jsonl -o out/corpus --tokenizer sp:x", "--tokenizer sp:x: unknown"),
    C("data-tokenizer-hf-missing", "data prepare corpus.jsonl -o out/corpus --tokenizer hf:nope",
      "--tokenizer hf:nope: nope does not exist"),
    C("data-out-folder", "data prepare corpus.jsonl -o data", "-o 'data': give a prefix"),
    C("data-out-slash", "data prepare corpus.jsonl -o out/", "-o 'out/': give a prefix"),
    C("data-out-bin", "data prepare corpus.jsonl -o out/corpus.bin", "give the prefix without .bin"),
    C("data-out-under-file", "data prepare corpus.jsonl -o a-file/corpus", "a-file is not a folder"),
    C("data-json-key-empty", ["data", "prepare", "corpus.jsonl", "-o", "out/corpus", "--json-key", ""],
      "--json-key ''"),
    C("profile-tp-heads", "profile --model spec.json --tp 3 -o db2.json --cpu", "--tp 3: num_attention_heads (4)"),
    C("profile-mbs-zero", "profile --model spec.json --micro-batch-sizes 0 -o db2.json --cpu",
      "--micro-batch-sizes 0"),
    C("profile-nproc", "profile --model spec.json --tp 1 2 --nproc 3 -o db2.json --cpu",
      "--tp 2 does not divide the 3 processes"),
    C("profile-bytes", "profile --model spec.json -o db2.json --cpu --min-bytes 4096 --max-bytes 1024",
      "--min-bytes (4096)"),
    C("profile-node-rank", "profile --model spec.json -o db2.json --cpu --nnodes 1 --node-rank 2",
      "--node-rank (2) must be in [0, --nnodes (1))"),
    C("profile-model", "profile --model gpt-1.3B -o db2.json --cpu", "did you mean gpt-1.3b"),
    C("profile-ep-dense", "profile --model spec.json --ep 2 -o db2.json --cpu", "--ep: the model tiny-gpt has no "
      "experts; drop --ep"),
    C("profile-ep-experts", "profile --model s.json --ep 3 -o db2.json --cpu", "--ep 3: must be a positive divisor "
      "of num_experts (8)", **{"s.json": {**TINY, "moe": MOE, "add_bias_linear": False}}),
    C("profile-moe-tp", "profile --model s.json --tp 2 --ep 2 -o db2.json --cpu", "--tp 2: an MoE model at tp > 1 "
      "runs with sequence parallelism", **{"s.json": {**TINY, "moe": MOE, "add_bias_linear": False}}),

    # ----- aceso calibrate and --calibration (docs/calibrate.md; the log checks: test_calibrate.py) -----------
    C("calibrate-log-missing", "calibrate --run run.sh nope.log --cluster 1x8-h100 -o c.json",
      "nope.log: no such log file", **{"run.sh": CAL_SCRIPT}),
    C("calibrate-log-empty", "calibrate --run run.sh run.log --cluster 1x8-h100 -o c.json", "the log is empty",
      **{"run.sh": CAL_SCRIPT, "run.log": ""}),
    C("calibrate-no-cluster", "calibrate --run run.sh run.log -o c.json", "needs --cluster",
      **{"run.sh": CAL_SCRIPT, "run.log": "x\n"}),
    C("calibrate-jsonl-cut", "calibrate --run plan.json t.jsonl -o c.json", "line 1: cut off mid-line",
      **{"t.jsonl": '{"kind": "train", "iteration_ti'}),
    C("calibration-missing", "explain plan.json --calibration nope.json", "--calibration nope.json: no such"),
    C("calibration-not-one", "validate plan.json --calibration plan.json", "not a calibration file"),
    C("calibration-other-gpu", "explain plan.json --calibration c.json", "no calibration for cpu",
      **{"c.json": {"kind": "aceso-calibration", "gpus": {"h100": {"gemm_efficiency": 0.5,
                                                                    "attention_efficiency": 0.4,
                                                                    "memory_reserve_mib": 1024.0}}}}),
]


def _write(root: Path, files: dict[str, object]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            path.write_text(json.dumps(content))


def _snapshot(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_the_corpus_is_big_and_covers_every_subcommand():
    from search.cli import PLANNER_SUBCOMMANDS, RUNTIME_SUBCOMMANDS

    assert len(CASES) >= 150 and len({c.id for c in CASES}) == len(CASES)
    covered = {c.argv[0] for c in CASES if c.argv}
    assert covered >= set(PLANNER_SUBCOMMANDS) | set(RUNTIME_SUBCOMMANDS)


def run_case(case: Case, root: Path) -> tuple[int, str, str, bool]:
    """Run ``case`` in the empty folder ``root``: (exit status, stdout, stderr, whether files stayed unchanged).
    ``aceso launch --cpu`` sees 16 GB of RAM (100 MB for the tiny-RAM case), and no GPUs."""
    import contextlib
    import io
    import os

    import launch.commands as lc

    _write(root, base_files())
    _write(root, case.files)
    before = _snapshot(root)
    cwd, ram, gpus = os.getcwd(), lc.available_ram_mb, os.environ.get("CUDA_VISIBLE_DEVICES")
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(root)
        lc.available_ram_mb = lambda: 100.0 if case.id == "launch-cpu-tiny-ram" else 16384.0
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(case.argv)
    finally:
        os.chdir(cwd)
        lc.available_ram_mb = ram
        if gpus is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    return rc, out.getvalue(), err.getvalue(), _snapshot(root) == before


# run_case's result of each case by id, kept by the corpus test for the option-name test below (a case's run does
# not depend on its folder: one run of the ~170 commands instead of two); a case not run yet there is run again
_RESULTS: dict[str, tuple[int, str, str, bool]] = {}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path):
    rc, out, err, unchanged = _RESULTS[case.id] = run_case(case, tmp_path)
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 2, err
    assert case.needle in err, err
    assert out == "", out[-500:]
    assert unchanged, "the command wrote or changed files"


RUNTIME = ("launch", "train", "data", "profile")


def test_runtime_commands_refuse_bad_input_with_torch_blocked():
    """The runtime subcommands' bad inputs, again in a process where importing torch or megatron fails: each is
    still caught (exit 2, its line) before the runtime's heavy imports."""
    from tests.unit.test_torch_free import run_blocked

    ids = [c.id for c in CASES if c.argv and c.argv[0] in RUNTIME]
    assert len(ids) >= 60
    r = run_blocked(f"""
        import tempfile
        from pathlib import Path
        from tests.unit.test_bad_inputs import CASES, run_case
        bad = []
        for c in CASES:
            if c.id in {ids!r}:
                with tempfile.TemporaryDirectory() as d:
                    rc, out, err, unchanged = run_case(c, Path(d))
                if rc != 2 or c.needle not in err or not unchanged:
                    bad.append((c.id, rc, err[-300:]))
        print(bad)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


_COMMANDS = ("search", "baseline", "explain", "validate", "export", "import", "import-hf", "models", "clusters",
             "plot", "calibrate", "train", "launch", "profile", "data")
_READS_MEGATRON = ("import", "explain", "calibrate")     # their inputs are Megatron-LM command lines
TORCHRUN = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"}


def _options(command: str) -> set[str]:
    """Every option string of ``aceso COMMAND`` (with its nested subcommands': ``data prepare``)."""
    import argparse

    from search.cli import build_parser

    def walk(p):
        out = set()
        for a in p._actions:
            out |= set(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    out |= walk(sub)
        return out

    p = build_parser(command)
    return walk(next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[command])


def _scope_end(text: str, m) -> int:
    """Where a command mention stops applying: at the ')' closing the parenthesis it stands in, else the end."""
    inside = text.rfind("(", 0, m.start()) > text.rfind(")", 0, m.start())
    return text.find(")", m.end()) % (len(text) + 1) if inside else len(text)


def misnamed_options(command: str, message: str) -> list[str]:
    """The options ``message`` (an error of ``aceso COMMAND``) names that nobody who reads it can give: an option
    belongs to the command named last before it in its clause (``aceso X ...``, ``X with ...``, ``X a plan for
    ...``), else to ``command`` (launch: also train's options, which it passes on); commands that read Megatron-LM
    command lines may name Megatron-LM core_v0.16.1's flags and torchrun's."""
    from search.megatron.cmdline import megatron_flags

    names = "|".join(re.escape(c) for c in sorted(_COMMANDS, key=len, reverse=True))
    mention = re.compile(rf"\baceso ({names})\b|\b({names}) (?:with|a plan|the plan|--)")
    message = re.sub(r"^aceso [\w-]+(?: [\w-]+)?: error: ", "", message)
    out = []
    for clause in message.split(";"):
        for flag in re.finditer(r"(?<![\w-])--[a-z][a-z0-9_-]*(?![\w/-])", clause):
            named = [m.group(1) or m.group(2) for m in mention.finditer(clause, 0, flag.start())
                     if flag.start() < _scope_end(clause, m)]
            owner = named[-1] if named else command
            valid = _options(owner) | (_options("train") if owner == "launch" else set())
            if owner in _READS_MEGATRON:
                valid |= megatron_flags() | TORCHRUN
            if flag.group() not in valid:
                out.append(flag.group())
    return out


def test_every_refusal_names_options_the_reader_can_give(tmp_path):
    """Issue 32: an import on a V100 said "use --attention auto" (import has no --attention: the fix is the
    script's --transformer-impl local). Every refusal of the corpus names only options of the command it is
    about (its parser's own), or Megatron-LM flags where the input is a Megatron-LM command line."""
    bad = []
    for case in CASES:
        if not case.argv or case.argv[0] not in _COMMANDS:
            continue
        if case.id in _RESULTS:
            err = _RESULTS[case.id][2]
        else:
            with tempfile.TemporaryDirectory(dir=tmp_path) as d:
                _rc, _out, err, _ = run_case(case, Path(d))
        given = " ".join(case.argv) + " " + " ".join(str(v) for v in case.files.values())
        wrong = [f for f in misnamed_options(case.argv[0], err.strip().splitlines()[-1] if err.strip() else "")
                 if not re.search(rf"{re.escape(f)}(?![\w-])", given)]     # an option the input gave, quoted
        if wrong:
            bad.append((case.id, wrong, err.strip()[-200:]))
    assert bad == [], "\n".join(map(str, bad))


def test_the_option_walk_catches_an_option_the_command_lacks():
    assert misnamed_options("import", "aceso import: error: --attention flash: v100 has no flash attention; use "
                                      "--attention auto or unfused") == ["--attention", "--attention"]
    assert misnamed_options("import", "x; add --transformer-impl local") == []
    assert misnamed_options("export", "x; search with --target megatron-lm") == []
    assert misnamed_options("search", "hf.json: convert it first: aceso models --from-hf hf.json") == []
    assert misnamed_options("train", "give --data-path P (from `aceso data prepare`) or --mock-data") == []
    assert misnamed_options("train", "give --data-path P (from `aceso data prepare`) or --mock-dat") == ["--mock-dat"]


def test_cp_on_a_cpu_launch_suggests_only_what_launch_takes(tmp_path):
    """The message names a fix launch can take: no cost-model option (``--attention flash``) that launch has not."""
    case = next(c for c in CASES if c.id == "launch-cpu-cp")
    rc, _out, err, _ = run_case(case, tmp_path)
    assert rc == 2 and "--attention" not in err and "flash" not in err, err


def test_explain_profile_json_is_plain_json(tmp_path):
    """``explain --cost-model profile --json`` printed numpy bools it could not serialise (issue 25)."""
    case = C("ok", "explain plan.json --cost-model profile --db db.json --json", "")
    rc, out, err, _ = run_case(case, tmp_path)
    assert rc == 0, err
    report = json.loads(out)
    assert report["cost_model"] == "profile" and report["fits"] is True
    assert all(type(s["fits"]) is bool for s in report["stages"])
