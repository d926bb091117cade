"""The import paths' corpus of bad inputs (issue 32): `models --from-hf` / `import-hf` on broken config.json files and
`import --from megatron-lm` / `explain --megatron-args-file` on broken launch scripts. Missing, empty, folder and
binary files, wrong JSON types, zero, negative and out-of-range values, unknown enum values and fields: each exits
2 with exactly one line naming the field (or file), no traceback, nothing on stdout, nothing written.

Cases run in-process in a temporary folder through ``tests.unit.test_bad_inputs.run_case`` (the good base files of
that corpus are there too; each case adds its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_bad_inputs import C, run_case

HF = Path(__file__).parent / "data" / "hf"
QWEN = json.loads((HF / "qwen2.5-7b" / "config.json").read_text())
DSV3 = json.loads((HF / "deepseek-v3" / "config.json").read_text())
Q3MOE = json.loads((HF / "qwen3-30b-a3b" / "config.json").read_text())
MLM = ("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
       "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --vocab-size 100 --tokenizer-type "
       "NullTokenizer")
BAD_NUMBERS = (("string", "12"), ("bool", True), ("zero", 0), ("negative", -4), ("fraction", 1.5), ("list", []),
               ("object", {}))


def hf(id, cfg, needle, *extra):
    """The same broken config through both commands that read one."""
    return [C(f"hf-{id}", ["models", "--from-hf", "c.json", "-o", "out.json", *extra], needle, **{"c.json": cfg}),
            C(f"import-hf-{id}", ["import-hf", "c.json", "-o", "out.json", *extra], needle, **{"c.json": cfg})]


def script(id, text, needle):
    """The same launch script through explain and import."""
    return [C(f"explain-{id}", ["explain", "--megatron-args-file", "run.sh", "--cluster", "1x8-h100"], needle,
              **{"run.sh": text}),
            C(f"import-{id}", ["import", "--from", "megatron-lm", "run.sh", "-o", "out.json"], needle,
              **{"run.sh": text})]


CASES = [
    # ----- the config file itself ---------------------------------------------------------------------------------
    C("hf-missing", ["models", "--from-hf", "nope/config.json"], "nope/config.json: no such file"),
    C("hf-folder", ["models", "--from-hf", "data"], "data: is a folder"),
    *hf("empty", "", "c.json: not valid JSON"),
    *hf("binary", b"\xff\xfe\x00", "c.json: not valid JSON (not UTF-8 text at byte 0)"),
    *hf("not-json", "model_type: qwen2", "c.json: not valid JSON"),
    *[x for n, v in (("list", [1]), ("string", '"x"'), ("null", None), ("number", 5))
      for x in hf(f"top-{n}", v, "a config.json must be a JSON object")],
    *hf("nan", '{"model_type": NaN}', "model_type is NaN; it must be a string"),
    *hf("deep", "[" * 100000 + "]" * 100000, "nested too deeply"),
    *hf("no-model-type", {k: v for k, v in QWEN.items() if k != "model_type"}, "field model_type is missing"),
    *hf("model-type-number", {**QWEN, "model_type": 3}, "model_type is 3; it must be a string"),
    *hf("model-type-unknown", {**QWEN, "model_type": "bert"}, "model_type 'bert' is not supported"),
    *hf("unknown-field", {**QWEN, "use_turbo_attention": True}, "use_turbo_attention: a field aceso's import does "
        "not know for model_type qwen2"),
    # ----- each size field: wrong type, zero, negative, fraction, huge --------------------------------------------
    *[x for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "max_position_embeddings")
      for n, v in BAD_NUMBERS for x in hf(f"{key}-{n}", {**QWEN, key: v}, f"{key} is {json.dumps(v)}; it must be a "
                                                                           "positive integer")],
    *[x for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
      for x in hf(f"{key}-huge", {**QWEN, key: 10 ** 30}, f"{key}: Input should be less than or equal to")],
    *[x for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size")
      for x in hf(f"{key}-missing", {k: v for k, v in QWEN.items() if k != key}, f"field {key} is missing")],
    # ----- the other numbers and switches ----------------------------------------------------------------------------
    *hf("rope-theta-zero", {**QWEN, "rope_theta": 0}, "rope_theta is 0.0; it must be a positive number"),
    *hf("rope-theta-string", {**QWEN, "rope_theta": "fast"}, 'rope_theta is "fast"; it must be a finite number'),
    *hf("rope-theta-huge", {**QWEN, "rope_theta": 1e30}, "rope_theta: Input should be less than or equal to"),
    *hf("eps-zero", {**QWEN, "rms_norm_eps": 0}, "rms_norm_eps is 0.0; it must be a small positive number"),
    *hf("eps-huge", {**QWEN, "rms_norm_eps": 1.5}, "rms_norm_eps is 1.5; it must be a small positive number"),
    *hf("dropout-negative", {**QWEN, "attention_dropout": -0.1}, "attention_dropout: Input should be greater than"),
    *hf("dropout-one", {**QWEN, "attention_dropout": 1.5}, "attention_dropout: Input should be less than 1"),
    *hf("tied-string", {**QWEN, "tie_word_embeddings": "false"}, 'tie_word_embeddings is "false"; it must be true'),
    *hf("swa-string", {**QWEN, "use_sliding_window": "yes"}, 'use_sliding_window is "yes"; it must be true or false'),
    *hf("window-zero", {**QWEN, "sliding_window": 0}, "sliding_window is 0; it must be a positive integer"),
    *hf("window-layers-negative", {**QWEN, "max_window_layers": -4}, "max_window_layers is -4; it must be an "
        "integer of at least 0"),
    *hf("layer-types-short", {**QWEN, "layer_types": ["full_attention"]}, "layer_types is [\"full_attention\"]; it "
        "must be 28 entries"),
    *hf("head-dim-zero", {**QWEN, "head_dim": 0}, "head_dim is 0; it must be a positive integer"),
    *hf("rotary-fraction", {**QWEN, "partial_rotary_factor": 2}, "partial_rotary_factor is 2.0; it must be a "
        "fraction in (0, 1]"),
    *hf("act-unknown", {**QWEN, "hidden_act": "relu"}, 'hidden_act "relu": aceso\'s import reads the SwiGLU MLP'),
    *hf("mrope", {**QWEN, "use_mrope": True}, "use_mrope true: multimodal RoPE"),
    # ----- RoPE scaling ----------------------------------------------------------------------------------------------
    *hf("rope-scaling-string", {**QWEN, "rope_scaling": "yarn"}, 'rope_scaling is "yarn"; it must be an object'),
    *hf("rope-scaling-no-factor", {**QWEN, "rope_scaling": {"rope_type": "llama3"}}, "rope_scaling.factor is null"),
    *hf("rope-scaling-zero", {**QWEN, "rope_scaling": {"rope_type": "llama3", "factor": 0}}, "rope_scaling.factor is 0"),
    *hf("rope-scaling-unknown", {**QWEN, "rope_scaling": {"rope_type": "dynamic", "factor": 2}},
        'rope_scaling.rope_type "dynamic": megatron-core scales RoPE'),
    *hf("rope-scaling-type-number", {**QWEN, "rope_scaling": {"rope_type": 5, "factor": 2}},
        "rope_scaling.rope_type is 5; it must be a string"),
    *hf("rope-scaling-band", {**QWEN, "rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 2}},
        "rope_scaling.high_freq_factor 2: megatron-core 0.16.1's llama3 RoPE scaling fixes it at 4"),
    *hf("rope-scaling-yarn-partial", {**QWEN, "partial_rotary_factor": 0.5,
                                      "rope_scaling": {"rope_type": "yarn", "factor": 4}},
        "partial_rotary_factor 0.5: with rope_scaling yarn: megatron-core's YarnRotaryEmbedding"),
    *hf("rope-parameters-theta", {**QWEN, "rope_parameters": {"rope_type": "default", "rope_theta": "fast"}},
        'rope_parameters.rope_theta is "fast"; it must be a finite number'),
    # ----- experts, routers, MLA, MTP -------------------------------------------------------------------------------
    *hf("experts-zero", {**DSV3, "n_routed_experts": 0}, "n_routed_experts is 0; it must be a positive integer"),
    *hf("experts-one", {**DSV3, "n_routed_experts": 1}, "n_routed_experts: Input should be greater than 1"),
    *hf("experts-string", {**DSV3, "n_routed_experts": "256"}, 'n_routed_experts is "256"'),
    *hf("topk-zero", {**DSV3, "num_experts_per_tok": 0}, "num_experts_per_tok is 0"),
    *hf("topk-over", {**DSV3, "num_experts_per_tok": 300}, "moe_router_topk (300) must be at most num_experts (256)"),
    *hf("groups-divide", {**DSV3, "n_group": 7}, "moe.num_experts must be a multiple of moe.moe_router_num_groups"),
    *hf("group-topk-over", {**DSV3, "topk_group": 9}, "moe.moe_router_group_topk must be at most moe.moe_router_num_groups"),
    *hf("scoring-unknown", {**DSV3, "scoring_func": "sqrtsoftplus"}, "scoring_func 'sqrtsoftplus' is not one aceso's "
        "import knows (softmax, sigmoid)"),
    *hf("scoring-number", {**DSV3, "scoring_func": 5}, "scoring_func is 5; it must be a string"),
    *hf("topk-method-unknown", {**DSV3, "topk_method": "x"}, "topk_method 'x' is not one aceso's import knows"),
    *hf("norm-topk-string", {**DSV3, "norm_topk_prob": "yes"}, 'norm_topk_prob is "yes"; it must be true or false'),
    *hf("dense-negative", {**DSV3, "first_k_dense_replace": -1}, "first_k_dense_replace is -1"),
    *hf("dense-all", {**DSV3, "first_k_dense_replace": 61}, "moe.first_k_dense_layers (61) leaves no MoE layer"),
    *hf("mtp-negative", {**DSV3, "num_nextn_predict_layers": -1}, "num_nextn_predict_layers is -1"),
    *hf("mtp-huge", {**DSV3, "num_nextn_predict_layers": 1000}, "num_nextn_predict_layers: Input should be less than"),
    *hf("routed-scaling-zero", {**DSV3, "routed_scaling_factor": 0}, "routed_scaling_factor is 0.0; it must be a "
        "positive number"),
    *hf("lora-zero", {**DSV3, "kv_lora_rank": 0}, "kv_lora_rank is 0"),
    *hf("mla-groups", {**DSV3, "num_key_value_heads": 64}, "num_key_value_heads 64: multi-latent attention has no "
        "query groups"),
    *hf("yarn-beta-negative", {**DSV3, "rope_scaling": {**DSV3["rope_scaling"], "beta_fast": -1}},
        "rope_scaling.beta_fast: Input should be greater than 0"),
    *hf("aux-loss-huge", {**DSV3, "aux_loss_alpha": 5}, "aux_loss_alpha: Input should be less than or equal to 1"),
    *hf("sparse-step-zero", {**Q3MOE, "decoder_sparse_step": 0}, "decoder_sparse_step is 0"),
    *hf("mlp-only-out-of-range", {**Q3MOE, "mlp_only_layers": [99]}, "mlp_only_layers is [99]; it must be a list of "
        "layer numbers in [0, 48)"),
    *hf("mlp-only-strings", {**Q3MOE, "mlp_only_layers": ["a"]}, 'mlp_only_layers is ["a"]'),
    *hf("norm-topk-sigmoid", {**DSV3, "norm_topk_prob": False},
        "norm_topk_prob false: HF keeps the sigmoid router's top-k weights unnormalized"),
    # ----- the options ----------------------------------------------------------------------------------------------
    *hf("seq-zero", QWEN, "--seq-length: 0 must be at least 1", "--seq-length", "0"),
    *hf("seq-negative", QWEN, "--seq-length: -5 must be at least 1", "--seq-length", "-5"),
    *hf("seq-word", QWEN, "--seq-length: 'long' is not an integer", "--seq-length", "long"),
    *hf("seq-huge", QWEN, "--seq-length: 1000000000000 is above the limit", "--seq-length", str(10 ** 12)),
    C("models-seq-without-from-hf", ["models", "--seq-length", "4"], "--seq-length goes with --from-hf"),
    C("hf-out-folder", ["models", "--from-hf", "c.json", "-o", "data"], "-o data: is a folder", **{"c.json": QWEN}),

    # ----- Megatron-LM launch scripts: the file ---------------------------------------------------------------------
    C("explain-script-missing", ["explain", "--megatron-args-file", "nope.sh", "--cluster", "1x8-h100"],
      "nope.sh: no such file"),
    C("explain-script-folder", ["explain", "--megatron-args-file", "data", "--cluster", "1x8-h100"],
      "data: is a folder; give a file"),
    C("import-script-folder", ["import", "--from", "megatron-lm", "data"], "data: is a folder; give a file"),
    *script("empty", "", "run.sh: empty (no command, no arguments)"),
    *script("comments", "#!/bin/bash\n# nothing here\n\n", "run.sh: empty (no command, no arguments)"),
    *script("binary", b"\xff\xfe\x00", "run.sh: not a text file (not UTF-8 text at byte 0)"),
    *script("only-variables", "A=1\nB=2\n", "run.sh: no command: the file only sets variables (A, B)"),
    *script("another-script", "set -e\nbash ./train_llama.sh \"$@\"\n", "line 2: runs another script, "
            "./train_llama.sh"),
    *script("torchtitan", "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file x.toml\n",
            "runs torchtitan.train (torchrun -m torchtitan.train): not a Megatron-LM pretraining entry point"),
    *script("two-runs", MLM + "\n" + MLM.replace("--num-layers 4", "--num-layers 8") + "\n",
            "runs pretrain_gpt.py 2 times with different arguments (lines 1, 2)"),
    *script("loop-sets", "for i in 1 2; do N=$i; done\n" + MLM + "\n", "line 1: a 'for' loop that sets variables"),
    *script("unknown-flag", MLM + " --turbo\n", "--turbo: not a flag of Megatron-LM core_v0.19.0"),
    # ----- Megatron-LM flags: zero, negative, out of range, unknown values ----------------------------------------------
    *[x for flag, v, needle in [
        ("--num-layers", "0", "--num-layers: Input should be greater than 0 (got 0)"),
        ("--num-layers", "-2", "--num-layers: Input should be greater than 0 (got -2)"),
        ("--hidden-size", "0", "--hidden-size: Input should be greater than 0"),
        ("--num-attention-heads", "0", "--num-attention-heads: Input should be greater than 0"),
        ("--seq-length", "0", "--seq-length: Input should be greater than 0"),
        ("--ffn-hidden-size", "-1", "--ffn-hidden-size: Input should be greater than 0"),
        ("--kv-channels", "0", "--kv-channels: Input should be greater than 0"),
        ("--micro-batch-size", "0", "--micro-batch-size and --global-batch-size must be at least 1"),
        ("--micro-batch-size", "-1", "--micro-batch-size and --global-batch-size must be at least 1"),
        ("--global-batch-size", "0", "--micro-batch-size and --global-batch-size must be at least 1"),
        ("--tensor-model-parallel-size", "0", "--tensor/pipeline-model-parallel-size and --context-parallel-size must"),
        ("--pipeline-model-parallel-size", "-1", "--tensor/pipeline-model-parallel-size"),
        ("--vocab-size", "0", "--vocab-size 0: give the tokenizer's vocabulary size"),
        ("--vocab-size", "-5", "--vocab-size -5: give the tokenizer's vocabulary size"),
        ("--make-vocab-size-divisible-by", "0", "--make-vocab-size-divisible-by: Input should be greater than 0"),
        ("--rotary-base", "-5", "--rotary-base: Input should be greater than 0"),
        ("--attention-dropout", "2", "--attention-dropout: Input should be less than 1"),
        ("--hidden-dropout", "nan", "--hidden-dropout: Input should be a finite number"),
        ("--norm-epsilon", "0", "--norm-epsilon 0.0: give a small positive number"),
        ("--norm-epsilon", "x", "--norm-epsilon 'x': expected a number"),
        ("--rotary-percent", "2", "--rotary-percent 2.0: give a fraction in (0, 1]"),
        ("--rope-type", "foo", "--rope-type foo: use rope or yarn"),
        ("--use-rope-scaling --rope-scaling-factor", "-8", "--rope-scaling-factor -8.0: give a positive factor"),
        ("--normalization", "BatchNorm", "--normalization BatchNorm: aceso models LayerNorm and RMSNorm only"),
        ("--position-embedding-type", "alibi", "--position-embedding-type alibi"),
        ("--recompute-granularity", "foo", "--recompute-granularity 'foo': use full or selective"),
        ("--softmax-type", "foo", "--softmax-type foo: use vanilla, off-by-one, learnable"),
        ("--window-size", "x", "--window-size x: give two integers"),
        ("--num-experts", "-2", "--num-experts: Input should be greater than 1"),
        ("--num-experts 8 --moe-router-topk", "0", "--moe-router-topk: Input should be greater than 0"),
        ("--num-experts 8 --moe-router-topk", "9", "moe_router_topk (9) must be at most num_experts (8)"),
        ("--num-experts 8 --moe-router-score-function", "foo", "--moe-router-score-function: Input should be"),
        ("--num-experts 8 --moe-token-dispatcher-type", "foo", "--moe-token-dispatcher-type foo: use one of"),
        ("--num-experts 8 --moe-ffn-hidden-size", "0", "--moe-ffn-hidden-size: Input should be greater than 0"),
        ("--num-experts 8 --moe-router-topk-scaling-factor", "0", "--moe-router-topk-scaling-factor 0.0: give a "
                                                                   "positive factor"),
        ("--num-experts 8 --moe-expert-capacity-factor", "0", "--moe-expert-capacity-factor: Input should be greater"),
        ("--multi-latent-attention --rotary-scaling-factor", "-1", "--rotary-scaling-factor -1.0: give a positive"),
        ("--multi-latent-attention --kv-lora-rank", "0", "--kv-lora-rank: Input should be greater than 0"),
        ("--group-query-attention --num-query-groups", "0", "--num-query-groups: Input should be greater than 0"),
        ("--group-query-attention --num-query-groups", "3", "num_attention_heads (4) must be a multiple of "
                                                            "num_query_groups (3)"),
    ] for x in script(f"{flag.split()[-1][2:]}-{v}", f"{MLM} {flag} {v}\n", needle)],
    # ----- aceso's own options -----------------------------------------------------------------------------------------
    C("search-abbreviated-required", ["search", "--model", "spec.json", "--cluster", "1x2-cpu", "--glob=16"],
      "unrecognized arguments: --glob=16; did you mean --global-batch-size? (options are not abbreviated)"),
    C("baseline-abbreviated-required", ["baseline", "--model", "spec.json", "--cluster", "1x2-cpu", "--glob", "16"],
      "unrecognized arguments: --glob; did you mean --global-batch-size?"),
]


def test_the_corpus_is_large_and_unique():
    assert len(CASES) >= 250 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_import_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path):
    rc, out, err, unchanged = run_case(case, tmp_path)
    assert rc == 2, (rc, out[-300:], err[-1000:])
    assert "Traceback" not in err and "internal error" not in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert case.needle in err, err
    assert out == "" and unchanged


@pytest.mark.parametrize("argv, files", [
    (["models", "--from-hf", "c.json", "-o", "out.json"], {"c.json": {**QWEN, "num_key_value_heads": None}}),
    (["import", "--from", "megatron-lm", "run.sh", "-o", "out.json"], {"run.sh": MLM + " --num-experts 0\n"}),
], ids=["hf-absent-kv-heads-are-heads", "mlm-zero-experts-is-dense"])
def test_values_the_source_itself_accepts_are_accepted(argv, files, tmp_path):
    """Not every odd value is bad input: HF reads a null num_key_value_heads as one group per head, Megatron-LM's
    validate_args reads --num-experts 0 as a dense model (arguments.py: 'if args.num_experts == 0: None')."""
    rc, out, err, _ = run_case(C("ok", argv, "", **files), tmp_path)
    assert rc == 0, err
