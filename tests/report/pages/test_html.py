"""The report's plots: a bar's length reads as its value (linear from 0 unless the values span decades)."""

from __future__ import annotations

import pandas as pd

from commbench.inputs.specs import load_spec, no_spec
from commbench.report.pages.html import per_gpu_figure


def _moe_rows(values: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "pattern": ["deepseek-v3"] * len(values),
            "skew": ["zipf:1.2"] * len(values),
            "phase": ["dispatch", "combine"][: len(values)],
            "backend": ["gloo"] * len(values),
            "per_gpu_GBps": values,
            "pct_spec": [float("nan")] * len(values),
        }
    )


def test_close_bars_without_a_spec_are_linear_from_zero_and_labelled_with_their_values() -> None:
    axes = per_gpu_figure(_moe_rows([0.43, 0.214]), no_spec("CPU run")).axes[0]
    assert axes.get_yscale() == "linear"
    assert axes.get_ylim()[0] == 0
    assert [text.get_text() for text in axes.texts] == ["0.43", "0.214"]


def test_bars_far_below_the_spec_line_go_log() -> None:
    frame = _moe_rows([400.0, 2.0]).assign(pct_spec=[44.0, 0.2])
    axes = per_gpu_figure(frame, load_spec("gb300-nvl72")).axes[0]
    assert axes.get_yscale() == "log"
    assert [text.get_text() for text in axes.texts] == ["44%", "0.2%"]
