"""A soak run judged: each case's drift from its first rounds to its last (medians at each end), a gain
never a finding, and no soak elements for other runs."""

from __future__ import annotations

import pandas as pd
import pytest

from commbench.inputs.limits import load_limits
from commbench.report.analysis.soak import drift_pct, is_soak, soak_elements

GPU = load_limits("gb300-nvl72")  # drift WARN 5%, FAIL 10%


def soak_rows(busbw: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "pattern": "balanced", "phase": "alltoall", "skew": None, "size_bytes": 1 << 30,
            "repeat": range(len(busbw)), "soak_s": [10.0 * (i + 1) for i in range(len(busbw))],
            "busbw_mean_GBps": busbw, "busbw_GBps": busbw,
        }
    )  # fmt: skip


@pytest.mark.parametrize(
    ("busbw", "status"),
    [
        ([600, 601, 599, 600, 598, 601], "PASS"),
        ([600, 600, 600, 560, 565, 562], "WARN"),  # 6.3% lost
        ([600, 600, 600, 520, 530, 525], "FAIL"),  # 12.5% lost
        ([500, 500, 500, 600, 600, 600], "PASS"),  # a gain is not a finding
        ([600, 300, 600, 600, 300, 600], "PASS"),  # one bad round at each end is not a drift
    ],
)
def test_drift_between_the_first_and_last_rounds_is_judged(busbw: list[float], status: str) -> None:
    elements = soak_elements(soak_rows(busbw), GPU)
    assert [(e.group, e.name, e.status) for e in elements] == [("soak", "balanced 1 GiB drift", status)]


def test_drift_compares_medians_of_up_to_three_rounds_at_each_end() -> None:
    assert drift_pct(pd.Series([100.0, 90.0])) == pytest.approx(10.0)
    assert drift_pct(pd.Series([100.0, 100.0, 100.0, 50.0, 80.0, 80.0])) == pytest.approx(20.0)


def test_other_runs_have_no_soak_elements() -> None:
    rows = soak_rows([1.0, 2.0]).drop(columns=["soak_s"])
    assert not is_soak(rows) and soak_elements(rows, GPU) == []
    assert soak_elements(soak_rows([600.0]), GPU)[0].status == "SKIP"


def test_a_cpu_run_drift_is_a_warn_at_most() -> None:
    # A CPU run's bandwidth is this host's scheduling: a collapse is worth a look, never a FAIL.
    cpu = load_limits(None)  # drift WARN 50%, FAIL 75%
    (element,) = soak_elements(soak_rows([600, 600, 600, 50, 60, 55]), cpu)
    assert element.status == "WARN" and "CPU run" in element.message
