#!/usr/bin/env bash
# The GPU checks, as one prepared script (results under $OUT if set, else bench/results/gpu-validate/):
#  1. profile -> predict -> measure: profile a GPT-1.3B-like model on this GPU, run eight 1-GPU plans (recompute
#     none/selective/full/attn_dropout x micro-batch 1 and 2) for 10 steps each with `aceso train`, and print the
#     profile cost model's prediction error (targets: time <= 3 %, memory <= 5 %) -- bench/gpu/validate.py;
#  2. the GPU test tier: fused fast paths (transformer-engine, fusions) vs the same plan unfused over 5 steps, a
#     fused checkpoint resumed unfused, context parallel vs data parallel (2 GPUs + TE), CUDA training vs CPU,
#     an FP8 (Blackwell: MXFP8) plan's 3 steps against bf16, bf16 first/last layers (TE; test_lowprec_gpu.py),
#     MoE grouped experts (TEGroupedMLP) and, with DeepEP, the flex dispatcher against SequentialMLP, an MLA + MoE
#     model on TE's linears (test_moe_gpu.py), a hybrid Mamba-2 / attention / MoE / MLP plan (megatron-core >= 0.19:
#     one stage, or the pattern cut inside at tp 1 | tp 1 on 2 GPUs, SP tp 2 | tp 1 on 3) against CPU
#     (test_hybrid_gpu.py) (tests/gpu);
#  3. runtime overhead on the GPU (target ratio stock/plugin >= 0.99): a 1-GPU uniform plan; with >= 2 GPUs also
#     the sequence-parallel + distributed-optimizer-overlap plan (tp 2, and dp 2 with >= 4 GPUs); the MoE plan
#     (--ep: experts over EP 2 with >= 2 GPUs, the MoE model at ep 1 on one GPU).
# Needs torch with CUDA and megatron-core (pip install -e ".[runtime]", or a CUDA torch + megatron-core); the
# repository itself is put on PYTHONPATH, so no install (and no network) is needed for it.
# Extra arguments go to bench/gpu/validate.py (e.g. --steps 20, --dry-run, --cpu --tiny); with --dry-run or --cpu
# only step 1 runs. VALIDATE_SKIP_PROFILE=1 skips step 1.
# PYTHON names the interpreter (default: python on PATH; the tests pass their own).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
"$PY" - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "megatron.core") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"validate.sh: missing {', '.join(missing)}; pip install -e '.[runtime]' (or a CUDA torch + megatron-core)")
PY
gpu=1
if [[ " $* " == *" --cpu "* || " $* " == *" --dry-run "* ]]; then gpu=0; fi
if [[ $gpu == 1 ]]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'validate.sh: no CUDA device (add --cpu --tiny to try the pipeline on CPU)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
export PYTHONWARNINGS=ignore
status=0
if [[ "${VALIDATE_SKIP_PROFILE:-0}" != 1 ]]; then
  "$PY" bench/gpu/validate.py "$@" || status=$?
fi
if [[ $gpu == 1 ]]; then
  out="${OUT:-bench/results/gpu-validate}"
  mkdir -p "$out"
  "$PY" -m pytest -q -p no:warnings tests/gpu 2>&1 | tee "$out/gpu-tests.txt" || status=1
  n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  runs=("--pp 1 --tp 1 --dp 1")
  if (( n >= 4 )); then runs+=("--pp 1 --tp 2 --dp 2 --modern"); elif (( n >= 2 )); then runs+=("--pp 1 --tp 2 --dp 1 --modern"); fi
  runs+=("--pp 1 --tp 1 --dp $(( n >= 2 ? 2 : 1 )) --ep $(( n >= 2 ? 2 : 1 ))")   # MoE: EP 2 (ep 1 on one GPU)
  for r in "${runs[@]}"; do
    # shellcheck disable=SC2086
    "$PY" bench/runtime_overhead.py --device cuda --steps 12 $r 2>&1 | tee -a "$out/runtime-overhead.txt" || status=1
  done
  cp bench/results/runtime_overhead_*_cuda.json "$out/" 2>/dev/null || true
fi
exit $status
