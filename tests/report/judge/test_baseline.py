"""Baselines: per-case median and robust spread over known-good folders; files written and read back checked;
bad folders and bad baseline files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.inputs.specs import load_spec
from commbench.report import ReportWriter, results_frame
from commbench.report.judge.baseline import (
    SCHEMA,
    baseline_cases,
    build_baseline,
    case_of,
    check_out_file,
    read_baseline,
    read_run,
    read_runs,
    robust_spread_pct,
    write_baseline,
)
from tests.report.rows import balanced_row, skewed_rows

HGX = load_spec("hgx-h100")
SIZES = (1024, 4096)


def make_folder(
    root: Path, name: str, time_us: float, *, wrong: int = 0, extra: dict[str, Any] | None = None
) -> Path:
    """A report folder as ReportWriter writes it: a balanced sweep at ``time_us`` per size and a skewed MoE
    job (dispatch at ``time_us``, combine at twice that)."""
    out = root / name
    meta = {
        "commbench_version": "0.1.0",
        "args": {"world_size": 4, "backend": "gloo"},
        "env": {"hostname": f"host-{name}", "versions": {"commbench": "0.1.0"}, "time_utc": "2026-01-01"},
        "command": f"commbench run --out {name}",
    }
    rows = [balanced_row(4, size, time_us, wrong=wrong, **(extra or {})) for size in SIZES]
    rows += skewed_rows(time_us, **(extra or {}))
    writer = ReportWriter(out, meta, HGX)
    writer.add(rows)
    return out


def one_line_error(excinfo: pytest.ExceptionInfo[UsageError], *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_median_and_robust_spread_over_runs_not_skewed_by_one_bad_run(tmp_path: Path) -> None:
    runs = read_runs(
        [make_folder(tmp_path, n, t) for n, t in (("a", 100.0), ("b", 104.0), ("c", 300.0))], True
    )
    made = build_baseline(runs)
    assert made["schema"] == SCHEMA
    assert [run["host"] for run in made["runs"]] == ["host-a", "host-b", "host-c"]
    assert {run["backend"] for run in made["runs"]} == {"gloo"} and made["runs"][0]["world_size"] == 4
    assert made["runs"][0]["commbench_version"] == "0.1.0" and made["runs"][0]["date"] == "2026-01-01"
    entry = next(e for e in made["cases"] if e["case"]["size_bytes"] == 4096)
    assert entry["runs"] == 3 and entry["repeats"] == 3
    time = entry["figures"]["time_us"]
    assert time["median"] == 104.0 and time["min"] == 100.0 and time["max"] == 300.0 and time["mad"] == 4.0
    assert time["spread_pct"] == pytest.approx(100 * 3 * 1.4826 * 4 / 104)  # the 300 us run barely widens it
    assert time["range_pct"] == pytest.approx(100 * 200 / 104)
    # busbw: the median of what results_frame derives for each run (never a formula of the test's own)
    derived = [results_frame([balanced_row(4, 4096, t)])["busbw_GBps"].iloc[0] for t in (100.0, 104.0, 300.0)]
    assert entry["figures"]["busbw_GBps"]["median"] == pytest.approx(float(np.median(derived)))
    assert entry["figures"]["busbw_GBps"]["median"] > float(np.mean(derived))  # a mean would be dragged down
    assert entry["iteration_spread"]["p99_over_p50_pct"] == pytest.approx(20.0)  # rows: p99 = 1.2 x p50
    assert entry["iteration_spread"]["p50_over_min_pct"] == pytest.approx(10.0)


def test_cases_balanced_by_size_moe_by_tokens_skew_and_knobs(tmp_path: Path) -> None:
    made = build_baseline(read_runs([make_folder(tmp_path, "a", 100.0)], True))
    labels = [entry["label"] for entry in made["cases"]]
    assert labels == [
        "balanced 1 KiB",
        "balanced 4 KiB",
        "toy dispatch skew hot:1:0.5 64 tok/rank",
        "toy combine skew hot:1:0.5 64 tok/rank",
    ]
    moe = made["cases"][2]
    assert moe["case"]["size_bytes"] is None and moe["size_bytes"] == [skewed_rows()[0]["size_bytes"]]
    assert moe["case"]["send_mode"] == "token" and moe["case"]["tokens_per_rank"] == 64
    one = made["cases"][0]["figures"]["time_us"]
    assert one["n"] == 1 and one["spread_pct"] is None  # one measurement: spread unknown, never 0
    # knobs, timing and check are part of the case; an MoE row's size is not
    base = balanced_row(4, 4096, 10.0)
    assert case_of({**base, "knobs": "num_blocks=8"}).key != case_of({**base, "knobs": ""}).key
    assert case_of({**base, "timing": "window"}).key != case_of(base).key
    moe_row = skewed_rows()[0]
    assert case_of(moe_row).key == case_of({**moe_row, "size_bytes": 1}).key
    assert case_of(moe_row).key == case_of({**moe_row, "repeat": 2}).key  # the same case in every repeat


def test_robust_spread() -> None:
    assert robust_spread_pct([100.0]) is None
    assert robust_spread_pct([0.0, 0.0]) is None
    assert robust_spread_pct([100.0, 100.0, 100.0]) == 0.0
    assert robust_spread_pct([99.0, 100.0, 101.0]) == pytest.approx(3 * 1.4826)


def test_written_atomically_and_read_back(tmp_path: Path) -> None:
    made = build_baseline(
        read_runs([make_folder(tmp_path, n, t) for n, t in (("a", 10.0), ("b", 11.0))], True)
    )
    out = check_out_file(tmp_path / "base.json", force=False)
    write_baseline(made, out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    again = read_baseline(out)
    assert again == json.loads(json.dumps(made))
    assert baseline_cases(again).keys() == baseline_cases(made).keys()
    with pytest.raises(UsageError) as excinfo:
        check_out_file(out, force=False)
    one_line_error(excinfo, "already exists", "--force")
    assert check_out_file(out, force=True) == out
    with pytest.raises(UsageError) as excinfo:
        check_out_file(tmp_path, force=True)
    one_line_error(excinfo, "is a folder")
    with pytest.raises(UsageError) as excinfo:
        check_out_file(tmp_path / "no" / "base.json", force=False)
    one_line_error(excinfo, "does not exist")


def test_known_good_refuses_incomplete_and_wrong_folders(tmp_path: Path) -> None:
    bad = make_folder(tmp_path, "wrong", 10.0, wrong=7)
    with pytest.raises(UsageError) as excinfo:
        read_run(bad, known_good=True)
    one_line_error(excinfo, "#wrong 14", "known-good")
    assert read_run(bad).wrong == 14  # compare may still read it
    stopped = make_folder(tmp_path, "stopped", 10.0)
    meta = json.loads((stopped / "meta.json").read_text())
    meta.update(status="incomplete", incomplete_reason="stopped by SIGTERM after 2 of 4 cases")
    (stopped / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError) as excinfo:
        read_run(stopped, known_good=True)
    one_line_error(excinfo, "INCOMPLETE", "SIGTERM")


def test_bad_folders_are_refused_in_one_line(tmp_path: Path) -> None:
    good = make_folder(tmp_path, "good", 10.0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "missing", "not found"),
        (tmp_path / "file", "not a folder"),
        (tmp_path / "empty", "not a commbench report folder"),
    ]
    for path, fragment in cases:
        with pytest.raises(UsageError) as excinfo:
            read_run(path)
        one_line_error(excinfo, fragment)
    text = (good / "results.csv").read_text()
    (good / "results.csv").write_text(text[:-20])  # a cut last row
    with pytest.raises(UsageError) as excinfo:
        read_run(good)
    one_line_error(excinfo, "results.csv", "cut")
    other = make_folder(tmp_path, "other", 10.0)
    with pytest.raises(UsageError) as excinfo:
        read_runs([other, tmp_path / "other" / ".." / "other"], True)
    one_line_error(excinfo, "named twice")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"schema": "commbench.verdict/1", "runs": [], "cases": []}', "expected 'commbench.baseline/1'"),
        ('{"schema": "commbench.baseline/1", "runs": [], "cases": {}}', "cases must be a list"),
        (
            '{"schema": "commbench.baseline/1", "runs": [], "cases": '
            '[{"case": {"colour": "red"}, "figures": {}}]}',
            "case.colour",
        ),
        (
            '{"schema": "commbench.baseline/1", "runs": [], "cases": [{"case": {}, "figures": '
            '{"time_us": {"n": 1, "median": "fast"}}}]}',
            "median must be a finite number",
        ),
        (
            '{"schema": "commbench.baseline/1", "runs": [], "cases": [{"case": {}, "figures": '
            '{"time_us": {"n": -1, "median": 1.0}}}]}',
            "n must be a whole number",
        ),
        (  # a time below zero cannot have been measured
            '{"schema": "commbench.baseline/1", "runs": [], "cases": [{"case": {}, "figures": '
            '{"time_us": {"n": 2, "median": -5.0, "min": -6.0, "max": -4.0}}}]}',
            "median is -5, below 0",
        ),
        (
            '{"schema": "commbench.baseline/1", "runs": [], "cases": [{"case": {}, "figures": '
            '{"time_us": {"n": 2, "median": 5.0, "min": 9.0, "max": 4.0}}}]}',
            "min 9 <= median 5 <= max 4 does not hold",
        ),
    ],
)
def test_bad_baseline_files_are_refused_in_one_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "base.json"
    path.write_text(content)
    with pytest.raises(UsageError) as excinfo:
        read_baseline(path)
    one_line_error(excinfo, "base.json", fragment)
