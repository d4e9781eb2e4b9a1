"""suite --soak on 4 gloo ranks: the cases repeat until the time is up, each row knows when it ran, the drift
of every case is in the verdict, the plot in report.html; bad durations and conflicts refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.report.judge.verdict import read_verdict_json
from tests.launches import launch, not_failed_by_data_or_completion

SOAK = ["suite", "--quick", "--world-size", "4", "--backend", "gloo", "--no-pairwise", "--skew", "zipf:1.2"]


def test_a_short_soak_repeats_the_cases_and_judges_their_drift(tmp_path: Path) -> None:
    # gloo rounds of a few seconds on 2 shared cores swing by 2x: the drift rule itself is tested on fixed
    # figures (tests/report/analysis/test_soak.py); here its limits are opened and only the run's shape is
    # checked (its timing checks may flag a busy host's straggler: exit 1 allowed, never for data or
    # completion).
    limits = ["--limit", "soak.drift_warn_pct=99", "--limit", "soak.drift_fail_pct=100"]
    run = launch([*SOAK, "--soak", "4s", *limits], tmp_path, "soak", codes=(0, 1))
    out = run.out
    not_failed_by_data_or_completion(run.verdict())
    rows = list(csv.DictReader((out / "results.csv").open()))
    rounds = {int(row["repeat"]) for row in rows}  # each soak round is a repeat of its case
    # One balanced size, dispatch + combine, and the decode case's dispatch + combine, every round.
    assert len(rounds) >= 2 and len(rows) == 5 * len(rounds)
    assert {row["size_bytes"] for row in rows if row["phase"] == "alltoall"} == {str(1 << 20)}
    times = [float(row["soak_s"]) for row in rows]
    assert times == sorted(times) and times[0] > 0
    verdict = read_verdict_json(out / "verdict.json")
    drift = [e for e in verdict.elements if e.group == "soak"]
    assert len(drift) == 5 and all(e.name.endswith("drift") and e.status != "SKIP" for e in drift)
    assert "Soak: bandwidth per round over time" in (out / "report.html").read_text()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--soak", "0s"], "is not a duration"),
        (["--soak", "10x"], "is not a duration"),
        (["--soak", "8d"], "is not a duration"),
        (["--soak", "1m", "--repeat", "2"], "leave out --repeat"),
    ],
)
def test_bad_soak_input_is_refused_before_launch(tmp_path: Path, args: list[str], words: str) -> None:
    out = tmp_path / "bad"
    result = CliRunner().invoke(cli, [*SOAK, *args, "--out", str(out)])
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output
    assert not out.exists()
