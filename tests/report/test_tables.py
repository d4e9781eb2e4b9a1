"""report.tables: the one table printer, the stdout results table and a sweep's knob setting."""

from __future__ import annotations

import pytest

from commbench.inputs.specs import load_spec
from commbench.report import format_bandwidth, results_frame, results_table
from commbench.report.tables import format_table
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


def test_results_table_has_columns_and_average_footer() -> None:
    rows = [balanced_row(4, 4096, 10.0), balanced_row(4, 8192, 12.0), *skewed_rows()]
    frame = results_frame(rows, GB300)
    text = results_table(frame)
    header = next(line for line in text.splitlines() if line.startswith("# pattern"))
    for name in ("skew", "phase", "size(B)", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "%spec", "#wrong"):
        assert name in header
    assert "knobs" not in header  # no sweep: every row ran with the same (empty) setting
    expected_avg = frame["busbw_GBps"].mean()
    assert f"# Avg bus bandwidth    : {format_bandwidth(expected_avg)} GB/s" in text
    assert float(format_bandwidth(expected_avg)) == pytest.approx(expected_avg, rel=5e-3)
    assert "# Total #wrong         : 0" in text
    assert "spec: gb300-nvl72 900.0 GB/s per GPU per direction" in text
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(body) == len(rows)
    # nccl-tests layout: text columns left-aligned, a balanced row's empty skew is "-" in its column.
    assert body[0].split()[:3] == ["balanced", "-", "alltoall"] and body[0].startswith("  balanced     -   ")


def test_results_table_flags_wrong_data() -> None:
    frame = results_frame([{**balanced_row(4, 4096, 10.0), "wrong": 3}], GB300)
    assert "# Total #wrong         : 3  (DATA MISMATCH)" in results_table(frame)


@pytest.mark.parametrize("as_text", [False, True])
def test_results_table_shows_what_a_sweep_varies(as_text: bool) -> None:
    settings = [{"chunk_rows": 4, "signal": "chunk"}, {"chunk_rows": 8, "signal": "chunk"}]
    rows = [balanced_row(4, 4096, 10.0, knobs=knobs) for knobs in settings]
    if as_text:  # as re-read from results.csv
        rows = [{**row, "knobs": " ".join(f"{k}={v}" for k, v in row["knobs"].items())} for row in rows]
    text = results_table(results_frame(rows, GB300))
    header = next(line for line in text.splitlines() if line.startswith("# pattern"))
    assert header.endswith("knobs")
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert [line.split()[-1] for line in body] == ["chunk_rows=4", "chunk_rows=8"]
