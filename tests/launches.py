"""The shared launches of the slow end-to-end tests: the command lines of the few real multi-rank gloo runs of
the CLI that many tests read (each started once per pytest session by a fixture of tests/conftest.py), and
helpers to start ``commbench`` as a process and judge what its verdict says without trusting a busy host's
timings.

A launch is a report folder: tests that change it work on ``copy_of(launch, ...)``. A planted fault is large
beside the noise of ranks sharing two busy cores (a few ms), so that finding it is not a matter of luck; a
run without one is never asserted to PASS its timing checks (a loaded host makes real stragglers), only to
pass its data, completion and harness checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (tests/conftest.py imports this module: every session, so it stays light)
    from commbench.report.judge.verdict import Verdict

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Verdict groups judged on measured times (a busy host can flag them); the others judge data and completion.
TIMING_GROUPS = frozenset({"balanced", "moe", "spread", "pairwise", "soak", "baseline"})

# Small and quick: 4 gloo ranks, three balanced sizes (1, 4, 16 KiB), a few iterations.
BALANCED = [
    "run", "--pattern", "balanced", "--world-size", "4", "--backend", "gloo", "--min-bytes", "1K",
    "--max-bytes", "16K", "--step-factor", "4", "--warmup", "1", "--iters", "5",
]  # fmt: skip
BALANCED_SIZES = [1024, 4096, 16384]
SLOW_RANK, SLOW_RANK_US = 3, 20000  # --inject-delay 3:20000: 20 ms before each timed call of rank 3

# The pairwise link test on 4 gloo ranks with one slow direction planted (20 ms before each of its sends).
PAIRWISE = ["run", "--pattern", "pairwise", "--world-size", "4", "--backend", "gloo", "--warmup", "1"]
PAIRWISE += ["--iters", "5", "--pair-bytes", "256K"]
SLOW_PAIR, PAIR_DELAY = "1->2", "1-2:20000"

# hidden 64, BF16: 128-byte rows (a multiple of 16, so nccl-tests moves exactly the pattern's bytes).
SMALL_MODEL = "name: small\nhidden: 64\nnum_experts: 8\ntopk: 2\ndispatch_dtype: bf16\n"


@dataclass(frozen=True)
class Launch:
    """A finished ``commbench`` process: its report folder, exit code and output, and the folder it ran in."""

    out: Path
    returncode: int
    stdout: str
    stderr: str
    cwd: Path

    def last_line(self) -> str:
        return self.stdout.strip().splitlines()[-1]

    def verdict(self) -> Verdict:
        from commbench.report.judge.verdict import read_verdict_json

        return read_verdict_json(self.out / "verdict.json")


def commbench(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m commbench <args>`` in ``cwd`` as a user starts it: outside torchrun, no debug traceback."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and k != "COMMBENCH_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "commbench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def launch(args: list[str], root: Path, name: str = "run", codes: Iterable[int] = (0,)) -> Launch:
    """Run ``commbench <args> --out root/name`` in ``root``; its exit code must be one of ``codes``."""
    out = root / name
    done = commbench([*args, "--out", str(out)], root)
    codes = tuple(codes)
    assert done.returncode in codes, (done.returncode, codes, done.stderr[-3000:])
    return Launch(out, done.returncode, done.stdout, done.stderr, root)


def copy_of(run: Launch, to: Path) -> Path:
    """A copy of the launch's report folder, for a test that changes it."""
    return Path(shutil.copytree(run.out, to))


def not_failed_by_data_or_completion(verdict: Verdict, rows_checked: bool = True) -> None:
    """The run finished with right data: no check outside the timing groups FAILs or WARNs, the completion
    check PASSes and, where the run has result rows (``rows_checked``; the pairwise test checks its bytes in
    pairs.csv), the data check too. The timing checks may flag a straggler of a busy host."""
    untimed = [e for e in verdict.elements if e.group not in TIMING_GROUPS]
    assert not [e for e in untimed if e.status in ("FAIL", "WARN")], untimed
    statuses = {(e.group, e.status) for e in untimed}
    assert ("run", "PASS") in statuses and (("data", "PASS") in statuses or not rows_checked), statuses
    assert verdict.exit_code in (0, 1) and verdict.run.state == "complete", (verdict.exit_code, verdict.run)
