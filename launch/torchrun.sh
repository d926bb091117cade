#!/usr/bin/env bash
# Start `aceso train` with torchrun on this node (or one node of a multi-node job), after checking the plan.
#   launch/torchrun.sh PLAN [--nnodes N --node-rank R --master-addr A --master-port P] [--cpu] [--dry-run] -- TRAIN_ARGS
# A thin wrapper: everything is done by `aceso launch` (set ACESO to another command, e.g. "python -m search").
set -euo pipefail
exec ${ACESO:-aceso} launch "$@"
