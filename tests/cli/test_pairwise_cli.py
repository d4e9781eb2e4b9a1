"""The pairwise link test through the command line on 4 gloo ranks: nothing flagged without a fault, exactly
the injected direction flagged (FAIL, exit 1) with it, the heatmaps in report.html, bad input refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from commbench.report.judge.verdict import read_verdict_json
from tests.cli.test_acceptance import commbench, last_line

PAIRWISE = ["run", "--pattern", "pairwise", "--world-size", "4", "--backend", "gloo", "--warmup", "1"]
PAIRWISE += ["--iters", "5", "--pair-bytes", "256K"]


def flagged_pairs(out: Path) -> set[tuple[str, str]]:
    verdict = read_verdict_json(out / "verdict.json")
    return {
        (e.name.split(" ")[0], e.name.rsplit(" ", 1)[-1])
        for e in verdict.elements
        if e.group == "pairwise" and e.status in ("FAIL", "WARN") and "->" in e.name
    }


def test_healthy_pairs_pass_and_the_report_shows_both_heatmaps(tmp_path: Path) -> None:
    out = tmp_path / "pairs"
    result = commbench([*PAIRWISE, "--out", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_line(result).startswith("commbench verdict: PASS")
    assert "pairwise link test: 3 rounds of up to 2 pairs" in result.stderr
    rows = list(csv.DictReader((out / "pairs.csv").open()))
    assert len(rows) == 3 * 12 and {row["wrong"] for row in rows} == {"0"}
    assert not flagged_pairs(out)
    page = (out / "report.html").read_text()
    for title in ("one-way bandwidth (GB/s)", "latency (us)", "bidirectional bandwidth (GB/s)"):
        assert f'alt="heatmap: [src][dst] {title}"' in page
    assert page.count('class="heatmap"') == 3
    assert "## Pairwise link test" in (out / "summary.md").read_text()
    before = page
    rerender = commbench(["report", str(out)], tmp_path)
    assert rerender.returncode == 0, rerender.stderr[-2000:]
    assert (out / "report.html").read_text().count("[src][dst]") == before.count("[src][dst]")


@pytest.mark.parametrize(("delay", "pair"), [("1-2:20000", "1->2"), ("2-1:20000", "2->1")])
def test_an_injected_slow_direction_is_the_only_pair_flagged(tmp_path: Path, delay: str, pair: str) -> None:
    out = tmp_path / "slow"
    result = commbench([*PAIRWISE, "--inject-delay", delay, "--out", str(out)], tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert last_line(result).startswith("commbench verdict: FAIL")
    assert flagged_pairs(out) == {("latency", pair), ("bandwidth", pair), ("bidir", pair)}
    verdict = read_verdict_json(out / "verdict.json")
    failed = [e for e in verdict.elements if e.status == "FAIL"]
    assert all(e.group == "pairwise" and "flagged again in 2 of 2 reruns" in e.message for e in failed)
    src, dst = pair.split("->")
    assert f"rank {src} (host " in failed[0].message and f"-> rank {dst} (host " in failed[0].message


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
    result = commbench([*PAIRWISE, "--inject-delay", delay, "--out", str(out)], tmp_path)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3
    assert not out.exists()
