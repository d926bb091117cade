"""Runtime overhead: a uniform plan run by the plugin vs by stock megatron-core built the usual way.

Both sides train the same GPT (same plan-independent initial weights, same batches, same fusions) with the same
megatron-core schedule: the plugin through ``aceso_megatron.build_runtime`` (its own groups, chunks of unit
layers, ``PlanCommunicator``), stock megatron-core through ``parallel_state.initialize_model_parallel``,
``GPTModel`` with ``pre_process``/``post_process``, its default P2P communicator, ``finalize_model_grads`` and the
DDP/optimizer settings Megatron-LM uses for the same features (``no_sync_func`` with overlapped gradient
reduction). Steps are interleaved (plugin, stock, stock, plugin, ...) so machine noise and order effects hit both
alike. ``--modern``: sequence parallelism and the distributed optimizer with both overlaps (small DDP buckets so
several overlap). Stock layer spec: transformer-engine's when importable (GPU), else the local one -- on CPU with
the torch norms flagged sequence-parallel (``aceso_megatron.model.norms``: megatron-core's torch fallback refuses
SP, apex's FusedLayerNorm is what a GPU without TE would use). ``--ep N``: the MoE variant of the model
(``MOE_MODEL``: every layer megatron-core's ``MoELayer``, 4 experts top-2, the alltoall dispatcher) with its experts
over N ranks; stock megatron-core builds it the usual way for MoE (``initialize_model_parallel(...,
expert_model_parallel_size=N)``, ``get_gpt_decoder_block_spec``, grouped GEMM and permute fusion where TE has
them, as the plugin's fast paths), its expert weights initialised by their global expert index as the plugin's.

Prints a table and writes ``bench/results/runtime_overhead_pp<pp>_tp<tp>_dp<dp>[_modern][_cuda]_mcore<version>.json``
(the megatron-core release in the name: run it under each supported stack, e.g. ``.venv312/bin/python`` for 0.19):
median step times, their ratio (median over paired steps of stock / plugin; target >= 0.95 on CPU, >= 0.99 on a GPU) and the
losses of every step (must agree).

    python bench/runtime_overhead.py [--pp 2] [--tp 1] [--dp 1] [--modern] [--steps 6] [--device cuda]
    python bench/runtime_overhead.py --pp 1 --dp 2 --ep 2        # the MoE row (EP 2)
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

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)

from aceso_megatron.testing import make_batches, spawn
from aceso_megatron.training.engine import TrainConfig
from search.spec.model import ModelSpec
from search.layers.moe_spec import MoESpec

MODEL = ModelSpec(name="bench-gpt", family="gpt", num_layers=4, hidden_size=256, num_attention_heads=8,
                  ffn_hidden_size=1024, seq_length=128, vocab_size=1024, params_dtype="fp32")
MOE_MODEL = ModelSpec.model_validate({**MODEL.model_dump(), "name": "bench-gpt-moe", "add_bias_linear": False,
                                      "moe": MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=512)})
SEED = 3
PER_RANK_MB, NUM_MB = 4, 4
BUCKET = 200_000  # --modern: DDP bucket size (parameters), several buckets per stage so reductions overlap


def uniform_plan(pp: int, tp: int, dp: int, modern: bool, model: ModelSpec, ep: int = 0, te: bool = False) -> dict:
    units = model.num_units // pp
    stages = [{"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": modern and tp > 1,
               "start_unit": i * units, "end_unit": (i + 1) * units, "recompute": ["none"] * units,
               **({"ep": ep} if ep else {})} for i in range(pp)]
    features = {"distributed_optimizer": True, "overlap_grad_reduce": True,
                "overlap_param_gather": True} if modern else {}
    if ep:
        # TE's grouped GEMM and fused permute where importable (as stock's flags), else the plugin would refuse it
        features["moe"] = {"token_dispatcher": "alltoall", "grouped_gemm": te, "permute_fusion": te}
    return {"model": model.model_dump(), "micro_batch_size": PER_RANK_MB * dp,
            "global_batch_size": PER_RANK_MB * dp * NUM_MB, "stages": stages, **features}


def _stock_spec(model: ModelSpec, fast, sp: bool, config=None):
    """The layer spec Megatron-LM would use: TE's when importable, else the local one (SP: flagged torch norms);
    an MoE model: megatron-core's decoder block spec (``MoELayer`` layers)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if model.moe is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        norm = "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm"
        return get_gpt_decoder_block_spec(config, use_transformer_engine=fast.te, normalization=norm)
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from aceso_megatron.model.norms import SequenceParallelNorm, with_sequence_parallel_norms
    from model_specs.builders import gpt_layer_spec

    layer = gpt_layer_spec(model, te=fast.te)
    if not sp or fast.te:
        return layer
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[with_sequence_parallel_norms(layer)] * (model.num_layers // _pp()),
        layer_norm=SequenceParallelNorm))


def _pp() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def _moe_fields(model: ModelSpec, ep: int, device: str, fast) -> dict:
    """The MoE fields Megatron-LM sets from its flags (--expert-model-parallel-size, --moe-token-dispatcher-type,
    --moe-grouped-gemm and --moe-permute-fusion where transformer-engine has them)."""
    if model.moe is None:
        return {}
    te = device != "cpu" and fast.te
    return {"expert_model_parallel_size": ep, "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": te,
            "moe_permute_fusion": te}


def build_stock(model: ModelSpec, pp: int, tp: int, modern: bool, tc: TrainConfig, device: str, fast, ep: int = 0):
    """GPTModel chunk of this rank, the usual way (parallel_state), with the plugin's initial weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from aceso_megatron.model.config import stage_config
    from aceso_megatron.model.init import initialize
    from aceso_megatron.model.moe import global_expert_name
    from aceso_megatron.model.stage_model import local_layer_name

    if device == "cpu":
        from patches import cpu_mode

        cpu_mode.apply()
    if model.moe is not None:
        from patches import moe_router_without_te

        moe_router_without_te.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=max(ep, 1))
    model_parallel_cuda_manual_seed(SEED)
    config = stage_config(model, tp, device, sequence_parallel=modern, fast=fast,
                          moe=_moe_fields(model, ep, device, fast))
    config.pipeline_model_parallel_size = pp
    gpt = GPTModel(config=config, transformer_layer_spec=_stock_spec(model, fast, config.sequence_parallel, config),
                   vocab_size=model.padded_vocab_size, max_sequence_length=model.seq_length,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=model.tied_embeddings)
    offset = get_transformer_layer_offset(config)
    names = {}
    for n, _ in gpt.named_parameters():
        if n.startswith("decoder.layers."):
            i, rest = n[len("decoder.layers."):].split(".", 1)
            names[n] = f"decoder.layers.{int(i) + offset}.{local_layer_name(rest)}"
            if model.moe is not None:   # this EP rank's local experts by their global index, as the plugin's
                names[n] = global_expert_name(names[n], ps.get_expert_model_parallel_rank(),
                                              model.moe.num_experts // ep)
        elif n == "output_layer.weight" and model.tied_embeddings:
            names[n] = "embedding.word_embeddings.weight"
        else:
            names[n] = n
    initialize(gpt, names, model, SEED, tp, ps.get_tensor_model_parallel_rank(), tc.std_for(model))
    if device != "cpu":
        gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=modern, overlap_param_gather=modern,
                                               use_distributed_optimizer=modern, bucket_size=BUCKET if modern else None,
                                               grad_reduce_in_fp32=fast.dtype != "fp32")
    ddp = DistributedDataParallel(config, ddp_config, gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
        adam_beta2=tc.adam_beta2, clip_grad=tc.clip_grad, params_dtype=config.params_dtype, bf16=config.bf16,
        use_distributed_optimizer=modern, overlap_param_gather=modern), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    if modern:  # as Megatron-LM's training loop sets it for overlapped gradient reduction
        config.no_sync_func = ddp.no_sync
    return ddp, opt


def stock_step(model: ModelSpec, ddp, opt, batches, device: str) -> float:
    """One step; ``batches``: this rank's DP share. Returns the global mean per-token loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    ddp.zero_grad_buffer()
    opt.zero_grad()

    def step(it, m):
        b = {k: v.to(device) for k, v in next(it).items()}
        pos = torch.arange(model.seq_length, device=device).unsqueeze(0).expand_as(b["tokens"])
        out = m(b["tokens"], pos, None, labels=b["labels"])
        return out, lambda t: (t.sum(), torch.tensor(t.numel(), dtype=torch.int), {"sum": t.sum().detach()})

    store = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
        seq_length=model.seq_length, micro_batch_size=batches[0]["tokens"].size(0))
    opt.step()
    mine = sum(float(d["sum"]) for d in store) if (ps.is_pipeline_last_stage() and
                                                    ps.get_tensor_model_parallel_rank() == 0) else 0.0
    total = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    tokens = len(batches) * batches[0]["tokens"].numel() * ps.get_data_parallel_world_size()
    return float(total) / tokens


def worker(rank: int, world: int, pp: int, tp: int, dp: int, modern: bool, steps: int, device: str,
           out: str, ep: int = 0) -> None:
    from megatron.core import parallel_state as ps

    from aceso_megatron.model.fast_path import Environment, choose
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.teardown import release

    model = MOE_MODEL if ep else MODEL
    model = model if device == "cpu" else model.model_copy(update={"params_dtype": "bf16"})
    fast = choose(Environment.detect(device), model)
    raw = uniform_plan(pp, tp, dp, modern, model, ep, te=device != "cpu" and fast.te)
    tc = TrainConfig(clip_grad=1.0, ddp_bucket_size=BUCKET if modern else None)
    ddp, opt = build_stock(model, pp, tp, modern, tc, device, fast, ep)  # first: parallel_state wants its buffer
    rt = build_runtime(raw, rank, world, seed=SEED, device=device, train_config=tc)
    batches = make_batches(model, raw["micro_batch_size"], raw["global_batch_size"], seed=SEED)
    j = ps.get_data_parallel_rank()
    mine = [{k: v[j * PER_RANK_MB:(j + 1) * PER_RANK_MB] for k, v in b.items()} for b in batches]
    times = {"plugin": [], "stock": []}
    losses = {"plugin": [], "stock": []}
    for i in range(steps):
        for side in (("plugin", "stock") if i % 2 == 0 else ("stock", "plugin")):
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = rt.train_step(iter(batches)) if side == "plugin" else stock_step(model, ddp, opt, mine, device)
            if device != "cpu":
                torch.cuda.synchronize()
            dist.barrier()
            times[side].append(time.perf_counter() - t)
            losses[side].append(loss)
    release(rt)   # the plugin's hooks, model, buffers and optimizer (teardown); spawn then destroys the groups
    if rank == 0:
        torch.save({"times": times, "losses": losses}, out)


def main(argv=None) -> int:
    p = AcesoParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--modern", action="store_true", help="sequence parallel + distributed optimizer, both overlaps")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ep", type=int, default=0, help="the MoE model with its experts over EP ranks (0: dense)")
    args = p.parse_args(argv)
    if args.modern and args.tp < 2:
        p.error("--modern needs --tp >= 2 (sequence parallelism)")
    if args.ep and (args.modern or args.tp * args.dp % args.ep or MOE_MODEL.moe.num_experts % args.ep):
        p.error(f"--ep {args.ep}: must divide tp x dp ({args.tp * args.dp}) and the 4 experts, without --modern "
                "(the runtime's MoE stages refuse the distributed optimizer)")
    out = tempfile.mktemp(suffix=".pt")
    spawn(args.pp * args.tp * args.dp, worker, args.pp, args.tp, args.dp, args.modern, args.steps, args.device, out,
          args.ep, backend="gloo" if args.device == "cpu" else "nccl")
    res = torch.load(out)
    t_plugin = statistics.median(res["times"]["plugin"][1:])  # first step warms up
    t_stock = statistics.median(res["times"]["stock"][1:])
    # median of paired ratios: each plugin step is paired with the stock step right after it (load drifts cancel)
    ratio = statistics.median(s / p for p, s in zip(res["times"]["plugin"][1:], res["times"]["stock"][1:]))
    max_diff = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["plugin"], res["losses"]["stock"]))
    target = 0.95 if args.device == "cpu" else 0.99
    what = "SP + distributed optimizer, both overlaps" if args.modern else "no SP, plain DDP"
    model = MOE_MODEL if args.ep else MODEL
    if args.ep:
        what += f", MoE {model.moe.num_experts} experts top-{model.moe.moe_router_topk} over ep={args.ep}, alltoall"
    from patches.compat import version as megatron_version

    versions = f"Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron_version()}"
    print(versions)
    print(f"uniform plan: pp={args.pp} tp={args.tp} dp={args.dp} ({what}) on {args.device}, model {model.name} "
          f"(h={model.hidden_size}, {model.num_layers} layers, seq {model.seq_length}), {NUM_MB} micro-batches of "
          f"{PER_RANK_MB} per rank")
    print(f"{'side':8} {'median step (s)':>16} {'losses':>40}")
    for side in ("plugin", "stock"):
        ls = " ".join(f"{x:.6f}" for x in res["losses"][side][:4])
        print(f"{side:8} {statistics.median(res['times'][side][1:]):16.4f} {ls:>40}")
    print(f"step-time ratio stock/plugin = {ratio:.3f} (target >= {target}) {'PASS' if ratio >= target else 'FAIL'}; "
          f"max relative loss difference {max_diff:.2e}")
    result = {"pp": args.pp, "tp": args.tp, "dp": args.dp, "modern": args.modern, "device": args.device,
              "ep": args.ep, "steps": args.steps, "model": model.model_dump(), "times": res["times"],
              "losses": res["losses"], "passed": ratio >= target,
              "median_plugin_s": t_plugin, "median_stock_s": t_stock, "ratio": ratio, "max_rel_loss_diff": max_diff,
              "target_ratio": target, "python": sys.version.split()[0], "torch": torch.__version__,
              "megatron_core": megatron_version()}
    tag = f"pp{args.pp}_tp{args.tp}_dp{args.dp}" + ("_modern" if args.modern else "") + \
        (f"_ep{args.ep}" if args.ep else "") + ("_cuda" if args.device == "cuda" else "") + \
        f"_mcore{megatron_version()}"
    path = ROOT / "bench" / "results" / f"runtime_overhead_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
