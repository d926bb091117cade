"""A tied-embedding plan without the distributed optimizer, with overlapped gradient reduction (3 gloo ranks):
every embedding copy sits in a DDP bucket of its own (``patches.shared_embedding_bucket``), so the stage's
other buckets overlap their reduction with the backward while only the copy's bucket waits for the copies to be
summed -- the last stage too, whose DDP has one bucket otherwise (megatron-core does not bucket stages after the
first) and whose reduction then never overlapped. Loss, gradients and weights still equal the single-process
stock megatron-core model's (``test_plans.compare``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aceso_megatron.testing import run_plans, spawn
from tests.distributed.test_plans import SEED, STEPS, TC, compare, reference_process  # noqa: F401 (fixture)
from tests.distributed.test_plans import plan, st
from tests.tiny_models import GPT

PLAN = {**plan(GPT, st(1, 1, 0, 2), st(1, 2, 2, 4)), "overlap_grad_reduce": True}


def buckets(rank: int, world_size: int, out: str) -> None:
    """Per rank: for each DDP bucket, the canonical names of its parameters, which bucket groups are held
    back, and how many buckets reduced during the backward of the second step."""
    from aceso_megatron.testing import make_batches
    from aceso_megatron.training.engine import build_runtime

    rt = build_runtime(PLAN, rank, world_size, seed=SEED, train_config=TC)
    names = rt.canonical_names()
    by_param = {p: names[n] for n, p in rt.named_parameters()}
    groups = [bg for m in rt.models for bg in m.bucket_groups]
    layout = [sorted(by_param[p] for b in bg.buckets for p in b.params_list) for bg in groups]
    held = [i for i, bg in enumerate(groups) if bg in rt.held_bucket_groups]
    batches = make_batches(rt.plan.model, rt.plan.micro_batch_size, rt.plan.global_batch_size, SEED)
    rt.train_step(iter(batches))
    rt.train_step(iter(batches))
    mine = [{"stage": rt.layout.stage, "buckets": layout, "held": held, "overlapped": rt.overlapped_buckets}]
    got = [None] * world_size
    dist.all_gather_object(got, mine)
    if rank == 0:
        torch.save([g[0] for g in got], out)


def test_embedding_copy_has_its_own_bucket_and_overlaps(tmp_path):
    out = tmp_path / "buckets.pt"
    spawn(3, buckets, str(out))
    emb = "embedding.word_embeddings.weight"
    for r in torch.load(out):
        with_emb = [i for i, b in enumerate(r["buckets"]) if emb in b]
        assert len(with_emb) == 1 and r["buckets"][with_emb[0]] == [emb], r  # the copy alone in its bucket
        assert r["held"] == with_emb, r  # only the copy's bucket waits for the copies to be summed
        assert len(r["buckets"]) >= 2 and r["overlapped"] == len(r["buckets"]) - 1, r  # all others overlapped


def test_gradients_equal_stock_megatron_core(tmp_path, reference_process):  # noqa: F811
    out = tmp_path / "results.pt"
    spawn(3, run_plans, [PLAN], str(out), SEED, STEPS, TC)
    failures = compare(["gpt tied dp 1 -> 2, overlap, own embedding bucket"], [PLAN], torch.load(out))
    assert not failures, "\n".join(failures)
