"""A run against a baseline (PASS/WARN/FAIL, noise inside the run-to-run spread is no finding) and two runs
side by side (difference, beyond spread?, cases only in one run)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from commbench.report import ReportWriter, results_frame
from commbench.report.judge.baseline import build_baseline, read_run, read_runs
from commbench.report.judge.compare import (
    ELEMENT_FIELDS,
    WITHIN_SPREAD,
    compare_runs,
    compare_to_baseline,
    comparison_markdown,
    findings_markdown,
)
from tests.report.judge.test_baseline import HGX, make_folder
from tests.report.rows import balanced_row, skewed_rows

SIZE = 4096


def baseline_of(tmp_path: Path, *times: float) -> dict:
    folders = [make_folder(tmp_path, f"run{i}", t) for i, t in enumerate(times)]
    return build_baseline(read_runs(folders, known_good=True))


def slower(factor: float, base_us: float = 100.0) -> pd.DataFrame:
    """A results frame of the baseline's cases, every time ``factor`` x ``base_us`` (bandwidths derived)."""
    return results_frame(
        [balanced_row(4, s, base_us * factor) for s in (1024, SIZE)] + skewed_rows(base_us * factor)
    )


def finding_for(findings: list, size: int = SIZE):
    return next(f for f in findings if f.case.get("size_bytes") == size)


@pytest.fixture
def quiet(tmp_path: Path) -> dict:
    """Three known-good runs 1% apart: a spread of 3 x 1.4826 x 1% = 4.4%."""
    return baseline_of(tmp_path, 99.0, 100.0, 101.0)


@pytest.mark.parametrize(
    ("factor", "status"), [(1.20, "FAIL"), (1.07, "WARN"), (1.02, "PASS"), (0.80, "PASS")]
)
def test_thresholds_beyond_a_quiet_baseline(quiet: dict, factor: float, status: str) -> None:
    findings = compare_to_baseline(slower(factor), quiet)
    assert len(findings) == 4 and {f.status for f in findings} == {status}
    found = finding_for(findings)
    assert found.group == "baseline" and found.figure == "busbw_GBps" and found.unit == "GB/s"
    assert found.value == pytest.approx(found.baseline_median / factor)  # busbw scales as 1 / time
    assert found.difference_pct == pytest.approx(100 * (1 / factor - 1))
    assert found.spread_pct == pytest.approx(3 * 1.4826, rel=0.02)  # of busbw, ~1 / time
    assert found.beyond_spread is (factor > 1.02 + 0.04)
    assert found.note is None
    if status == "FAIL":
        assert found.limit == pytest.approx(found.baseline_median * 0.90)
        assert "16.7% below" in found.message and "more than 10% worse" in found.message
        assert found.remedy and "commbench compare" in found.remedy
    else:
        assert found.limit == pytest.approx(found.baseline_median * 0.95)
    if status == "PASS":
        assert found.remedy is None


def test_elements_drop_into_the_verdict(quiet: dict) -> None:
    found = finding_for(compare_to_baseline(slower(1.2), quiet))
    element = found.element()
    assert (
        tuple(element)
        == ELEMENT_FIELDS
        == ("group", "name", "status", "value", "limit", "unit", "message", "remedy")
    )
    assert element["name"] == "balanced 4 KiB busbw" and element["status"] == "FAIL"
    assert found.as_dict()["case"]["size_bytes"] == SIZE


def test_a_drop_inside_the_run_to_run_spread_is_pass_with_a_note(tmp_path: Path) -> None:
    noisy = baseline_of(tmp_path, 90.0, 100.0, 110.0)  # MAD 10%: spread 44%
    found = finding_for(compare_to_baseline(slower(1.2), noisy))
    assert found.status == "PASS" and found.beyond_spread is False
    assert found.note == WITHIN_SPREAD and WITHIN_SPREAD in found.message
    assert found.worse_pct == pytest.approx(100 * (1 - 1 / 1.2))
    quiet_enough = finding_for(compare_to_baseline(slower(1.02), noisy))
    assert (
        quiet_enough.status == "PASS" and quiet_enough.note is None
    )  # under the thresholds: nothing to note


def test_one_run_baseline_has_no_spread_thresholds_decide(tmp_path: Path) -> None:
    single = baseline_of(tmp_path, 100.0)
    found = finding_for(compare_to_baseline(slower(1.07), single))
    assert found.status == "WARN" and found.spread_pct is None and found.beyond_spread is None
    assert "spread unknown" in found.message


def test_thresholds_are_configurable(quiet: dict) -> None:
    assert finding_for(compare_to_baseline(slower(1.07), quiet, warn_pct=8, fail_pct=20)).status == "PASS"
    assert finding_for(compare_to_baseline(slower(1.20), quiet, warn_pct=8, fail_pct=20)).status == "WARN"
    with pytest.raises(ValueError):
        compare_to_baseline(slower(1.0), quiet, warn_pct=10, fail_pct=5)


def test_time_is_checked_where_no_link_bytes_move(tmp_path: Path) -> None:
    # One rank: everything stays on the GPU, busbw is 0; the time is compared instead (higher is worse).
    base = build_baseline(read_runs([make_folder(tmp_path, "one", 100.0)], True))
    for entry in base["cases"]:
        entry["figures"]["busbw_GBps"]["median"] = 0.0
    found = finding_for(compare_to_baseline(slower(1.2), base))
    assert found.figure == "time_us" and found.unit == "us" and found.status == "FAIL"
    assert found.difference_pct == pytest.approx(20.0) and "20.0% above" in found.message
    assert found.limit == pytest.approx(110.0)


def test_unmatched_cases_wrong_rows_and_raw_rows_are_skipped(quiet: dict) -> None:
    rows = [balanced_row(4, SIZE, 100.0, wrong=3), balanced_row(4, 8192, 100.0)]
    findings = compare_to_baseline(pd.DataFrame(rows), quiet)  # raw rows: bandwidths derived on the way
    by_name = {f.name: f for f in findings}
    assert by_name["balanced 4 KiB busbw"].status == "SKIP"
    assert "#wrong 3" in by_name["balanced 4 KiB busbw"].message
    assert "baseline has no such case" in by_name["balanced 8 KiB"].message
    missing = [f for f in findings if "did not measure" in f.message]
    assert len(missing) == 3 and {f.status for f in missing} == {"SKIP"}  # 1024 B, dispatch, combine
    table = findings_markdown(findings)
    assert table.splitlines()[0].startswith("| status") and "did not measure" in table


# ---------------------------------------------------------------------------------------------------------
# Two runs side by side


def test_compare_runs_iteration_spread_and_cases_in_one_run_only(tmp_path: Path) -> None:
    a = read_run(make_folder(tmp_path, "a", 100.0))  # iterations 90..120 us
    b = read_run(make_folder(tmp_path, "b", 130.0, extra={"knobs": "num_blocks=8"}))  # other knobs: no match
    c = read_run(make_folder(tmp_path, "c", 130.0))  # iterations 117..156: A's p50 outside, C's outside A's
    d = read_run(make_folder(tmp_path, "d", 110.0))  # inside A's iterations
    none = compare_runs(a, b)
    assert none["cases"] == [] and len(none["only_in_a"]) == 4 and len(none["only_in_b"]) == 4
    beyond = compare_runs(a, c)
    entry = next(e for e in beyond["cases"] if e["case"]["size_bytes"] == SIZE)
    assert entry["difference_pct"]["time_us"] == pytest.approx(30.0)
    assert entry["difference_pct"]["busbw_GBps"] == pytest.approx(100 * (1 / 1.3 - 1))
    assert entry["beyond_spread"] is True and entry["spread_basis"] == "iterations"
    inside = next(e for e in compare_runs(a, d)["cases"] if e["case"]["size_bytes"] == SIZE)
    assert inside["beyond_spread"] is False
    assert beyond["a"]["host"] == "host-a" and beyond["b"]["path"].endswith("c")
    text = comparison_markdown(beyond)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| pattern"))
    assert "A time(us)" in header and "busbw diff" in header and "beyond spread?" in header
    assert "| size(B)" in header and "knobs" not in header  # no knobs in any case: no column
    assert "run-to-run spread is unknown" in text and "+30.0%" in text and "yes (iterations)" in text


def test_compare_runs_with_repeats_and_window_timing(tmp_path: Path) -> None:
    def folder(name: str, times: list[float], timing: str | None = None):
        extra = {} if timing is None else {"timing": timing, "time_us_min": None, "time_us_p99": None}
        rows = [balanced_row(4, SIZE, t, repeat=i, **extra) for i, t in enumerate(times)]  # one per repeat
        if timing:
            rows = [{**r, "time_us_min": r["time_us_p50"], "time_us_p99": r["time_us_p50"]} for r in rows]
        ReportWriter(tmp_path / name, {"args": {}, "env": {}}, HGX).add(rows)
        return read_run(tmp_path / name)

    a, b = folder("a", [100.0, 101.0, 99.0]), folder("b", [103.0, 104.0, 102.0])
    entry = compare_runs(a, b)["cases"][0]
    assert entry["a"]["repeats"] == 3 and entry["spread_basis"] == "repeats"
    assert entry["beyond_spread"] is False  # 3% apart, each run's repeats spread 4.4%
    far = compare_runs(a, folder("c", [120.0, 121.0, 119.0]))["cases"][0]
    assert far["beyond_spread"] is True
    w1, w2 = folder("w1", [100.0], "window"), folder("w2", [150.0], "window")
    window = compare_runs(w1, w2)
    assert window["cases"][0]["spread_basis"] == "unknown" and window["cases"][0]["beyond_spread"] is None
    row = next(line for line in comparison_markdown(window).splitlines() if line.startswith("| balanced"))
    assert row.split("|")[-2].strip() == "unknown" and "| window" in row
