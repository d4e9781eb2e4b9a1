"""``commbench baseline`` and ``commbench compare`` on real gloo report folders: round trip, PASS/WARN/FAIL
with exit codes, Markdown and JSON, and bad input refused in one line (exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from tests.launches import launch
from tests.report.judge.test_baseline import make_folder

SIZES = [1024, 2048, 4096]
TIME_COLUMNS = ("time_us_min", "time_us_p50", "time_us_p99", "time_us_mean")


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two real 2-rank gloo runs of a small balanced sweep (a few seconds each, made once)."""
    root = tmp_path_factory.mktemp("runs")
    args = ["run", "--pattern", "balanced", "--world-size", "2", "--backend", "gloo"]
    args += ["--min-bytes", "1K", "--max-bytes", "4K", "--iters", "3", "--warmup", "1"]
    # Exit 1 allowed: a busy host's straggler flagged by the verdict (a timing check; baselines take it).
    return [launch(args, root, name, codes=(0, 1)).out for name in ("r1", "r2")]


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(arg) for arg in args])


def assert_refused(result, *fragments: str) -> str:
    """Exit 2, one stderr line 'commbench: error: ...', no traceback, nothing on stdout."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: "), result.stderr
    assert "Traceback" not in result.output and "unexpected" not in lines[0] and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def slowed_copy(run: Path, to: Path, factor: float, drop_last_row: bool = False) -> Path:
    """A copy of a report folder whose times are ``factor`` x slower (its saved GB/s left stale: every
    bandwidth is derived again when read)."""
    shutil.copytree(run, to)
    rows = pd.read_csv(to / "results.csv", keep_default_na=False, na_values=[""], dtype={"knobs": str})
    for column in TIME_COLUMNS:
        rows[column] = rows[column] * factor
    if drop_last_row:
        rows = rows.iloc[:-1]
    rows.to_csv(to / "results.csv", index=False, lineterminator="\n")
    return to


def test_baseline_and_compare_round_trip_on_real_runs(real_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "base.json"
    result = invoke("baseline", *real_runs, "--out", out)
    assert result.exit_code == 0, result.output
    assert f"baseline of 3 case(s) from 2 run(s) written to {out}" in result.stdout
    made = json.loads(out.read_text())
    assert made["schema"] == "commbench.baseline/1" and len(made["runs"]) == 2
    meta = json.loads((real_runs[0] / "meta.json").read_text())
    first = made["runs"][0]
    assert (
        first["host"] == meta["env"]["hostname"] and first["world_size"] == 2 and first["backend"] == "gloo"
    )
    assert first["spec"] == meta["spec"]["name"] and first["commbench_version"] and first["date"]
    assert [entry["case"]["size_bytes"] for entry in made["cases"]] == SIZES
    files = [pd.read_csv(run / "results.csv") for run in real_runs]
    for index, entry in enumerate(made["cases"]):
        assert entry["runs"] == 2 and entry["repeats"] == 2
        for figure, column in (("time_us", "time_us_p50"), ("busbw_GBps", "busbw_GBps")):
            values = [float(rows[column].iloc[index]) for rows in files]  # as the runs wrote them
            assert entry["figures"][figure]["median"] == pytest.approx(float(np.median(values)))
            assert entry["figures"][figure]["values"] == pytest.approx(values)

    markdown = invoke("compare", *real_runs)
    assert markdown.exit_code == 0, markdown.output
    table = [line for line in markdown.stdout.splitlines() if line.startswith("| balanced")]
    assert len(table) == 3 and "A time(us)" in markdown.stdout and "Only in" not in markdown.stdout
    assert "spread is unknown" in markdown.stdout  # one window each, window timing: said so

    as_json = invoke("compare", *real_runs, "--json")
    assert as_json.exit_code == 0, as_json.output
    compared = json.loads(as_json.stdout)
    assert (
        compared["schema"] == "commbench.compare/1" and compared["only_in_a"] == compared["only_in_b"] == []
    )
    entry = compared["cases"][2]
    a, b = (float(rows["time_us_p50"].iloc[2]) for rows in files)
    assert entry["a"]["time_us"] == pytest.approx(a) and entry["b"]["time_us"] == pytest.approx(b)
    assert entry["difference_pct"]["time_us"] == pytest.approx(100 * (b - a) / a)

    # A run inside its own baseline differs from the median by half the two runs' gap: always within the
    # spread (3 scaled MADs of two values = 2.2 x that gap).
    check = invoke("compare", out, real_runs[1])
    assert check.exit_code == 0, check.output
    assert "PASS (3 PASS)" in check.stdout and "| FAIL" not in check.stdout


@pytest.mark.parametrize(
    ("factor", "status", "code"), [(1.2, "FAIL", 1), (1.07, "WARN", 0), (1.02, "PASS", 0)]
)
def test_a_slower_copy_of_a_real_run_against_its_baseline(
    real_runs: list[Path], tmp_path: Path, factor: float, status: str, code: int
) -> None:
    out = tmp_path / "one.json"
    assert invoke("baseline", real_runs[0], "--out", out).exit_code == 0  # one run: spread unknown
    slow = slowed_copy(real_runs[0], tmp_path / "slow", factor)
    result = invoke("compare", out, slow)
    assert result.exit_code == code, result.output
    assert f"{status} (3 {status})" in result.stdout
    document = json.loads(invoke("compare", out, slow, "--json").stdout)
    assert document["status"] == status and document["counts"][status] == 3
    finding = document["findings"][0]
    assert finding["group"] == "baseline" and finding["figure"] == "busbw_GBps"
    assert finding["difference_pct"] == pytest.approx(100 * (1 / factor - 1))
    assert finding["spread_pct"] is None and "spread unknown" in finding["message"]


def test_compare_lists_cases_only_in_one_run(real_runs: list[Path], tmp_path: Path) -> None:
    fewer = slowed_copy(real_runs[1], tmp_path / "fewer", 1.0, drop_last_row=True)
    result = invoke("compare", real_runs[0], fewer)
    assert result.exit_code == 0, result.output
    assert "Only in A (1):\n- balanced 4 KiB" in result.stdout
    compared = json.loads(invoke("compare", real_runs[0], fewer, "--json").stdout)
    assert len(compared["cases"]) == 2 and compared["only_in_a"][0]["size_bytes"] == 4096


def test_baseline_refuses_bad_folders_and_an_existing_out(real_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "base.json"
    (tmp_path / "empty").mkdir()
    wrong = make_folder(tmp_path, "wrong", 10.0, wrong=1)
    cut = shutil.copytree(real_runs[0], tmp_path / "cut")
    (cut / "results.csv").write_text((cut / "results.csv").read_text()[:-30])
    stopped = shutil.copytree(real_runs[0], tmp_path / "stopped")
    meta = json.loads((stopped / "meta.json").read_text())
    (stopped / "meta.json").write_text(
        json.dumps({**meta, "status": "incomplete", "incomplete_reason": "SIGINT"})
    )
    for folder, fragment in (
        (tmp_path / "missing", "not found"),
        (tmp_path / "empty", "not a commbench report folder"),
        (wrong, "#wrong 2"),
        (cut, "results.csv"),
        (stopped, "INCOMPLETE"),
    ):
        assert_refused(invoke("baseline", real_runs[0], folder, "--out", out), fragment)
        assert not out.exists()
    assert_refused(invoke("baseline", real_runs[0], real_runs[0], "--out", out), "named twice")
    out.write_text("keep")
    assert_refused(invoke("baseline", real_runs[0], "--out", out), "already exists", "--force")
    assert out.read_text() == "keep"
    assert invoke("baseline", real_runs[0], "--out", out, "--force").exit_code == 0
    assert json.loads(out.read_text())["schema"] == "commbench.baseline/1"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_compare_refuses_bad_input(real_runs: list[Path], tmp_path: Path) -> None:
    other = make_folder(tmp_path, "four-ranks", 10.0)  # 4 ranks: no case in common with the 2-rank runs
    assert_refused(invoke("compare", real_runs[0], other), "no case in common", "2 ranks", "4 ranks")
    assert_refused(invoke("compare", real_runs[0], tmp_path / "missing"), "not found")
    (tmp_path / "empty").mkdir()
    assert_refused(invoke("compare", tmp_path / "empty", real_runs[0]), "not a commbench report folder")
    not_baseline = tmp_path / "results.json"
    not_baseline.write_text('{"results": []}')
    assert_refused(invoke("compare", not_baseline, real_runs[0]), "not a commbench baseline")
    base = tmp_path / "base.json"
    assert invoke("baseline", other, "--out", base).exit_code == 0
    assert_refused(invoke("compare", base, real_runs[0]), "has no case the baseline")
    assert_refused(invoke("compare", base, other, "--warn-pct", "20"), "--warn-pct 20 is above --fail-pct 10")
    assert_refused(invoke("compare", base, other, "--fail-pct", "nan"), "--fail-pct")
