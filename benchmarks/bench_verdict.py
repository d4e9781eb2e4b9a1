"""How often the verdict's slow-rank rule is wrong on this host: false flags of the quick suite without any
injected fault, and detections with ``--inject-delay RANK:US`` on each rank in turn.

    python benchmarks/bench_verdict.py [--runs 10] [--delay-us 5000] [--world-size 4]

Each run is a real ``commbench suite --quick`` on gloo (spawned ranks). A false flag is any spread element
that is not PASS/SKIP in a run without injection (a WARN "not reproduced" counts too: it is noise reaching
the report); a detection is a FAIL naming exactly the injected rank and no other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def suite(out: Path, world: int, extra: list[str]) -> tuple[int, dict, float]:
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ["suite", "--quick", "--world-size", str(world), "--backend", "gloo", "--out", str(out), *extra]
    done = subprocess.run([sys.executable, "-m", "commbench", *args], env=env, capture_output=True, text=True)
    verdict = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").is_file() else {}
    return done.returncode, verdict, time.monotonic() - started


def spread_findings(verdict: dict) -> list[dict]:
    elements = verdict.get("elements", [])
    return [e for e in elements if e["group"] == "spread" and e["status"] in ("WARN", "FAIL")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--delay-us", type=float, default=5000.0)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-verdict-") as tmp:
        root = Path(tmp)
        false_runs, walls = 0, []
        for index in range(args.runs):
            code, verdict, wall = suite(root / f"clean{index}", args.world_size, [])
            walls.append(wall)
            findings = spread_findings(verdict)
            false_runs += bool(findings)
            names = ", ".join(f"{e['name']} {e['status']}" for e in findings) or "none"
            status = verdict.get("status")
            print(f"clean run {index}: exit {code}, verdict {status}, flags: {names}, {wall:.0f} s")
        print(f"false flags: {false_runs} of {args.runs} runs without injection")
        detected = 0
        for rank in range(args.world_size):
            extra = ["--inject-delay", f"{rank}:{args.delay_us:g}"]
            code, verdict, wall = suite(root / f"inject{rank}", args.world_size, extra)
            failed = [e for e in spread_findings(verdict) if e["status"] == "FAIL"]
            ranks = {e["name"].rsplit(" rank ", 1)[1] for e in failed}
            hit = code == 1 and ranks == {str(rank)}
            detected += hit
            flagged = sorted(ranks)
            print(f"inject {args.delay_us:g} us on rank {rank}: exit {code}, flagged {flagged}, {wall:.0f} s")
        print(f"detections: {detected} of {args.world_size} (exactly the injected rank, FAIL, exit 1)")
        print(f"quick suite wall time without injection: min {min(walls):.0f} s, max {max(walls):.0f} s")


if __name__ == "__main__":
    main()
