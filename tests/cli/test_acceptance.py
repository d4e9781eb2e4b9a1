"""The acceptance verdict end to end on gloo: PASS with CPU-run SKIPs, an injected slow rank named and
confirmed (FAIL, exit 1), wrong data (exit 3), bad limits refused before launch, a baseline judged, and the
verdict files (verdict.json, junit.xml) and the console's last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from commbench.report.judge.verdict import read_verdict_json
from commbench.run.config import meta_values

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Small and quick: 4 gloo ranks, three balanced sizes, a few iterations.
BALANCED = [
    "run", "--pattern", "balanced", "--world-size", "4", "--backend", "gloo", "--min-bytes", "1K",
    "--max-bytes", "16K", "--step-factor", "4", "--warmup", "1", "--iters", "5",
]  # fmt: skip


def commbench(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and k != "COMMBENCH_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "commbench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def check_junit(out: Path) -> ElementTree.Element:
    root = ElementTree.parse(out / "junit.xml").getroot()
    assert root.tag == "testsuites"
    assert all(suite.tag == "testsuite" and len(suite) >= 1 for suite in root)
    return root


def test_cpu_run_passes_with_bandwidth_skipped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = commbench([*BALANCED, "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert last_line(result).startswith("commbench verdict: PASS") and str(out) in last_line(result)
    verdict = read_verdict_json(out / "verdict.json")
    assert verdict.status == "PASS" and verdict.exit_code == 0 and verdict.spec_name is None
    statuses = {(e.group, e.status) for e in verdict.elements}
    assert ("balanced", "SKIP") in statuses and ("data", "PASS") in statuses and ("run", "PASS") in statuses
    assert not any(e.status in ("FAIL", "WARN") for e in verdict.elements)
    check_junit(out)
    summary = (out / "summary.md").read_text()
    # Opens with the verdict; the conventions close it; a CPU run shows no %spec.
    assert summary.index("## Verdict: PASS") < summary.index("## Results") < summary.index("## Conventions")
    assert "CPU run" in summary and "%spec" not in summary.split("## Results")[1].split("## Environment")[0]
    html = (out / "report.html").read_text()
    assert html.index("Verdict: PASS") < html.index("<h2>Results</h2>") < html.index("<h2>Conventions</h2>")


@pytest.mark.parametrize("slow_rank", [1, 3])
def test_an_injected_slow_rank_is_named_confirmed_and_fails(tmp_path: Path, slow_rank: int) -> None:
    out = tmp_path / "run"
    result = commbench([*BALANCED, "--inject-delay", f"{slow_rank}:4000", "--out", str(out)], tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert last_line(result).startswith("commbench verdict: FAIL")
    verdict = read_verdict_json(out / "verdict.json")
    failed = [e for e in verdict.elements if e.status == "FAIL"]
    assert failed and all(e.group == "spread" for e in failed)
    assert {e.name.rsplit(" rank ", 1)[1] for e in failed} == {str(slow_rank)}  # exactly that rank
    assert all("flagged again in 2 of 2 reruns" in e.message for e in failed)
    assert f"rank {slow_rank} (host " in verdict.reason
    junit = check_junit(out)
    failures = junit.findall(".//failure")
    assert len(failures) == len(failed)
    meta = json.loads((out / "meta.json").read_text())
    assert meta_values(meta)["inject_delay"] == [
        {"src": slow_rank, "dst": None, "seconds": 0.004}
    ]  # the planted fault is on record


def test_wrong_data_fails_with_exit_3_and_a_data_element(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = commbench([*BALANCED, "--corrupt", "dispatch", "--out", str(out)], tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert last_line(result).startswith("commbench verdict: FAIL")
    verdict = read_verdict_json(out / "verdict.json")
    assert verdict.exit_code == 3
    assert any(e.group == "data" and e.status == "FAIL" for e in verdict.elements)
    check_junit(out)


@pytest.mark.parametrize(
    ("limits_text", "option", "fragment"),
    [
        ("spread:\n  k_mads: -1\n", None, "k_mads"),
        ("spread: [1, 2\n", None, "limits file"),
        (None, "spread.no_such_key=1", "no_such_key"),
        (None, "spread.k_mads=abc", "k_mads"),
    ],
)
def test_bad_limits_are_refused_before_launch(
    tmp_path: Path, limits_text: str | None, option: str | None, fragment: str
) -> None:
    out = tmp_path / "run"
    args = [*BALANCED, "--out", str(out)]
    if limits_text is not None:
        (tmp_path / "limits.yaml").write_text(limits_text)
        args += ["--limits", str(tmp_path / "limits.yaml")]
    if option is not None:
        args += ["--limit", option]
    result = commbench(args, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.stderr
    assert not out.exists()


def test_a_limit_override_changes_the_rule(tmp_path: Path) -> None:
    """No reruns: a flag fails at once, and verdict.json records the override."""
    out = tmp_path / "run"
    args = [*BALANCED, "--inject-delay", "2:4000", "--limit", "spread.confirm_reruns=0", "--out", str(out)]
    result = commbench(args, tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["limits"]["values"]["spread.confirm_reruns"] == 0
    assert "--limit spread.confirm_reruns=0" in verdict["limits"]["source"]
    assert any("not rerun" in e["message"] for e in verdict["elements"] if e["status"] == "FAIL")


def test_baseline_cases_are_judged(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert commbench([*BALANCED, "--out", str(first)], tmp_path).returncode == 0
    baseline = tmp_path / "baseline.json"
    made = commbench(["baseline", str(first), "--out", str(baseline)], tmp_path)
    assert made.returncode == 0, made.stderr
    out = tmp_path / "second"
    result = commbench([*BALANCED, "--baseline", str(baseline), "--out", str(out)], tmp_path)
    assert result.returncode in (0, 1), result.stderr[-2000:]  # noise on this host may move a case
    verdict = read_verdict_json(out / "verdict.json")
    judged = [e for e in verdict.elements if e.group == "baseline"]
    assert len(judged) == 3 and all(e.status in ("PASS", "WARN", "FAIL") for e in judged)


def test_report_rerenders_the_saved_verdict_and_never_rewrites_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert commbench([*BALANCED, "--out", str(out)], tmp_path).returncode == 0
    before = {name: (out / name).read_bytes() for name in ("verdict.json", "junit.xml")}
    again = commbench(["report", str(out)], tmp_path)
    assert again.returncode == 0
    assert {name: (out / name).read_bytes() for name in before} == before  # never rewritten
    assert "## Verdict: PASS" in (out / "summary.md").read_text()
    assert last_line(again).startswith("commbench verdict: PASS")
    (out / "verdict.json").unlink()
    again = commbench(["report", str(out)], tmp_path)
    assert again.returncode == 0 and "## Verdict: none" in (out / "summary.md").read_text()


def test_report_of_a_stopped_run_says_incomplete(tmp_path: Path) -> None:
    """A rank that dies mid-run (SIGKILL through the test hook of the liveness tests is not needed: a
    timeout is enough) leaves verdict.json FAIL or INCOMPLETE and `commbench report` says so last."""
    out = tmp_path / "run"
    args = [*BALANCED, "--inject-delay", "1:3000000", "--timeout", "1", "--out", str(out)]
    result = commbench(args, tmp_path)
    assert result.returncode == 4, result.stderr[-2000:]
    assert last_line(result).startswith("commbench verdict: FAIL")
    verdict = read_verdict_json(out / "verdict.json")
    assert verdict.run.state in ("timed_out", "rank_died") and verdict.exit_code == 4
    check_junit(out)
    again = commbench(["report", str(out)], tmp_path)
    assert "INCOMPLETE" in again.stdout and last_line(again).startswith("commbench verdict: FAIL")


def _interrupt_after(out: Path, kept_rows: int) -> list[str]:
    """The folder as a run stopped after ``kept_rows`` result rows leaves it (what SIGINT leaves is checked
    in tests/run/test_signals.py): rows cut, meta.json INCOMPLETE. Returns the kept CSV lines."""
    from commbench.report import mark_incomplete

    for name, per_row in (("results.csv", 1), ("ranks.csv", 4)):
        lines = (out / name).read_text().splitlines(keepends=True)
        (out / name).write_text("".join(lines[: 1 + kept_rows * per_row]))
    mark_incomplete(out, "stopped by SIGINT")
    return (out / "results.csv").read_text().splitlines()


def test_resume_runs_only_what_is_left_and_keeps_the_finished_rows(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert commbench([*BALANCED, "--out", str(out)], tmp_path).returncode == 0
    kept = _interrupt_after(out, 2)
    result = commbench([*BALANCED, "--resume", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 cases" in result.stderr and "[1/1] balanced alltoall: size 16384 B" in result.stderr
    lines = (out / "results.csv").read_text().splitlines()
    assert lines[: len(kept)] == kept and len(lines) == len(kept) + 1  # finished rows untouched, one added
    meta = json.loads((out / "meta.json").read_text())
    assert "status" not in meta and meta["resumed"][0]["rows_kept"] == 2
    assert read_verdict_json(out / "verdict.json").status == "PASS"
    again = commbench([*BALANCED, "--resume", str(out)], tmp_path)
    assert again.returncode == 2 and "that run finished" in again.stderr


def test_resume_with_other_options_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert commbench([*BALANCED, "--out", str(out)], tmp_path).returncode == 0
    _interrupt_after(out, 1)
    before = (out / "results.csv").read_bytes()
    result = commbench([*BALANCED, "--iters", "6", "--resume", str(out)], tmp_path)
    assert (
        result.returncode == 2 and "iters" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    )
    assert (out / "results.csv").read_bytes() == before


def test_a_flagged_case_is_rerun_by_its_case_and_repeat() -> None:
    """The reruns are found by ``Case.repeat_key``: only the flagged size of the flagged repeat, its job cut
    to that size; a knob setting or a repeat is part of the case."""
    from commbench.cli.acceptance import _rerun_jobs, arrival_spreads
    from commbench.inputs.limits import load_limits
    from commbench.run.jobs import BalancedJob

    jobs = [BalancedJob("balanced", [1024, 4096]), BalancedJob("balanced", [1024, 4096], repeat=1)]
    rank_rows = [
        {
            "pattern": "balanced", "phase": "alltoall", "size_bytes": size, "repeat": index, "rank": rank,
            "knobs": {"algo": "ring"}, "job_index": index,
            "arrival_us_p50": 10.0 + rank % 2 + (5000.0 if (index, size, rank) == (1, 4096, 3) else 0.0),
        }
        for index in (0, 1) for size in (1024, 4096) for rank in range(8)
    ]  # fmt: skip
    spreads = arrival_spreads(rank_rows, load_limits("cpu"))
    assert [spread.case for spread in spreads] == [
        "balanced 1 KiB [algo=ring]", "balanced 4 KiB [algo=ring]",
        "balanced 1 KiB [algo=ring] repeat 1", "balanced 4 KiB [algo=ring] repeat 1",
    ]  # fmt: skip
    flagged = {spread.key for spread in spreads if spread.flags}
    assert [spread.case for spread in spreads if spread.flags] == ["balanced 4 KiB [algo=ring] repeat 1"]
    reruns = _rerun_jobs(jobs, rank_rows, flagged)
    assert [(job.repeat, job.sizes) for job in reruns] == [(1, [4096])]
