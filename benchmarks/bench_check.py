"""What verifying every timed iteration costs: --check checksum (default) and --check every against no check.

    python benchmarks/bench_check.py [--world-size 4] [--tokens 512] [--size 4M] [--iters 20] [--rounds 5]

One launch of gloo ranks runs the same jobs (deepseek-v3 dispatch + combine, uniform routing, and a balanced
all-to-all of one size) under each mode, the modes interleaved round after round so that a busy machine
slows them alike: "off" (benchmark-only baseline: no poisoning, no verification), "checksum" and "every".

Printed per mode: the wall time of the whole run (median over rounds, and the range; routing and setup
included, the same in every mode) and its ratio to "off"; that extra wall time per timed iteration (it also
holds the one-time cost of building what each rank must receive); and each phase's timed p50 (median over
rounds) with its ratio to "off": the checks run outside the timer, so these must not move beyond noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from commbench.backends.torchdist import TorchDistBackend
from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.run.config import CHECK_OFF, RunOptions
from commbench.run.dist import launch
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.traffic.routing import RoutingConfig

MODES = (CHECK_OFF, "checksum", "every")


def entry(comm: Any, tokens: int, size: int, warmup: int, iters: int, rounds: int) -> dict[str, list]:
    """Every rank: ``rounds`` x each mode; rank 0's wall times and rows per mode."""
    cfg = RoutingConfig(load_model("deepseek-v3"), parse_skew("uniform"), comm.world_size, tokens)
    jobs = [
        MoeJob("deepseek-v3", cfg, "token", warmup=warmup, iters=iters),
        BalancedJob("balanced", [size], warmup=warmup, iters=iters, timing="iteration"),
    ]
    results: dict[str, list] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            comm.barrier()
            start = time.perf_counter()
            rows, _ = run_jobs(comm, jobs, RunOptions("gloo", check=mode), TorchDistBackend)
            comm.barrier()
            results[mode].append((time.perf_counter() - start, rows))
    return results


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="deepseek-v3 tokens per rank")
    parser.add_argument("--size", default="4M", help="balanced all-to-all bytes each rank sends (K/M = 1024)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = parse_size(args.size)
    results = launch(
        args.world_size,
        entry,
        (args.tokens, size, args.warmup, args.iters, args.rounds),
        process_group="gloo",
        timeout_s=600,
    )
    print(
        f"gloo, {args.world_size} ranks; deepseek-v3 uniform {args.tokens} tokens/rank (dispatch + combine) "
        f"and balanced {size} B; warm-up {args.warmup}, {args.iters} timed iterations per phase; "
        f"{args.rounds} rounds"
    )
    walls = {mode: sorted(seconds for seconds, _ in results[mode]) for mode in MODES}
    wall = {mode: statistics.median(walls[mode]) for mode in MODES}
    phases = [row["phase"] for row in results[CHECK_OFF][0][1]]
    p50 = {
        mode: [
            statistics.median(rows[i]["time_us_p50"] for _, rows in results[mode]) for i in range(len(phases))
        ]
        for mode in MODES
    }
    timed_iterations = len(phases) * args.iters
    header = f"{'check':>9} {'wall(s)':>8} {'(min-max)':>12} {'x off':>6} {'+ms/timed iter':>15}"
    print(header + "".join(f" {phase + ' p50(us)':>17} {'x off':>6}" for phase in phases))
    for mode in MODES:
        extra_ms = (wall[mode] - wall[CHECK_OFF]) / timed_iterations * 1e3
        spread = f"({walls[mode][0]:.2f}-{walls[mode][-1]:.2f})"
        line = (
            f"{mode:>9} {wall[mode]:8.2f} {spread:>12} {wall[mode] / wall[CHECK_OFF]:6.2f} {extra_ms:15.1f}"
        )
        for i in range(len(phases)):
            line += f" {p50[mode][i]:17.0f} {p50[mode][i] / p50[CHECK_OFF][i]:6.2f}"
        print(line)
    wrong = {mode: {row["wrong"] for _, rows in results[mode] for row in rows} for mode in MODES}
    print("#wrong seen: " + ", ".join(f"{mode} {sorted(wrong[mode], key=str)}" for mode in MODES))


if __name__ == "__main__":
    main()
