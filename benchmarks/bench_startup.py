"""Where a small launch's wall time goes: the smallest `commbench run` and `commbench simulate --ranks 8192`,
each line of their output timed from the command's start, beside `import torch` alone (the floor).

    python benchmarks/bench_startup.py [--runs 3] [--world-size 4] [--out bench_startup.md]

Targets (issue 23, a quiet 2-core host): the 1 KiB 4-rank run under 8 s wall, `simulate --ranks 8192` under
2 s. The commands run as a user starts them (the `commbench` console script next to this interpreter, or
``python -m commbench``), one after another, the run's report in a temporary folder. A step's time is when its
line appeared: the launcher's "backend" line (interpreter, CLI, torch, inputs), the "preflight" line (ranks
forked, imported, rendezvous, layout, preflight), the case's progress line (the one call), the verdict line
(rank 0's report and the table), then the exit. Each cell is the median over ``--runs`` with the range; the
host's 1-minute load is read before every command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOALS_S = {"run": 8.0, "simulate": 2.0}
# (step, a text its line starts with) in the order the run prints them
RUN_STEPS = (
    ("backend line", "commbench run: backend"),
    ("preflight line", "commbench: preflight"),
    ("the case's progress line", "[1/1]"),
    ("verdict line", "commbench verdict"),
)


def commbench_command() -> list[str]:
    """The console script beside this interpreter where installed, else ``python -m commbench``."""
    script = Path(sys.executable).with_name("commbench")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "commbench"]


def timed_lines(command: list[str]) -> tuple[list[tuple[float, str]], float, int]:
    """Run ``command``; every output line (stdout and stderr together) with the seconds since the start, the
    wall time to its exit, and its exit status."""
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert process.stdout is not None
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in process.stdout]
    code = process.wait()
    return lines, time.monotonic() - start, code


def step_times(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Each RUN_STEPS step's time: its first line's."""
    found: dict[str, float] = {}
    for step, prefix in RUN_STEPS:
        found[step] = next((t for t, text in lines if text.lstrip().startswith(prefix)), float("nan"))
    return found


def _cell(values: list[float]) -> str:
    good = [v for v in values if v == v]
    if not good:
        return "n/a"
    return f"{statistics.median(good):.2f} ({min(good):.2f}-{max(good):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args()
    commbench = commbench_command()
    steps: dict[str, list[float]] = {step: [] for step, _ in RUN_STEPS}
    walls: dict[str, list[float]] = {"import torch": [], "run": [], "simulate": []}
    loads: list[float] = []
    folder = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        for index in range(args.runs):
            loads.append(os.getloadavg()[0])
            walls["import torch"].append(timed_lines([sys.executable, "-c", "import torch"])[1])
            out = folder / f"run{index}"
            run = [*commbench, "run", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "1K"]
            run += ["--iters", "1", "--warmup", "0", "--world-size", str(args.world_size), "--out", str(out)]
            loads.append(os.getloadavg()[0])
            lines, wall, code = timed_lines(run)
            if code != 0:
                output = "\n".join(text for _, text in lines)
                raise SystemExit(f"bench_startup: {' '.join(run)} exited {code}:\n{output}")
            for step, value in step_times(lines).items():
                steps[step].append(value)
            walls["run"].append(wall)
            loads.append(os.getloadavg()[0])
            walls["simulate"].append(timed_lines([*commbench, "simulate", "--ranks", "8192"])[1])
            simulate = walls["simulate"][-1]
            print(f"run {index + 1}: run {wall:.2f} s, simulate {simulate:.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines_out = [
        f"{args.world_size} gloo ranks, {args.runs} runs, {os.cpu_count()} CPUs, "
        f"load {min(loads):.1f}-{max(loads):.1f}; seconds from the command's start, median (range)",
        "",
        "| step of `commbench run --pattern balanced --min-bytes 1K --max-bytes 1K --iters 1 --warmup 0` "
        "| s |",
        "|---|---:|",
        *(f"| {step} | {_cell(values)} |" for step, values in steps.items()),
        f"| **exit (wall)**, goal < {GOALS_S['run']:g} s | **{_cell(walls['run'])}** |",
        "",
        "| whole command | wall (s) |",
        "|---|---:|",
        f"| `commbench simulate --ranks 8192`, goal < {GOALS_S['simulate']:g} s "
        f"| {_cell(walls['simulate'])} |",
        f"| `python -c 'import torch'` (the floor of both) | {_cell(walls['import torch'])} |",
    ]
    text = "\n".join(lines_out) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
