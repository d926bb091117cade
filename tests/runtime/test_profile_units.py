"""Profiler building blocks in one process (gloo world of 1): the runtime's unit modules measured by
``TPBench`` against hand-computed bytes, the saved-tensor accounting against hand-computed peaks, and the
task/database assembly read back by the cost model."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.tiny_models import GPT, LLAMA, T5

T5 = T5.model_copy(update={"num_layers": 1, "num_decoder_layers": 1})


@pytest.fixture(scope="module")
def world1():
    started = not dist.is_initialized()
    if started:   # a file:// store: no MASTER_* variables left behind for later subprocesses to inherit
        store = tempfile.mktemp(prefix="aceso-profile-test-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from patches import cpu_mode

    cpu_mode.apply()
    yield
    cpu_mode.revert()
    if started:
        dist.destroy_process_group()


def _bench(model):
    from aceso_megatron.profiler.units import Settings, TPBench

    return TPBench(model, 1, 1, 0, Settings("cpu", 0, 2))


def test_gpt_units_bytes(world1):
    bench = _bench(GPT)
    s, h = GPT.seq_length, GPT.hidden_size
    for b in (1, 2):
        for kind in ("attention", "mlp"):
            r = bench.unit("decoder", kind, b)
            # full recompute keeps only the unit's input: s*b*h fp32 values
            assert r["act_bytes"][2] == 4 * s * b * h
            assert r["act_bytes"][0] >= r["act_bytes"][1] >= r["act_bytes"][2]
            # parameters of the unit (search.spec.model's count; fp32)
            assert r["weight_bytes"] == 4 * GPT.unit_params(kind)
            assert r["fwd_us"] > 0 and r["bwd_us"] > 0 and r["recompute_us"][0] == 0.0
    # selective attention drops the attention core's s^2 tensors: at least the softmax output (a*s*s*b values;
    # with attention dropout 0 the probabilities the value product keeps are the same tensor)
    r = bench.unit("decoder", "attention", 1)
    a = GPT.num_attention_heads
    assert r["act_bytes"][0] - r["act_bytes"][1] >= 4 * a * s * s
    # activations are linear in the batch (no batch-independent saved tensors in a unit)
    r1, r2 = bench.unit("decoder", "mlp", 1), bench.unit("decoder", "mlp", 2)
    assert r2["act_bytes"][0] == 2 * r1["act_bytes"][0]


def test_attention_rows_have_attn_dropout(world1):
    """Attention rows carry 4 choices (none, selective, full, attn_dropout), MLP rows 3; attn_dropout frees the
    dropped probabilities and the dropout mask (on CPU a noise tensor of the dtype): 2 * 4 bytes per score."""
    model = GPT.model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    bench = _bench(model)
    s, a = model.seq_length, model.num_attention_heads
    att, mlp = bench.unit("decoder", "attention", 2), bench.unit("decoder", "mlp", 2)
    for key in ("recompute_us", "act_bytes", "saved_bytes"):
        assert len(att[key]) == 4 and len(mlp[key]) == 3, key
    assert att["act_bytes"][0] - att["act_bytes"][3] == 2 * a * s * s * (4 + 4)
    assert att["act_bytes"][2] == 4 * s * 2 * model.hidden_size
    t5 = _bench(T5.model_copy(update={"attention_dropout": 0.1}))
    cross = t5.unit("decoder", "cross_attention", 1)
    sd, se = T5.decoder_seq_length, T5.seq_length
    assert len(cross["act_bytes"]) == 4
    assert cross["act_bytes"][0] - cross["act_bytes"][3] == T5.num_attention_heads * sd * se * (4 + 4)


def test_llama_units(world1):
    """RoPE, grouped-query attention, SwiGLU, RMSNorm, untied head."""
    bench = _bench(LLAMA)
    s, h, v = LLAMA.seq_length, LLAMA.hidden_size, LLAMA.padded_vocab_size
    for kind in ("attention", "mlp"):
        r = bench.unit("decoder", kind, 2)
        assert r["weight_bytes"] == 4 * LLAMA.unit_params(kind)
        assert r["act_bytes"][2] == 4 * s * 2 * h
    assert bench.head(1)["weight_bytes"] == 4 * (h + v * h)     # RMSNorm weight + the untied output layer


def test_embedding_and_head(world1):
    bench = _bench(GPT)
    e = bench.embedding(2)
    v, h, s = GPT.padded_vocab_size, GPT.hidden_size, GPT.seq_length
    assert e["weight_bytes"] == 4 * (v + s) * h          # word + learned position embeddings
    hd = bench.head(2)
    assert hd["weight_bytes"] == 4 * 2 * h               # final layernorm only: the output layer is tied
    # the head keeps at least the final norm's input and the fp32 softmax over the vocabulary
    assert hd["act_bytes"] >= 4 * s * 2 * h + 4 * s * 2 * v


def test_t5_units(world1):
    bench = _bench(T5)
    h, se, sd = T5.hidden_size, T5.seq_length, T5.decoder_seq_length
    enc = bench.unit("encoder", "attention", 1)
    cross = bench.unit("decoder", "cross_attention", 1)
    assert enc["act_bytes"][2] == 4 * se * h
    assert cross["act_bytes"][2] == 4 * sd * h           # the encoder output (context) is not counted here
    assert cross["weight_bytes"] == 4 * T5.unit_params("cross_attention")


def test_live_saved_peak():
    """Peak of live saved activations of a hand-made graph: y = x * x keeps x, z = exp(y) keeps z."""
    from aceso_megatron.profiler.memory import LiveSaved

    x = torch.randn(1000, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(1000))
    with LiveSaved([w]) as live:
        z = (x * x).exp()
        u = (z * w).sum()          # keeps z (already counted) and w (a parameter: excluded)
        assert live.live == 2 * 4000
        u.backward()
        del z, u
    assert live.peak == 2 * 4000
    assert live.live == 0


def test_assemble_reads_back(tmp_path):
    """Results by key -> the cost model's database -> the cost model's unit table, numbers unchanged."""
    from aceso_megatron.profiler.tasks import Task, assemble, comm_tasks, unit_tasks
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.costmodel.profiledb import ProfileDBWriter
    from search.spec.training import TrainingSpec

    tasks = unit_tasks(GPT, [1], [1, 2]) + comm_tasks(2, 2, 1024, 4096)
    done = {}
    for t in tasks:
        if t.what == "unit":
            done[t.key] = {"fwd_us": 100.0 * t.batch, "bwd_us": 200.0 * t.batch, "recompute_us": [0, 10, 100],
                           "act_bytes": [3e5 * t.batch, 2e5 * t.batch, 1e5 * t.batch], "weight_bytes": 4e3}
        elif t.what in ("embedding", "head"):
            done[t.key] = {"fwd_us": 50.0, "bwd_us": 60.0, "act_bytes": 1e3, "weight_bytes": 8e3}
        elif t.what != "optimizer":
            done[t.key] = {"us": 10.0 + t.nbytes / 1e3}
    w = ProfileDBWriter(GPT, gpu="cpu", dtype="fp32")
    assemble(w, GPT, tasks, done)
    path = w.save(tmp_path / "db.json")
    assert {c["kind"] for c in w.data["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert w.data["all_to_all"][0]["points"] == [[1024, pytest.approx(11.024)], [4096, pytest.approx(14.096)]]
    tr = TrainingSpec(global_batch_size=4, micro_batch_sizes=[1, 2], precision="fp32")
    cm = make_cost_model(GPT, parse_cluster("1x2-cpu"), tr, kind="profile", db=path)
    t = cm.unit_table(2, 1)
    assert list(t.fwd_ms) == [0.2] * 4 and list(t.bwd_ms) == [0.4] * 4
    assert t.act_mb[0, 0] == pytest.approx(6e5 / 2**20)
    assert cm.comm.all_reduce(2048, 2) == pytest.approx((10 + 2048 / 1e3) / 1e3)   # linear between points
    assert isinstance(Task("k", "unit"), Task)


def test_passes_merge_by_median():
    """Three passes of a measurement: times are the element-wise median, bytes come from the first pass."""
    from aceso_megatron.profiler.tasks import assemble, unit_tasks
    from search.costmodel.profiledb import ProfileDBWriter

    tasks = unit_tasks(GPT, [1], [1], passes=3)
    assert [t.key for t in tasks if t.what == "head"] == ["head/tp1/b1", "head/tp1/b1#1", "head/tp1/b1#2"]
    slow = {0: 1.0, 1: 9.0, 2: 2.0}           # pass 1 hit a slow spell
    done = {}
    for t in tasks:
        p = int(t.key.split("#")[1]) if "#" in t.key else 0
        if t.what == "unit":
            done[t.key] = {"fwd_us": 100.0 * slow[p], "bwd_us": 200.0, "recompute_us": [0.0, 10.0 * slow[p], 50.0],
                           "act_bytes": [3.0, 2.0, 1.0], "weight_bytes": 4.0}
        elif t.what in ("embedding", "head"):
            done[t.key] = {"fwd_us": 5.0 * slow[p], "bwd_us": 6.0, "act_bytes": 1.0, "weight_bytes": 8.0}
    w = ProfileDBWriter(GPT, gpu="cpu", dtype="fp32")
    assemble(w, GPT, tasks, done)
    assert len(w.data["units"]) == 2 and len(w.data["head"]) == 1
    u = w.data["units"][0]
    assert u["fwd_us"] == 200.0 and u["recompute_us"] == [0.0, 20.0, 50.0] and u["passes"] == 3
    assert w.data["head"][0]["fwd_us"] == 10.0
