"""One ``Case``: read from a row (memory or CSV), keyed with and without the repeat, labelled; grouped from a
frame exactly as ``Case.from_row`` reads each row; and every report module that groups rows by case agrees
on which rows are one case."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from commbench.inputs.limits import SpreadRule
from commbench.inputs.models import ModelConfig
from commbench.report.analysis.repeats import repeat_range_table
from commbench.report.frame import results_frame
from commbench.report.judge.baseline import group_cases
from commbench.report.judge.outliers import outliers_by_case
from commbench.report.profiler.profile import step_stats
from commbench.run.case import CASE_FIELDS, IDENTITY, Case, case_index, group_by_case, model_digest
from tests.report.rows import balanced_row, skewed_rows

TOY = ModelConfig("toy", hidden=4096, num_experts=16, topk=4)


def test_from_row_reads_memory_and_csv_cells_alike() -> None:
    memory = {**balanced_row(4, 4096, 10.0), "knobs": {"chunk_rows": 4, "signal": "chunk"}, "repeat": 1}
    csv = {**memory, "size_bytes": 4096.0, "world_size": np.int64(4), "knobs": "chunk_rows=4 signal=chunk"}
    csv["repeat"] = 1.0
    assert Case.from_row(memory) == Case.from_row(csv)
    case = Case.from_row(memory)
    assert (
        case.size_bytes == 4096
        and isinstance(case.size_bytes, int)
        and case.knobs == "chunk_rows=4 signal=chunk"
    )
    assert case.repeat == 1 and case.skew is None and case.tokens_per_rank is None  # NaN / absent: None
    assert Case.from_row({"pattern": "balanced", "phase": "alltoall"}).repeat == 0


def test_key_leaves_the_repeat_out_and_repeat_key_keeps_it() -> None:
    first, second = (Case.from_row({**balanced_row(4, 4096, 10.0), "repeat": r}) for r in (0, 1))
    assert first.key == second.key and first.repeat_key != second.repeat_key
    assert len(first.key) == len(IDENTITY) and (*IDENTITY, "repeat") == CASE_FIELDS
    assert Case.from_dict(first.as_dict()) == first  # a baseline file's case reads back as itself
    assert Case.from_dict({"pattern": "balanced", "phase": "alltoall", "unknown": 1}).pattern == "balanced"


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ({"knobs": "num_blocks=8"}, False),
        ({"timing": "window"}, False),
        ({"check": "every"}, False),
        ({"backend": "nccl"}, False),
        ({"world_size": 8}, False),
        ({"size_bytes": 8192}, False),
        ({"seed": 7}, True),  # another draw of the same distribution: the same case
        ({"time_us_p50": 99.0}, True),
    ],
)
def test_which_fields_make_a_balanced_case(change: dict, same: bool) -> None:
    row = balanced_row(4, 4096, 10.0)
    assert (Case.from_row(row).key == Case.from_row({**row, **change}).key) is same


def test_an_moe_phase_is_its_routing_not_its_size_and_its_model_not_only_its_name() -> None:
    dispatch = skewed_rows()[0]
    assert Case.from_row(dispatch).key == Case.from_row({**dispatch, "size_bytes": 1}).key
    assert Case.from_row(dispatch).key != Case.from_row({**dispatch, "tokens_per_rank": 128}).key
    wider = replace(TOY, hidden=2 * TOY.hidden)  # the same ``name:`` with another hidden size
    assert model_digest(TOY) != model_digest(wider)
    assert model_digest(TOY) == model_digest(replace(TOY, source="another file"))
    ours, theirs = ({**dispatch, "model_digest": model_digest(m)} for m in (TOY, wider))
    assert Case.from_row(ours).key != Case.from_row(theirs).key
    assert Case.from_row(ours).without_model_digest().key == Case.from_row(dispatch).key


def test_label_for_people() -> None:
    assert Case.from_row(balanced_row(4, 16 << 20, 10.0)).label == "balanced 16 MiB"
    dispatch = skewed_rows()[0]
    assert Case.from_row(dispatch).label == "toy dispatch skew hot:1:0.5 64 tok/rank"
    row = {**dispatch, "send_mode": "selection", "knobs": {"mode": "ll"}, "repeat": 2}
    assert (
        Case.from_row(row).label
        == "toy dispatch skew hot:1:0.5 64 tok/rank send selection [mode=ll] repeat 2"
    )
    assert Case.from_row({**dispatch, "skew": "uniform"}).label == "toy dispatch 64 tok/rank"
    assert Case.from_row(dispatch).layer.label == "toy skew hot:1:0.5 64 tok/rank"


def _frame() -> pd.DataFrame:
    rows = []
    for repeat in (0, 1, 2):
        rows += [balanced_row(4, size, 10.0 + repeat, repeat=repeat) for size in (4096, 8192)]
        rows += skewed_rows(100.0 + repeat, repeat=repeat, knobs={"mode": "ll"})
        rows += skewed_rows(100.0 + repeat, repeat=repeat, knobs={"mode": "normal"})
    return results_frame(rows)


def test_frame_grouping_is_from_row_of_every_row() -> None:
    frame = _frame()
    for repeat in (False, True):
        codes, cases = case_index(frame, repeat=repeat)
        expected = [Case.from_row(row) for row in frame.to_dict("records")]
        expected = expected if repeat else [replace(case, repeat=0) for case in expected]
        assert [cases[code] for code in codes] == expected
    groups = group_by_case(frame)
    assert len(groups) == 6 and all(len(rows) == 3 for _, rows in groups)  # 2 sizes + 2 settings x 2 phases
    assert len(group_by_case(frame, layer=True)) == 4  # dispatch and combine of a layer together
    assert sum(len(rows) for _, rows in group_by_case(frame, repeat=True)) == len(frame)


def test_every_module_sees_the_same_cases() -> None:
    """The baseline, the repeat range, the rank outliers and the profile group one frame into the same
    cases (before, each had its own key tuple: the outliers pooled repeats, the range ignored the backend)."""
    frame = _frame().assign(rank=0, us=1.0, step="phase", iteration=0, late=1.0)
    baseline = [case for case, _ in group_cases(frame).values()]
    measured = [case for case, _ in group_by_case(frame, repeat=True)]
    assert baseline == [case for case, _ in group_by_case(frame)]
    table = repeat_range_table(frame).markdown()
    assert table is not None and len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + 6
    spreads = outliers_by_case(frame, "late", SpreadRule(), metric="arrival")
    assert [spread.case for spread in spreads] == [case.label for case in measured]
    assert [spread.key for spread in spreads] == [case.repeat_key for case in measured]
    assert list(dict.fromkeys(step_stats(frame)["case"])) == [case.label for case in measured]
    assert {case.key for case in measured} == {case.key for case in baseline}
