"""How often the verdict is wrong on this host: false FAILs (and flags) of the quick suite without any
injected fault, optionally with CPU-burning processes beside it, and detections of planted ``--inject-delay``
faults on a rank and on a pair direction.

    python benchmarks/bench_verdict.py [--runs 20] [--burners 2] [--delay-us 5000] [--pair-delay-us 20000]

Each run is a real ``commbench suite --quick`` on gloo (spawned ranks, the pairwise link test included). A
false FAIL is a verdict FAIL (exit 1) of a run without injection; a false flag is any timing element (spread,
pairwise, soak, baseline) that is not PASS/SKIP there (a WARN counts: it is noise reaching the report). A
detection is a FAIL naming exactly the planted rank (or pair direction) and no other, exit 1. The burners
(``--burners N``: N processes spinning on the CPU, like ``yes > /dev/null``) run for the whole benchmark.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMING_GROUPS = ("spread", "pairwise", "soak", "baseline")


def suite(out: Path, world: int, extra: list[str]) -> tuple[int, dict, float]:
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ["suite", "--quick", "--world-size", str(world), "--backend", "gloo", "--out", str(out), *extra]
    done = subprocess.run([sys.executable, "-m", "commbench", *args], env=env, capture_output=True, text=True)
    verdict = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").is_file() else {}
    return done.returncode, verdict, time.monotonic() - started


def findings(verdict: dict, statuses: tuple[str, ...] = ("WARN", "FAIL")) -> list[dict]:
    """The timing elements of a verdict with one of ``statuses`` (the pairwise #wrong is data, not timing)."""
    elements = verdict.get("elements", [])
    return [
        e
        for e in elements
        if e["group"] in TIMING_GROUPS and e["status"] in statuses and e["name"] != "pairwise #wrong"
    ]


def _burn() -> None:
    while True:
        pass


def loadavg() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside the runs")
    parser.add_argument("--delay-us", type=float, default=5000.0, help="--inject-delay RANK:US")
    parser.add_argument("--pair-delay-us", type=float, default=20000.0, help="--inject-delay SRC-DST:US")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    try:
        run_all(args)
    finally:
        for burner in burners:
            burner.terminate()


def run_all(args: argparse.Namespace) -> None:
    print(f"{args.runs} quick suites, {args.world_size} gloo ranks, {args.burners} CPU burner(s) beside them")
    with tempfile.TemporaryDirectory(prefix="bench-verdict-") as tmp:
        root = Path(tmp)
        false_fails = false_flags = 0
        walls = []
        for index in range(args.runs):
            code, verdict, wall = suite(root / f"clean{index}", args.world_size, [])
            walls.append(wall)
            found = findings(verdict)
            false_flags += bool(found)
            false_fails += code == 1 or verdict.get("status") == "FAIL"
            names = ", ".join(f"{e['name']} {e['status']}" for e in found) or "none"
            print(
                f"clean run {index}: exit {code}, verdict {verdict.get('status')}, flags: {names}, "
                f"{wall:.0f} s, load {loadavg()}",
                flush=True,
            )
        print(f"false FAILs: {false_fails} of {args.runs} runs without injection")
        print(f"runs with a timing flag (WARN or FAIL): {false_flags} of {args.runs}")
        planted = [(f"{rank}:{args.delay_us:g}", f"rank {rank}") for rank in range(args.world_size)]
        pairs = [(0, 1), (1, 2), (2, 1), (3, 0)]
        planted += [(f"{src}-{dst}:{args.pair_delay_us:g}", f"{src}->{dst}") for src, dst in pairs]
        detected = 0
        for delay, target in planted:
            code, verdict, wall = suite(
                root / f"inject{delay.split(':')[0]}", args.world_size, ["--inject-delay", delay]
            )
            failed = findings(verdict, ("FAIL",))
            hit = code == 1 and failed and all(e["name"].endswith(target) for e in failed)
            detected += bool(hit)
            named = sorted({e["name"] for e in failed})
            print(f"--inject-delay {delay}: exit {code}, FAIL elements {named}, {wall:.0f} s", flush=True)
        print(f"detections: {detected} of {len(planted)} (FAIL naming exactly the planted rank or direction)")
        print(f"quick suite wall time without injection: min {min(walls):.0f} s, max {max(walls):.0f} s")


if __name__ == "__main__":
    main()
