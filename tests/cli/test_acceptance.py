"""The acceptance verdict end to end on gloo: a CPU run's bandwidth SKIPped and its data and completion
PASS, an injected slow rank named and confirmed (FAIL, exit 1), wrong data (exit 3), bad limits refused
before launch, a baseline judged, and the verdict files (verdict.json, junit.xml) and the console's last
line. The runs are the session's shared launches (tests/launches.py) where one serves."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.report.judge.verdict import read_verdict_json
from commbench.run.config_meta import meta_values
from tests.launches import (
    BALANCED,
    SLOW_RANK,
    SLOW_RANK_US,
    Launch,
    commbench,
    copy_of,
    launch,
    not_failed_by_data_or_completion,
)


def invoke(args: list[str]):
    return CliRunner().invoke(cli, [str(arg) for arg in args])


def last_line_of(result) -> str:
    return result.stdout.strip().splitlines()[-1]


def check_junit(out: Path) -> ElementTree.Element:
    root = ElementTree.parse(out / "junit.xml").getroot()
    assert root.tag == "testsuites"
    assert all(suite.tag == "testsuite" and len(suite) >= 1 for suite in root)
    return root


def test_cpu_run_skips_bandwidth_and_passes_its_data_and_completion(balanced_run: Launch) -> None:
    out, verdict = balanced_run.out, balanced_run.verdict()
    status = verdict.status  # PASS on a quiet host; a busy one's straggler may make it FAIL (spread only)
    not_failed_by_data_or_completion(verdict)
    assert balanced_run.last_line().startswith(f"commbench verdict: {status}")
    assert str(out) in balanced_run.last_line()
    assert verdict.exit_code == balanced_run.returncode and verdict.spec_name is None
    statuses = {(e.group, e.status) for e in verdict.elements}
    assert ("balanced", "SKIP") in statuses
    check_junit(out)
    summary = (out / "summary.md").read_text()
    # Opens with the verdict; the conventions close it; a CPU run shows no %spec.
    assert (
        summary.index(f"## Verdict: {status}") < summary.index("## Results") < summary.index("## Conventions")
    )
    assert "CPU run" in summary and "%spec" not in summary.split("## Results")[1].split("## Environment")[0]
    html = (out / "report.html").read_text()
    assert (
        html.index(f"Verdict: {status}") < html.index("<h2>Results</h2>") < html.index("<h2>Conventions</h2>")
    )


def test_an_injected_slow_rank_is_named_confirmed_and_fails(slow_rank_run: Launch) -> None:
    out = slow_rank_run.out
    assert slow_rank_run.last_line().startswith("commbench verdict: FAIL")
    verdict = slow_rank_run.verdict()
    failed = [e for e in verdict.elements if e.status == "FAIL"]
    assert failed and all(e.group == "spread" for e in failed)
    assert {e.name.rsplit(" rank ", 1)[1] for e in failed} == {str(SLOW_RANK)}  # exactly that rank
    assert all("flagged again in 2 of 2 reruns" in e.message for e in failed)
    assert f"rank {SLOW_RANK} (host " in verdict.reason
    junit = check_junit(out)
    failures = junit.findall(".//failure")
    assert len(failures) == len(failed)
    meta = json.loads((out / "meta.json").read_text())
    planted = [{"src": SLOW_RANK, "dst": None, "seconds": SLOW_RANK_US / 1e6}]
    assert meta_values(meta)["inject_delay"] == planted  # the fault is on record


def test_wrong_data_fails_with_exit_3_and_a_data_element(corrupt_run: Launch) -> None:
    assert corrupt_run.last_line().startswith("commbench verdict: FAIL")
    verdict = corrupt_run.verdict()
    assert verdict.exit_code == 3
    assert any(e.group == "data" and e.status == "FAIL" for e in verdict.elements)
    check_junit(corrupt_run.out)


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
    result = invoke(args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.output
    assert not out.exists()


def test_a_limit_override_changes_the_rule(tmp_path: Path) -> None:
    """No reruns: a flag fails at once, and verdict.json records the override."""
    args = [*BALANCED, "--inject-delay", f"2:{SLOW_RANK_US}", "--limit", "spread.confirm_reruns=0"]
    run = launch(args, tmp_path, codes=(1,))
    verdict = json.loads((run.out / "verdict.json").read_text())
    assert verdict["limits"]["values"]["spread.confirm_reruns"] == 0
    assert "--limit spread.confirm_reruns=0" in verdict["limits"]["source"]
    assert any("not rerun" in e["message"] for e in verdict["elements"] if e["status"] == "FAIL")


def test_baseline_cases_are_judged(balanced_run: Launch, tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.json"
    made = invoke(["baseline", balanced_run.out, "--out", baseline])
    assert made.exit_code == 0, made.output
    second = launch([*BALANCED, "--baseline", str(baseline)], tmp_path, "second", codes=(0, 1))
    judged = [e for e in second.verdict().elements if e.group == "baseline"]  # noise may move a case
    assert len(judged) == 3 and all(e.status in ("PASS", "WARN", "FAIL") for e in judged)


def test_report_rerenders_the_saved_verdict_and_never_rewrites_it(
    balanced_run: Launch, tmp_path: Path
) -> None:
    out = copy_of(balanced_run, tmp_path / "run")
    status = read_verdict_json(out / "verdict.json").status
    before = {name: (out / name).read_bytes() for name in ("verdict.json", "junit.xml")}
    again = invoke(["report", out])
    assert again.exit_code == 0, again.output
    assert {name: (out / name).read_bytes() for name in before} == before  # never rewritten
    assert f"## Verdict: {status}" in (out / "summary.md").read_text()
    assert last_line_of(again).startswith(f"commbench verdict: {status}")
    # No verdict.json and no INCOMPLETE mark: a run killed whole (nothing could write its end); the
    # report says so and judges what is there now (tests/cli/test_stops.py covers the real kill).
    (out / "verdict.json").unlink()
    again = invoke(["report", out])
    assert again.exit_code == 0, again.output
    assert "INCOMPLETE: the run ended without finishing its report" in (out / "summary.md").read_text()
    assert read_verdict_json(out / "verdict.json").status in ("INCOMPLETE", "FAIL", "WARN")


def test_report_of_a_stopped_run_says_incomplete(tmp_path: Path) -> None:
    """A rank that dies mid-run (SIGKILL through the test hook of the liveness tests is not needed: a
    timeout is enough) leaves verdict.json FAIL or INCOMPLETE and `commbench report` says so last."""
    run = launch([*BALANCED, "--inject-delay", "1:3000000", "--timeout", "1"], tmp_path, codes=(4,))
    assert run.last_line().startswith("commbench verdict: FAIL")
    verdict = run.verdict()
    assert verdict.run.state in ("timed_out", "rank_died") and verdict.exit_code == 4
    check_junit(run.out)
    again = invoke(["report", run.out])
    assert "INCOMPLETE" in again.stdout and last_line_of(again).startswith("commbench verdict: FAIL")


def _interrupt_after(out: Path, kept_rows: int) -> list[str]:
    """The folder as a run stopped after ``kept_rows`` result rows leaves it (what SIGINT leaves is checked
    in tests/run/test_signals.py): rows cut, meta.json INCOMPLETE. Returns the kept CSV lines."""
    from commbench.report import mark_incomplete

    for name, per_row in (("results.csv", 1), ("ranks.csv", 4)):
        lines = (out / name).read_text().splitlines(keepends=True)
        (out / name).write_text("".join(lines[: 1 + kept_rows * per_row]))
    mark_incomplete(out, "stopped by SIGINT")
    return (out / "results.csv").read_text().splitlines()


def test_resume_runs_only_what_is_left_and_keeps_the_finished_rows(
    balanced_run: Launch, tmp_path: Path
) -> None:
    out = copy_of(balanced_run, tmp_path / "run")
    kept = _interrupt_after(out, 2)
    result = commbench([*BALANCED, "--resume", str(out)], tmp_path)
    assert result.returncode in (0, 1), result.stderr[-2000:]  # 1: a busy host's straggler (see below)
    assert "1 cases" in result.stderr and "[1/1] balanced alltoall: size 16384 B" in result.stderr
    lines = (out / "results.csv").read_text().splitlines()
    assert lines[: len(kept)] == kept and len(lines) == len(kept) + 1  # finished rows untouched, one added
    meta = json.loads((out / "meta.json").read_text())
    assert "status" not in meta and meta["resumed"][0]["rows_kept"] == 2
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    again = invoke([*BALANCED, "--resume", out])
    assert again.exit_code == 2 and "that run finished" in again.stderr


def test_resume_with_other_options_is_refused(balanced_run: Launch, tmp_path: Path) -> None:
    out = copy_of(balanced_run, tmp_path / "run")
    _interrupt_after(out, 1)
    before = (out / "results.csv").read_bytes()
    result = invoke([*BALANCED, "--iters", "6", "--resume", out])
    assert result.exit_code == 2 and "iters" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (out / "results.csv").read_bytes() == before


def test_resume_of_a_folder_written_before_an_option_existed_is_refused(
    balanced_run: Launch, tmp_path: Path
) -> None:
    out = copy_of(balanced_run, tmp_path / "run")
    _interrupt_after(out, 1)
    meta = json.loads((out / "meta.json").read_text())
    del meta["config"]["harness"]["blocking"]  # as a folder of the version before --blocking
    (out / "meta.json").write_text(json.dumps(meta))
    before = (out / "results.csv").read_bytes()
    result = invoke([*BALANCED, "--resume", out])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "written before the option 'blocking' existed; run it again with --out" in result.stderr
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
