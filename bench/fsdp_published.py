"""The Megatron-FSDP rows of Megatron-Bridge's published tables (25.09, 25.11): their memory lines and throughput.

Every such row (``fsdp`` > 0 in ../shared/published/megatron-bridge-25.09-25.11.json: Llama 3 8B on 8 H100s, 70B on 64
GB200 / GB300, 3.1 405B on 128 GB200) trains in FP8 (tensorwise current scaling) with ``--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads_params --fp8-param-gather`` and, on the Blackwell racks,
``--cpu-offloading-num-layers``. The row's own Megatron-LM arguments are imported and priced with their recipe
(bench/megatron_memory.py ``bridge_cases``, through bench/lowprec_published.py's one row path). Printed per row: the
memory per GPU (its FSDP buffers, the activations left after the offload) against the GPU, whether it fits, the
predicted tokens/s per GPU beside the published one. Writes bench/results/fsdp_published.json.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.pricing import make_cost_model  # noqa: E402
from search.costmodel.memory import DEFAULT_HEADROOM, memory_budget_mb  # noqa: E402

BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"


def _memory_bench():
    spec = importlib.util.spec_from_file_location("megatron_memory_bench", ROOT / "bench" / "megatron_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def published_tokens(row_id: str) -> float | None:
    for r in json.loads(BRIDGE.read_text())["rows"]:
        if f"bridge-{r['version']}-{r['system'].lower()}-{r['model']}-{r['precision']}" == row_id:
            return r["tokens_per_s_per_gpu"]
    return None


def _is_fsdp_row(row_id: str) -> bool:
    return any(f"bridge-{r['version']}-{r['system']}-{r['model']}-{r['precision']}" == row_id and r.get("fsdp")
               for r in json.loads(BRIDGE.read_text())["rows"])


def rows() -> list[dict]:
    if not BRIDGE.exists():
        return []
    out = []
    for case in _memory_bench().bridge_cases(BRIDGE):
        if "skipped" in case:
            if "gb300" in case["id"].lower() and _is_fsdp_row(case["id"]):
                out.append({"id": case["id"].lower(), "waits": "the GB300 preset (lowprec branch): "
                            + case["skipped"].split(":")[0]})
            continue
        plan = case["plan"]
        if plan.megatron_fsdp is None:
            continue
        cm = make_cost_model(plan.model, plan.cluster, case["training"], settings=case["settings"])
        c = cm.evaluate(plan)
        st = c.stages[0]
        tokens = plan.global_batch_size * plan.model.seq_length / (c.iteration_ms / 1e3) / plan.world_size
        budget = memory_budget_mb(c.memory_limit_mb, DEFAULT_HEADROOM)
        out.append({"id": case["id"], "gpus": plan.world_size, "strategy": plan.megatron_fsdp.data_parallel_sharding_strategy,
                    "offload_layers": plan.activation_offload.num_layers if plan.activation_offload else 0,
                    "memory_gib": c.max_memory_mb / 1024, "limit_gib": c.memory_limit_mb / 1024,
                    "fits": c.fits, "within_headroom": c.max_memory_mb <= budget,
                    "breakdown_gib": {k: round(v / 1024, 2) for k, v in st.memory_breakdown.items()},
                    "predicted_tokens_per_s_per_gpu": tokens,
                    "published_tokens_per_s_per_gpu": published_tokens(case["id"]),
                    "comm_ms": {k: [round(a, 1), round(b, 1)] for k, (a, b) in st.comm.items()}})
    return out


def main() -> int:
    rs = rows()
    if not rs:
        print(f"no rows: {BRIDGE} is absent")
        return 0
    print(f"{'row':48} {'GPUs':>4} {'offl':>4} {'mem GiB':>8} {'of':>6} {'fits':>4} {'fsdp buf':>8} {'act':>6} "
          f"{'pred tok/s':>10} {'pub':>8} {'error':>7}  (fits: the GPU; 3%: within aceso's 3% headroom)")
    for r in rs:
        if "memory_gib" not in r:
            print(f"{r['id']:48}  {r['waits']}")
            continue
        bd, pub = r["breakdown_gib"], r["published_tokens_per_s_per_gpu"] or 0
        err = f"{100 * (r['predicted_tokens_per_s_per_gpu'] / pub - 1):+6.1f}%" if pub else ""
        print(f"{r['id']:48} {r['gpus']:>4} {r['offload_layers']:>4} {r['memory_gib']:>8.1f} {r['limit_gib']:>6.1f} "
              f"{'yes' if r['fits'] else 'NO':>4}{'' if r['within_headroom'] else ' (not 3%)'} "
              f"{bd.get('fsdp_buffers', 0):>8.2f} {bd['activations']:>6.1f} "
              f"{r['predicted_tokens_per_s_per_gpu']:>10.0f} {pub:>8.0f} {err:>7}")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "fsdp_published.json").write_text(json.dumps({"rows": rs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
