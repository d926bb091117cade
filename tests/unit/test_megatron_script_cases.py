"""The launch-script constructs of Megatron-LM's own examples that issue 21 names, in scripts of our own (the
examples themselves are read by test_megatron_examples.py where a Megatron-LM checkout is at hand): ``ARGS+=(...)``
appends inside an ``if``, a multi-line double-quoted string, ``--no-position-embedding`` beside rope, MoE flags, and
entry points that are not pretraining. Each imports right or is refused with its true reason in one line."""

from __future__ import annotations

import pytest

from search.io.errors import AcesoError
from search.megatron.importer import read_megatron

FP8 = """#!/bin/bash
DTYPE="fp8"
MODEL=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 --seq-length 512
       --max-position-embeddings 512 --position-embedding-type rope --normalization RMSNorm --swiglu
       --untie-embeddings-and-output-weights --disable-bias-linear --group-query-attention --num-query-groups 2)
TRAIN=(--micro-batch-size 1 --global-batch-size 16 --bf16)
DDP=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAIN+=("${DDP[@]}")
if [[ "$DTYPE" == "fp8" ]]; then
    TRAIN+=(--fp8-format hybrid --fp8-amax-history-len 1024)
fi
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
torchrun --nproc_per_node 8 pretrain_gpt.py "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" --tensor-model-parallel-size 2
"""

T5 = """#!/bin/bash
GPUS=2
T5_ARGS="
    --encoder-num-layers 2
    --decoder-num-layers 2
    --hidden-size 256
    --num-attention-heads 4
    --kv-channels 64
    --ffn-hidden-size 1024
    --encoder-seq-length 128
    --decoder-seq-length 32
    --max-position-embeddings 128
    --micro-batch-size 4
    --global-batch-size 32
    --bf16
"
DATA_ARGS="--mock-data --vocab-size 512"
torchrun --nproc_per_node $GPUS pretrain_t5.py $T5_ARGS $DATA_ARGS --tensor-model-parallel-size 1
"""

MOE = """#!/bin/bash
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-"1"}
MODEL_ARGS=(
    --disable-bias-linear --seq-length 1024 --max-position-embeddings 4096 --num-layers 4 --hidden-size 512
    --ffn-hidden-size 1792 --num-attention-heads 8 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
    --no-position-embedding
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 64 --bf16)
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py \\
    "${MODEL_ARGS[@]}" ${MOE_ARGS[@]} "${TRAINING_ARGS[@]}" \\
    --tensor-model-parallel-size 2 --mock-data --vocab-size 32000
"""


def test_appends_inside_an_if_are_followed_and_fp8_is_read_for_fp8():
    assert read_megatron(FP8, source="fp8.sh").plan.settings.low_precision.recipe == "fp8-delayed"
    imp = read_megatron(FP8.replace('DTYPE="fp8"', 'DTYPE="bf16"'), source="bf16.sh")
    c = imp.config.settings
    assert (c.distributed_optimizer, c.overlap_grad_reduce, c.overlap_param_gather) == (True, True, True)
    assert imp.plan.model.vocab_size == 32000         # NullTokenizer from Megatron-LM 0.18: the EOD token is one of them
    assert imp.plan.world_size == 8 and imp.plan.stages[0].tp == 2 and imp.plan.model.num_query_groups == 2


def test_a_multi_line_double_quoted_string_splits_into_its_flags():
    imp = read_megatron(T5, source="t5.sh")
    m = imp.plan.model
    assert m.is_t5 and (m.num_layers, m.num_decoder_layers) == (2, 2)           # T5: num_layers is the encoder's
    assert (m.seq_length, m.decoder_seq_length, m.vocab_size) == (128, 32, 512)
    assert imp.plan.world_size == 2 and imp.plan.global_batch_size == 32


def test_no_position_embedding_beside_rope_is_rope_and_moe_with_tp_needs_sequence_parallel():
    with pytest.raises(AcesoError, match=r"^moe\.sh: stages\[0\]: tp \(2\) on an MoE model needs sequence_parallel"):
        read_megatron(MOE, source="moe.sh")                 # megatron-core's MoELayer refuses MoE + TP without SP
    m = read_megatron(MOE.replace("--mock-data", "--mock-data --sequence-parallel"), source="moe.sh").plan.model
    assert (m.moe.num_experts, m.moe.moe_router_topk, m.position_embedding) == (8, 2, "rope")
    dense = MOE.replace("    --num-experts 8\n", "").replace("    --moe-router-topk 2\n", "")
    imp = read_megatron(dense, source="dense.sh")
    assert imp.plan.model.position_embedding == "rope" and imp.plan.stages[0].tp == 2


@pytest.mark.parametrize("command, reason", [
    ("torchrun --nproc_per_node 8 pretrain_bert.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16",
     "runs pretrain_bert.py: BERT pretraining"),
    ("torchrun --nproc_per_node 1 tools/run_text_generation_server.py --num-layers 24 --hidden-size 1024",
     "runs tools/run_text_generation_server.py: inference / text generation, not training"),
    # issue 32: the entry was cut to its file name, so examples/mimo/train.py read as "train.py: not a Megatron-LM
    # pretraining entry point"; a placeholder the file cannot parse hid the inference module a launcher runs
    ("torchrun --nproc_per_node 8 examples/mimo/train.py --num-layers 2 --hidden-size 64",
     "runs examples/mimo/train.py: a MIMO multimodal model (megatron-core's MimoModel"),
    ("torchrun --nproc_per_node 8 pretrain_vlm.py --num-layers 2 --hidden-size 64",
     "runs pretrain_vlm.py: a vision-language model (pretrain_vlm.py"),
    ("CHECKPOINT=<Path to the checkpoint>\ntorchrun $DISTRIBUTED_ARGS -m examples.inference.gpt.gpt_static_inference "
     "--load ${CHECKPOINT}", "runs examples/inference/gpt/gpt_static_inference.py: inference / text generation"),
    ("VOCAB=<Path to vocab.json>\npython -m torch.distributed.launch $DISTRIBUTED_ARGS "
     "tools/run_text_generation_server.py --num-layers 24",
     "runs tools/run_text_generation_server.py: inference / text generation"),
    ("python -m torch.distributed.run --nproc-per-node 8 -m examples.inference.gpt.gpt_dynamic_inference --bf16",
     "line 2: runs examples.inference.gpt.gpt_dynamic_inference (python -m examples.inference.gpt.gpt_dynamic_"
     "inference): inference / text generation"),
])
def test_an_entry_point_that_is_not_pretraining_is_refused_as_what_it_is(command, reason):
    with pytest.raises(AcesoError) as e:
        read_megatron("#!/bin/bash\n" + command + "\n", source="run.sh")
    assert str(e.value).startswith("run.sh: " + reason) and "\n" not in str(e.value)
