#!/usr/bin/env bash
# Profile a GPT-1.3B-like model on this GPU, run eight 1-GPU plans (recompute none/selective/full/attn_dropout x
# micro-batch 1 and 2) for 10 steps each with `aceso train`, and print the profile cost model's prediction error
# (targets: time <= 3 %, memory <= 5 %). Results go to $OUT (if set) or bench/results/gpu-validate/.
# Needs torch with CUDA and megatron-core (pip install -e ".[runtime]", or a CUDA torch + megatron-core); the
# repository itself is put on PYTHONPATH, so no install (and no network) is needed for it.
# Extra arguments go to bench/gpu/validate.py (e.g. --steps 20, --dry-run, --cpu --tiny).
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
if [[ " $* " != *" --cpu "* && " $* " != *" --dry-run "* ]]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'validate.sh: no CUDA device (add --cpu --tiny to try the pipeline on CPU)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
export PYTHONWARNINGS=ignore
exec "$PY" bench/gpu/validate.py "$@"
