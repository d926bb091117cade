"""The T5 variant of the end-to-end run: sentence-split data through megatron-core's T5 span-corruption dataset,
a 3-stage (TP 2/1/1) plan whose first stage is the encoder, 4 gloo processes against one process; resume."""

from __future__ import annotations

import pytest

from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from tests.distributed.test_train_gpt import (TRAIN, assert_matches_single_process, assert_resume_repeats_steps,
                                               loss_drop, prepare_and_train)

# 1 encoder layer (units 0-1) + 1 decoder layer (units 2-4: self-attention, cross-attention, MLP)
TINY_T5 = ModelSpec(name="tiny-t5", family="t5", num_layers=1, num_decoder_layers=1, hidden_size=64,
                    num_attention_heads=4, ffn_hidden_size=128, seq_length=32, decoder_seq_length=16,
                    vocab_size=363, params_dtype="fp32", add_bias_linear=False)
ONE = ParallelPlan(model=TINY_T5, micro_batch_size=2, global_batch_size=8, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=5, recompute=["none"] * 5)])
THREE = ParallelPlan(model=TINY_T5, micro_batch_size=2, global_batch_size=8, stages=[
    StageSpec(num_gpus=2, tp=2, dp=1, start_unit=0, end_unit=2, recompute=["none", "selective"]),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=2, end_unit=4, recompute=["full", "none"]),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=4, end_unit=5, recompute=["none"])])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    # the 4-process runs forked from the preloaded server: `aceso launch` and its torchrun are test_train_gpt.py's
    return prepare_and_train(tmp_path_factory.mktemp("train_t5"), ONE, THREE, ["--split-sentences"], TRAIN,
                             launch=False)


def test_t5_four_process_plan_matches_single_process_at_every_step(work):
    assert_matches_single_process(work["dir"])


def test_t5_loss_falls_clearly(work):
    first, last = loss_drop(work["dir"])
    assert last < first - 2.5, (first, last)  # from ~5.3 to ~1.5


def test_t5_resume_from_step_15_repeats_steps_16_to_30(work):
    assert_resume_repeats_steps(work["dir"])
