"""The range of a case over its --repeat measurements: min / median / max of busbw, from the same figures the
tables use (balanced: mean time; MoE: p50), one row per case measured more than once."""

from __future__ import annotations

import pytest

from commbench.inputs.specs import load_spec
from commbench.report.analysis.repeats import repeat_range_table
from commbench.report.frame import results_frame
from tests.report.rows import balanced_row, skewed_rows

GB300 = load_spec("gb300-nvl72")


def test_one_row_per_case_with_min_median_max_of_its_repeats() -> None:
    rows = [
        balanced_row(4, 4096, time_us, repeat=repeat) for repeat, time_us in enumerate((10.0, 20.0, 40.0))
    ]
    rows += [row for repeat in (0, 1) for row in skewed_rows(100.0 * (repeat + 1), repeat=repeat)]
    frame = results_frame(rows, GB300)
    table = repeat_range_table(frame).markdown()
    lines = [line for line in table.splitlines() if line.startswith("| balanced") or line.startswith("| toy")]
    assert len(lines) == 3  # balanced 4096 B, toy dispatch, toy combine
    busbw = results_frame([balanced_row(4, 4096, 20.0)], GB300)["busbw_mean_GBps"].iloc[0]
    cells = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert cells[:4] == ["balanced", "4096 B", "alltoall", "3"]
    assert float(cells[5]) == pytest.approx(busbw, rel=1e-2)  # the median repeat: 20 us
    assert float(cells[7]) == pytest.approx(
        100 * (2 * busbw - busbw / 2) / busbw, rel=1e-2
    )  # (max-min)/median


def test_no_table_with_one_measurement_per_case() -> None:
    frame = results_frame([balanced_row(4, 4096, 10.0), *skewed_rows()], GB300)
    assert repeat_range_table(frame) is None
