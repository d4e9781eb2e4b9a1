#!/usr/bin/env bash
# Set up (first use) and run the default commbench suite into one report folder.
#   - GPUs present: one process per local GPU, launched with `python -m torch.distributed.run` (the torchrun of
#     the torch in use, not whatever `torchrun` is on PATH), NCCL backend.
#   - No GPU: 4 local processes on gloo (CPU). The figures then measure this host's memory and loopback,
#     not a GPU fabric; the report says so.
# Extra arguments go to `commbench suite` (see `commbench suite --help`), e.g. --out DIR, --tokens N, --quick.
set -euo pipefail
cd "$(dirname "$0")"
. tools/bootstrap.sh

gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 0 ]; then
  echo "[run_suite] $gpus GPU(s) found: $gpus processes under torch.distributed.run, NCCL backend" >&2
  exec python -m torch.distributed.run --standalone --nproc-per-node="$gpus" -m commbench suite --backend nccl "$@"
else
  echo "[run_suite] no GPU found: running on 4 gloo ranks (CPU processes on this host); not GPU figures" >&2
  exec python -m commbench suite --world-size 4 --backend gloo "$@"
fi
