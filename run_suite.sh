#!/usr/bin/env bash
# Set up (first use) and run the default commbench suite into one report folder.
#   - GPUs present: one process per local GPU, launched with `python -m torch.distributed.run` (the torchrun of
#     the torch in use, not whatever `torchrun` is on PATH), NCCL backend; `--standalone` on one node.
#   - No GPU: 4 local processes on gloo (CPU). The figures then measure this host's memory and loopback,
#     not a GPU fabric; the report says so.
#   - Several nodes with torchrun: run this script once on every node with the same variables:
#       NNODES         number of nodes (> 1 selects this mode)
#       MASTER_ADDR    the host of the rendezvous (one of the nodes); MASTER_PORT its port (default 29500)
#       RDZV_ENDPOINT  host:port of the rendezvous instead (default $MASTER_ADDR:${MASTER_PORT:-29500})
#       RDZV_ID        the job's rendezvous id, the same on every node (default $SLURM_JOB_ID, else commbench)
#       NODE_RANK      this node's rank 0..NNODES-1 (optional). torchrun honours it only with its static
#                      rendezvous, so giving it selects that (RDZV_BACKEND=static); without it the c10d
#                      rendezvous numbers the nodes itself
#       RDZV_BACKEND   c10d (default) or static
#     Each node starts one rank per local GPU (4 gloo ranks on a node without GPUs).
#     Under srun with one task per node (`srun --ntasks-per-node=1 ./run_suite.sh`) set NNODES and
#     MASTER_ADDR (the first host of the job) for every task: this mode wins over the next one.
#   - Under srun, one task per GPU (SLURM_STEP_ID set, SLURM_NTASKS > 1, NNODES unset): each task is one
#     rank and runs `python -m commbench suite` directly; commbench reads Slurm's variables (docs/usage.md,
#     "Multi-node"). Set up once before srun (`. tools/bootstrap.sh` in the batch script): tasks never
#     create .venv.
# Extra arguments go to `commbench suite` (see `commbench suite --help`), e.g. --out DIR, --tokens N, --quick.
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${NNODES:-}" ] && [ -n "${SLURM_STEP_ID:-}" ] && [ "${SLURM_NTASKS:-1}" -gt 1 ]; then
  if [ ! -x "${COMMBENCH_VENV:-.venv}/bin/python" ]; then
    echo "[run_suite] under srun: set up once first (\`. tools/bootstrap.sh\` in the batch script," \
      "before srun)" >&2
    exit 2
  fi
  if [ "${SLURM_PROCID:-0}" = 0 ]; then
    . tools/bootstrap.sh
  else
    . tools/bootstrap.sh 2>/dev/null  # the set-up line once, from task 0
  fi
  exec python -m commbench suite "$@"
fi

. tools/bootstrap.sh

gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nnodes=${NNODES:-1}
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
  echo "[run_suite] NNODES must be a whole number >= 1, got '$nnodes'" >&2
  exit 2
fi
if [ "$nnodes" -gt 1 ]; then
  if [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ]; then
    echo "[run_suite] NNODES=$nnodes needs MASTER_ADDR (or RDZV_ENDPOINT): the host of the rendezvous" >&2
    exit 2
  fi
  endpoint=${RDZV_ENDPOINT:-$MASTER_ADDR:${MASTER_PORT:-29500}}
  rdzv_backend=${RDZV_BACKEND:-$([ -n "${NODE_RANK:-}" ] && echo static || echo c10d)}
  node_rank=()
  if [ -n "${NODE_RANK:-}" ]; then
    node_rank=(--node-rank "$NODE_RANK")
  fi
  if [ "$gpus" -gt 0 ]; then
    procs=$gpus
    backend=nccl
  else
    procs=4
    backend=gloo
  fi
  echo "[run_suite] one of $nnodes nodes: $procs $backend rank(s) here," \
    "$rdzv_backend rendezvous at $endpoint" >&2
  exec python -m torch.distributed.run --nnodes "$nnodes" --nproc-per-node "$procs" \
    --rdzv-backend "$rdzv_backend" --rdzv-endpoint "$endpoint" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-commbench}}" \
    ${node_rank[@]+"${node_rank[@]}"} -m commbench suite --backend "$backend" "$@"
fi

if [ "$gpus" -gt 0 ]; then
  echo "[run_suite] $gpus GPU(s) found: $gpus processes under torch.distributed.run, NCCL backend" >&2
  exec python -m torch.distributed.run --standalone --nproc-per-node="$gpus" -m commbench suite --backend nccl "$@"
else
  echo "[run_suite] no GPU found: running on 4 gloo ranks (CPU processes on this host); not GPU figures" >&2
  exec python -m commbench suite --world-size 4 --backend gloo "$@"
fi
