"""What --profile costs: the same balanced all-to-all timed with and without the profiler, side by side.

    python benchmarks/bench_profile.py [--rounds 3] [--size 64M] [--world-size 4] [--iters 10]

Each round runs ``commbench run --pattern balanced`` at one size with ``--timing iteration`` twice, without
and with ``--profile`` (in alternating order, so that drift of the host hits both), on gloo ranks; the
figure is the phase time p50 (results.csv ``time_us_p50``). The ratio profiled / unprofiled is printed per
round and as the median over rounds (goal: within 5% at 64 MiB).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def p50_us(out: Path, world: int, size: str, iters: int, profile: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = [
        "run",
        "--pattern",
        "balanced",
        "--world-size",
        str(world),
        "--backend",
        "gloo",
        "--min-bytes",
        size,
    ]
    args += [
        "--max-bytes",
        size,
        "--timing",
        "iteration",
        "--iters",
        str(iters),
        "--warmup",
        "2",
        "--out",
        str(out),
    ]
    args += ["--profile"] if profile else []
    done = subprocess.run([sys.executable, "-m", "commbench", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"commbench failed: {done.stderr[-500:]}")
    with (out / "results.csv").open() as handle:
        return float(next(csv.DictReader(handle))["time_us_p50"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="64M")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        for index in range(args.rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            times = {}
            for profile in order:
                out = Path(tmp) / f"r{index}-{'p' if profile else 'u'}"
                times[profile] = p50_us(out, args.world_size, args.size, args.iters, profile)
            ratios.append(times[True] / times[False])
            print(f"round {index}: unprofiled {times[False]:.0f} us, profiled {times[True]:.0f} us, "
                  f"ratio {ratios[-1]:.3f}")  # fmt: skip
    print(f"profiled / unprofiled phase time p50 at {args.size}, {args.world_size} gloo ranks: median ratio "
          f"{statistics.median(ratios):.3f} over {args.rounds} rounds")  # fmt: skip


if __name__ == "__main__":
    main()
