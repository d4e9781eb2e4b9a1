#!/usr/bin/env bash
# One-command GPU check of the NCCL and NVSHMEM paths on one GPU, in under 5 minutes, installing nothing:
# an NVML dump of what the box shows (links, fabric, error counters, field values), the NCCL backend at world
# size 1 (commbench run, and commbench suite --quick under torchrun), an NVSHMEM set-up compile, then the
# NVSHMEM backend with one PE (puts to itself) on deepseek-v3 with verification: default knobs, wait=nvshmem,
# signal_op=set, --cuda-graph (when this checkout has it), the torch all_to_all_vdev_2d reference variant (on
# mixtral-8x22b), and the device-to-device copy bandwidth as the ceiling of the loopback put kernel (target
# >= 85 %). Meant to be the one call of a device session: `bash benchmarks/gpu_check.sh` within a 10-minute
# command limit, every step's figure or error kept whatever fails.
#
#   bash benchmarks/gpu_check.sh [--quick] [--tokens N] [--loopback-tokens N]
#
# Uses the machine's python3 (or $PYTHON) with the repository on PYTHONPATH: it needs torch >= 2.9 (CUDA
# build with NVSHMEM), triton, nvidia-nvshmem, numpy, pandas, click, pyarrow, matplotlib, pyyaml,
# nvidia-ml-py. Every step runs in its own process with its own timeout, and the result files are rewritten
# after every step, so an NVSHMEM abort or segfault costs only its own step (recorded with its exit code or
# signal and last stderr lines). Writes gpu_check.json, gpu_check.csv, gpu_check.log, cli_runs.log,
# nvml.json and measurements.md (6 files) under $OUT (default ./gpu_check_out); the CLI report folders go to
# a temporary folder. Copy measurements.md into docs/measurements.md.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-./gpu_check_out}"
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Keep well inside 5 minutes even if a step hangs (each step has its own timeout as well; on SIGTERM the
# check records the step it was in and writes its files before it exits).
timeout --signal=TERM --kill-after=10 285 "${PYTHON:-python3}" "$repo/benchmarks/gpu_check.py" --out "$out" "$@" \
  2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
