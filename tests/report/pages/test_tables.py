"""report.tables: the one table printer and the report's tables (mean or p50 time, timing column)."""

from __future__ import annotations

import pytest

from commbench.inputs.specs import load_spec
from commbench.report import format_bandwidth, results_frame
from commbench.report.pages.tables import format_table, pattern_tables
from tests.report.rows import balanced_row, skewed_rows

GB300 = load_spec("gb300-nvl72")


def test_markdown_right_aligns_numeric_columns() -> None:
    text = format_table(["name", "GB/s"], [["a", "1.50"], ["bb", "10.25"]], "markdown")
    lines = text.splitlines()
    assert lines[0] == "| name |  GB/s |"
    assert lines[1] == "|------|------:|"
    assert lines[3] == "| bb   | 10.25 |"


def test_text_columns_stay_left_aligned_even_when_empty() -> None:
    rows = [["-", "1"], ["-", "22"]]
    assert format_table(["skew", "n"], rows).splitlines()[1] == "   -   1"
    assert format_table(["skew", "n"], rows, text_columns={0}).splitlines()[1] == "-      1"


def test_html_marks_numeric_cells_and_escapes() -> None:
    text = format_table(["name", "GB/s"], [["<a>", "1.5"]], "html")
    assert '<th class="num">GB/s</th>' in text and '<td class="num">1.5</td>' in text
    assert "<td>&lt;a&gt;</td>" in text


def test_bad_table_input() -> None:
    with pytest.raises(ValueError, match="style"):
        format_table(["a"], [["1"]], "latex")
    with pytest.raises(ValueError, match="1 cells for 2 headers"):
        format_table(["a", "b"], [["1"]])


def markdown_rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]


def test_balanced_table_uses_nccl_tests_mean_time_and_moe_table_p50() -> None:
    rows = [balanced_row(4, 4096, 10.0, time_us_mean=16.0), *skewed_rows(time_us_mean=150.0)]
    frame = results_frame(rows, GB300)
    tables = {name: table.markdown() for name, table in pattern_tables(frame)}
    header, _, balanced = markdown_rows(tables["balanced"])
    cells = dict(zip(header, balanced, strict=True))
    assert cells["time mean(us)"] == "16.0" and cells["p50(us)"] == "10.0"
    assert cells["busbw(GB/s)"] == format_bandwidth(4096 * 3 / 4 / 16e-6 / 1e9)  # from the mean
    header, _, dispatch, _ = markdown_rows(tables["toy"])
    cells = dict(zip(header, dispatch, strict=True))
    assert cells["time mean(us)"] == "150.0" and cells["p50(us)"] == "100.0"
    assert cells["busbw(GB/s)"] == format_bandwidth(frame.iloc[1]["busbw_GBps"])  # from p50
    assert "timing" not in header


def test_tables_show_timing_only_where_rows_mix_modes() -> None:
    same = [balanced_row(4, 4096, 10.0, timing="window"), balanced_row(4, 8192, 10.0, timing="window")]
    assert "timing" not in dict(pattern_tables(results_frame(same, GB300)))["balanced"].markdown()
    mixed = [balanced_row(4, 4096, 10.0, timing="window"), balanced_row(4, 4096, 10.0)]  # older row: none
    header, _, *body = markdown_rows(dict(pattern_tables(results_frame(mixed, GB300)))["balanced"].markdown())
    column = header.index("timing")
    assert [row[column] for row in body] == ["window", "iteration"]
