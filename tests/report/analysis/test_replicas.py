"""The "What EPLB replicas buy" table: cases without and with replicas paired from the result rows."""

from __future__ import annotations

import pandas as pd

from commbench.report.analysis.replicas import replicas_section, replicas_table
from commbench.report.pages.render import html_page, markdown_page


def row(
    phase: str, time_us: float, max_recv: int, knobs: object = "", window: int = 0, skew: str = "zipf:1.2"
) -> dict[str, object]:
    return {
        "pattern": "deepseek-v3",
        "skew": skew,
        "tokens_per_rank": 512,
        "send_mode": "token",
        "world_size": 4,
        "backend": "gloo",
        "phase": phase,
        "knobs": knobs,
        "window": window,
        "time_us_p50": time_us,
        "max_recv_bytes": max_recv,
        "total_bytes": 4000,
    }


def test_pairs_each_case_with_its_replicas_case() -> None:
    frame = pd.DataFrame(
        [
            row("dispatch", 100.0, 2000),
            row("combine", 200.0, 4000),
            row("dispatch", 300.0, 2000, window=1),  # the median over windows: 200
            row("combine", 200.0, 4000, window=1),
            row("dispatch", 80.0, 1100, knobs="replicas=4"),
            row("combine", 150.0, 2200, knobs={"replicas": 4}),  # a dict, as rows in memory hold it
            row("dispatch", 90.0, 1000, skew="uniform"),  # no case with replicas: not in the table
            row("combine", 90.0, 1000, skew="uniform"),
        ]
    )
    table = replicas_table(frame)
    assert table is not None
    lines = table.text().splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:4] == ["model", "skew", "tokens/rank", "replicas"]
    # recv max/mean: 2000 / (4000 / 4) = 2.0 without, 1.1 with; dispatch 200 -> 80 us (0.4), combine 0.75.
    assert lines[1].split() == [
        "deepseek-v3", "zipf:1.2", "512", "4", "2.000", "1.100",
        "200.0", "80.0", "0.40", "200.0", "150.0", "0.75",
    ]  # fmt: skip


def test_the_section_holds_the_note_and_the_table() -> None:
    frame = pd.DataFrame([row("dispatch", 10.0, 2000), row("dispatch", 5.0, 1000, knobs="replicas=8")])
    section = replicas_section(frame)
    assert section is not None and section.title == "What EPLB replicas buy"
    assert markdown_page([section]).startswith("## What EPLB replicas buy\n\nEach MoE case ran twice")
    assert "| model" in markdown_page([section]) and "<table>" in html_page("t", [section])
    assert replicas_section(pd.DataFrame()) is None


def test_no_table_without_a_pair() -> None:
    assert replicas_table(pd.DataFrame()) is None
    only_without = pd.DataFrame([row("dispatch", 10.0, 2000), row("combine", 10.0, 2000)])
    assert replicas_table(only_without) is None
    only_with = pd.DataFrame([row("dispatch", 10.0, 2000, knobs="replicas=8")])
    assert replicas_table(only_with) is None
    assert replicas_table(only_without.drop(columns=["knobs"])) is None  # a folder from before --replicas
