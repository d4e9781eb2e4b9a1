"""The pairwise link test on this host: how long it takes, how often it flags a healthy pair (false flags),
whether it finds exactly an injected slow direction, and what it would take on a 72-GPU rack.

    python benchmarks/bench_pairwise.py [--runs 10] [--delay-us 20000] [--world-size 4]

Each run is a real ``commbench run --pattern pairwise`` on gloo (spawned ranks, the suite's default warm-up
and iterations). A false flag is any pairwise element naming a pair (FAIL or WARN) in a run without
injection; a detection is a run whose flagged pairs are exactly the injected direction (all three tests).
The 72-GPU figure is a prediction from the schedule (71 rounds x 5 windows), the spec's NVLink bandwidth per
direction at an assumed efficiency and an assumed per-window overhead: stated, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from commbench.inputs.limits import load_limits
from commbench.inputs.specs import load_spec
from commbench.run.declare import DEFAULT_ITERS, DEFAULT_WARMUP
from commbench.run.pairwise import PairwiseJob, round_robin_rounds, windows

DONE = re.compile(r"pairwise link test done in ([0-9.]+) s")


def pairwise(out: Path, world: int, extra: list[str]) -> tuple[int, dict, float, float]:
    """(exit code, verdict, the test's own seconds, wall seconds of the command)."""
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = [
        "run",
        "--pattern",
        "pairwise",
        "--world-size",
        str(world),
        "--backend",
        "gloo",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "commbench", *args, *extra], env=env, capture_output=True, text=True
    )
    verdict = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").is_file() else {}
    match = DONE.search(done.stderr)
    return (
        done.returncode,
        verdict,
        float(match.group(1)) if match else float("nan"),
        time.monotonic() - started,
    )


def flagged(verdict: dict) -> set[str]:
    return {
        e["name"] for e in verdict.get("elements", []) if e["group"] == "pairwise" and "->" in e["name"]
        and e["status"] in ("FAIL", "WARN")
    }  # fmt: skip


def predicted_rack_seconds(
    ranks: int = 72, efficiency: float = 0.8, overhead_us: float = 200.0, setup_ms: float = 100.0
) -> str:
    """The schedule's time on a GB300 NVL72 rack: messages x (size / bandwidth) + a per-window overhead + a
    connection set-up per round (NCCL connects a pair's point-to-point channels at its first message)."""
    spec = load_spec("gb300-nvl72")
    rule = load_limits("gb300-nvl72").pairwise
    job = PairwiseJob(rule.bandwidth_bytes, rule.latency_bytes, min(DEFAULT_WARMUP, 5), DEFAULT_ITERS)
    GBps = spec.nvlink_GBps_per_direction * efficiency
    latency_us = 15.0  # one small NCCL p2p message issued from Python, an assumption
    per_round = 0.0
    for window in windows(job):
        message_us = latency_us if window.test == "latency" else window.size_bytes / (GBps * 1e3)
        messages = job.warmup + job.repeats * job.iters
        per_round += messages * message_us + (job.repeats + 1) * overhead_us
    per_round += setup_ms * 1e3
    rounds = len(round_robin_rounds(ranks))
    total = rounds * per_round / 1e6
    return (
        f"{ranks} GPUs: {rounds} rounds x {per_round / 1e3:.0f} ms = {total:.0f} s (assumed: "
        f"{efficiency:g} x {spec.nvlink_GBps_per_direction:g} GB/s per direction, {latency_us:g} us per "
        f"small message, {overhead_us:g} us per barrier and window, {setup_ms:g} ms to connect a new pair; "
        f"{job.bandwidth_bytes >> 20} MiB "
        "messages, "
        f"{job.warmup} warm-up + {job.repeats} x {job.iters} timed per window), plus the reruns of flagged "
        "pairs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--delay-us", type=float, default=20000.0)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pairwise-") as tmp:
        root = Path(tmp)
        false_runs, seconds, walls = 0, [], []
        for index in range(args.runs):
            _, verdict, spent, wall = pairwise(root / f"clean{index}", args.world_size, [])
            false_runs += bool(flagged(verdict))
            seconds.append(spent)
            walls.append(wall)
        print(f"false flags: {false_runs} of {args.runs} runs without injection")
        print(f"pairwise test of {args.world_size} gloo ranks: {min(seconds):.2f}-{max(seconds):.2f} s "
              f"(command wall {min(walls):.1f}-{max(walls):.1f} s with start-up)")  # fmt: skip
        for src, dst in ((1, 2), (2, 1)):
            delay = f"{src}-{dst}:{args.delay_us:g}"
            code, verdict, _, _ = pairwise(
                root / f"inject{src}{dst}", args.world_size, ["--inject-delay", delay]
            )
            expected = {f"{test} nvlink {src}->{dst}" for test in ("latency", "bandwidth", "bidir")}
            found = flagged(verdict)
            print(f"--inject-delay {delay}: exit {code}, flagged {sorted(found)}; exactly that direction: "
                  f"{found == expected}")  # fmt: skip
    print("predicted: " + predicted_rack_seconds())


if __name__ == "__main__":
    main()
