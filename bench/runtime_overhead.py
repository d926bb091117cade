"""Runtime overhead: a uniform plan run by the plugin vs by stock megatron-core built the usual way.

Both sides train the same GPT (same plan-independent initial weights, same batches) on gloo/CPU with the same
1F1B schedule: the plugin through ``aceso_megatron.build_runtime`` (its own groups, stage chunks of unit layers,
``PlanCommunicator``), stock megatron-core through ``parallel_state.initialize_model_parallel``, ``GPTModel``
with ``pre_process``/``post_process`` and its default P2P communicator and ``finalize_model_grads``. Steps are
interleaved (plugin, stock, stock, plugin, ...) so machine noise and order effects hit both alike.

Prints a table and writes ``bench/results/runtime_overhead_pp<pp>_tp<tp>.json``: median step times, their ratio
(median over steps of stock / plugin; target >= 0.95 on CPU, >= 0.99 on a GPU) and the losses of every step
(must agree).

    python bench/runtime_overhead.py [--pp 2] [--tp 1] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aceso_megatron.training.engine import TrainConfig
from aceso_megatron.testing import make_batches, spawn
from search.model import ModelSpec

MODEL = ModelSpec(name="bench-gpt", family="gpt", num_layers=4, hidden_size=256, num_attention_heads=8,
                  ffn_hidden_size=1024, seq_length=128, vocab_size=1024, params_dtype="fp32")
SEED = 3


def uniform_plan(pp: int, tp: int, mb: int, gbs: int) -> dict:
    units = MODEL.num_units // pp
    stages = [{"num_gpus": tp, "tp": tp, "dp": 1, "start_unit": i * units, "end_unit": (i + 1) * units,
                   "recompute": ["none"] * units} for i in range(pp)]
    return {"model": MODEL.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": stages}


def build_stock(pp: int, tp: int, tc: TrainConfig):
    """GPTModel chunk of this rank, the usual way (parallel_state), with the plugin's initial weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from aceso_megatron.model.config import stage_config
    from aceso_megatron.model.init import initialize
    from model_specs.builders import gpt_layer_spec
    from patches import cpu_mode

    cpu_mode.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(SEED)
    config = stage_config(MODEL, tp)
    config.pipeline_model_parallel_size = pp
    gpt = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(MODEL, te=False),
                   vocab_size=MODEL.padded_vocab_size,
                   max_sequence_length=MODEL.seq_length, pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=MODEL.tied_embeddings)
    offset = get_transformer_layer_offset(config)
    names = {}
    for n, _ in gpt.named_parameters():
        if n.startswith("decoder.layers."):
            i, rest = n[len("decoder.layers."):].split(".", 1)
            names[n] = f"decoder.layers.{int(i) + offset}.{rest}"
        elif n == "output_layer.weight" and MODEL.tied_embeddings:
            names[n] = "embedding.word_embeddings.weight"
        else:
            names[n] = n
    initialize(gpt, names, MODEL, SEED, tp, ps.get_tensor_model_parallel_rank(), tc.init_method_std)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay,
                                                 adam_beta1=tc.adam_beta1, adam_beta2=tc.adam_beta2,
                                                 clip_grad=tc.clip_grad, params_dtype=torch.float32), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, opt


def stock_step(ddp, opt, batches, mb: int) -> float:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    ddp.zero_grad_buffer()
    opt.zero_grad()

    def step(it, model):
        b = next(it)
        pos = torch.arange(MODEL.seq_length).unsqueeze(0).expand_as(b["tokens"])
        out = model(b["tokens"], pos, None, labels=b["labels"])
        return out, lambda t: (t.sum(), torch.tensor(t.numel(), dtype=torch.int), {"sum": t.sum().detach()})

    store = forward_backward_pipelining_without_interleaving(
        forward_step_func=step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
        seq_length=MODEL.seq_length, micro_batch_size=mb)
    opt.step()
    total = torch.tensor(sum(float(d["sum"]) for d in store) if ps.is_pipeline_last_stage() else 0.0,
                         dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / (len(batches) * mb * MODEL.seq_length) / ps.get_tensor_model_parallel_world_size()


def worker(rank: int, world: int, pp: int, tp: int, steps: int, out: str) -> None:
    from aceso_megatron.training.engine import build_runtime

    mb, gbs = 4, 16
    tc = TrainConfig(clip_grad=1.0)
    ddp, opt = build_stock(pp, tp, tc)  # first: parallel_state insists on creating the attention scratch buffer
    rt = build_runtime(uniform_plan(pp, tp, mb, gbs), rank, world, seed=SEED, train_config=tc)
    batches = make_batches(MODEL, mb, gbs, seed=SEED)
    times = {"plugin": [], "stock": []}
    losses = {"plugin": [], "stock": []}
    for i in range(steps):
        for side in (("plugin", "stock") if i % 2 == 0 else ("stock", "plugin")):
            dist.barrier()
            t = time.perf_counter()
            loss = rt.train_step(iter(batches)) if side == "plugin" else stock_step(ddp, opt, batches, mb)
            dist.barrier()
            times[side].append(time.perf_counter() - t)
            losses[side].append(loss)
    if rank == 0:
        torch.save({"times": times, "losses": losses}, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    out = tempfile.mktemp(suffix=".pt")
    spawn(args.pp * args.tp, worker, args.pp, args.tp, args.steps, out)
    res = torch.load(out)
    t_plugin = statistics.median(res["times"]["plugin"][1:])  # first step warms up
    t_stock = statistics.median(res["times"]["stock"][1:])
    # median of paired ratios: each plugin step is paired with the stock step right after it (load drifts cancel)
    ratio = statistics.median(s / p for p, s in zip(res["times"]["plugin"][1:], res["times"]["stock"][1:]))
    max_diff = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["plugin"], res["losses"]["stock"]))
    print(f"uniform plan: pp={args.pp} tp={args.tp} dp=1, model {MODEL.name} "
          f"(h={MODEL.hidden_size}, {MODEL.num_layers} layers, seq {MODEL.seq_length}), 4 micro-batches of 4")
    print(f"{'side':8} {'median step (s)':>16} {'losses':>40}")
    for side in ("plugin", "stock"):
        ls = " ".join(f"{x:.6f}" for x in res["losses"][side][:4])
        print(f"{side:8} {statistics.median(res['times'][side][1:]):16.4f} {ls:>40}")
    print(f"step-time ratio stock/plugin = {ratio:.3f} (target >= 0.95); max relative loss difference {max_diff:.2e}")
    result = {"pp": args.pp, "tp": args.tp, "steps": args.steps, "model": MODEL.model_dump(), "times": res["times"],
                  "losses": res["losses"], "median_plugin_s": t_plugin, "median_stock_s": t_stock, "ratio": ratio,
                  "max_rel_loss_diff": max_diff, "target_ratio": 0.95}
    path = ROOT / "bench" / "results" / f"runtime_overhead_pp{args.pp}_tp{args.tp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
