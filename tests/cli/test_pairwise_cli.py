"""The pairwise link test through the command line on 4 gloo ranks, one shared launch with a slow direction
planted (tests/launches.py): exactly that direction flagged in the three tests and confirmed (FAIL, exit 1),
every pair measured with right data, the heatmaps in report.html and re-rendered; bad input refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from click.testing import CliRunner

from commbench.cli import cli
from tests.launches import PAIRWISE, SLOW_PAIR, Launch, copy_of, not_failed_by_data_or_completion

HEATMAPS = ("one-way bandwidth (GB/s)", "latency (us)", "bidirectional bandwidth (GB/s)")


def flagged_pairs(run: Launch, *statuses: str) -> set[tuple[str, str]]:
    """(test, "src->dst") of the pairwise elements with one of ``statuses`` (default FAIL and WARN)."""
    statuses = statuses or ("FAIL", "WARN")
    return {
        (e.name.split(" ")[0], e.name.rsplit(" ", 1)[-1])
        for e in run.verdict().elements
        if e.group == "pairwise" and e.status in statuses and "->" in e.name
    }


def test_the_planted_slow_direction_is_the_only_pair_that_fails(pairwise_run: Launch) -> None:
    assert pairwise_run.last_line().startswith("commbench verdict: FAIL")
    # The three tests of one direction (a planted 20 ms per send) fail, confirmed by reruns; not its
    # reverse, nor any other pair. A busy host's noise may flag another pair once: a WARN ("not
    # reproduced" by the reruns), never a FAIL.
    assert flagged_pairs(pairwise_run, "FAIL") == {
        ("latency", SLOW_PAIR),
        ("bandwidth", SLOW_PAIR),
        ("bidir", SLOW_PAIR),
    }
    failed = [e for e in pairwise_run.verdict().elements if e.status == "FAIL"]
    assert all(e.group == "pairwise" and "flagged again in 2 of 2 reruns" in e.message for e in failed)
    src, dst = SLOW_PAIR.split("->")
    assert f"rank {src} (host " in failed[0].message and f"-> rank {dst} (host " in failed[0].message


def test_every_ordered_pair_is_measured_with_right_data(pairwise_run: Launch) -> None:
    assert "pairwise link test: 3 rounds of up to 2 pairs" in pairwise_run.stderr
    rows = list(csv.DictReader((pairwise_run.out / "pairs.csv").open()))
    assert len(rows) == 3 * 12 and {row["wrong"] for row in rows} == {"0"}
    not_failed_by_data_or_completion(pairwise_run.verdict(), rows_checked=False)


def test_the_report_shows_the_three_heatmaps_and_rerenders_them(pairwise_run: Launch, tmp_path: Path) -> None:
    page = (pairwise_run.out / "report.html").read_text()
    for title in HEATMAPS:
        assert f'alt="heatmap: [src][dst] {title}"' in page
    assert page.count('class="heatmap"') == 3
    assert "## Pairwise link test" in (pairwise_run.out / "summary.md").read_text()
    out = copy_of(pairwise_run, tmp_path / "pairs")
    rerender = CliRunner().invoke(cli, ["report", str(out)])
    assert rerender.exit_code == 0, rerender.output
    assert rerender.stdout.strip().splitlines()[-1].startswith("commbench verdict: FAIL")  # the saved one
    assert (out / "report.html").read_text().count("[src][dst]") == page.count("[src][dst]")


@pytest.mark.parametrize(
    ("delay", "words"),
    [
        ("1-1:500", "two different ranks in 0..3"),
        ("1-7:500", "two different ranks in 0..3"),
        ("1-2:0", "is not RANK:MICROSECONDS or SRC-DST:MICROSECONDS"),
        ("1-2:20000000", "out of range"),
    ],
)
def test_a_bad_pair_delay_is_refused_before_launch(tmp_path: Path, delay: str, words: str) -> None:
    out = tmp_path / "bad"
    result = CliRunner().invoke(cli, [*PAIRWISE, "--inject-delay", delay, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) <= 3
    assert not out.exists()
