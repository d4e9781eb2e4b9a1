"""The range of a case over its repeats (--repeat): min, median and max of its busbw and skew cost, so that a
difference between two figures can be told from run-to-run noise."""

from __future__ import annotations

import pandas as pd

from commbench.report.pages.render import Section, Text
from commbench.report.pages.tables import Table, fmt_float, fmt_text, format_bandwidth
from commbench.run.case import REPEAT_COLUMN, Case, group_by_case

REPEAT_NOTE = (
    "Each case was measured several times (--repeat), round after round. busbw: balanced rows from the "
    "mean time, MoE rows from p50, per repeat; range = (max - min) / median. A difference between two cases "
    "smaller than their ranges is noise on this host."
)


def busbw_per_repeat(rows: pd.DataFrame) -> pd.Series:
    """Each row's busbw as the repeat range compares it: balanced rows from the mean time, MoE from p50."""
    balanced = rows["phase"].astype(str).eq("alltoall")
    mean_based = pd.to_numeric(rows.get("busbw_mean_GBps"), errors="coerce")
    p50_based = pd.to_numeric(rows.get("busbw_GBps"), errors="coerce")
    return mean_based.where(balanced, p50_based)


def _stats(values: pd.Series) -> tuple[float, float, float]:
    values = values.dropna()
    if values.empty:
        return float("nan"), float("nan"), float("nan")
    return float(values.min()), float(values.median()), float(values.max())


def _shown_case(case: Case) -> str:
    """The table's case cell: a balanced or matrix row's size, an MoE row's skew."""
    if case.routed:
        return fmt_text(case.skew)
    return f"{case.size_bytes} B" if case.size_bytes is not None else "-"


def repeat_range_table(frame: pd.DataFrame) -> Table | None:
    """One row per case (``run.case.Case``) measured more than once; None when no case was."""
    if frame.empty or REPEAT_COLUMN not in frame.columns:
        return None
    repeats = pd.to_numeric(frame[REPEAT_COLUMN], errors="coerce").fillna(0)
    if repeats.max() < 1:
        return None
    rows = []
    for case, group in group_by_case(frame.assign(_busbw=busbw_per_repeat(frame))):
        if len(group) < 2:
            continue
        low, median, high = _stats(group["_busbw"])
        skew_cost = pd.to_numeric(group.get("skew_cost"), errors="coerce") if "skew_cost" in group else None
        cost = _stats(skew_cost) if skew_cost is not None else (float("nan"),) * 3
        spread = (high - low) / median * 100 if median and median == median else float("nan")
        rows.append(
            [
                fmt_text(case.pattern),
                _shown_case(case),
                fmt_text(case.phase),
                str(len(group)),
                format_bandwidth(low),
                format_bandwidth(median),
                format_bandwidth(high),
                fmt_float(1)(spread),
                *(fmt_float(2)(value) for value in cost),
            ]
        )
    if not rows:
        return None
    headers = [
        "pattern", "case", "phase", "repeats", "busbw min(GB/s)", "busbw median(GB/s)", "busbw max(GB/s)",
        "range(%)", "skew cost min", "skew cost median", "skew cost max",
    ]  # fmt: skip
    return Table(headers, rows, text_columns={0, 1, 2}, wide=True)


def repeat_range_section(frame: pd.DataFrame) -> Section | None:
    """The page's "Range over repeats" section, or None when no case was measured more than once."""
    table = repeat_range_table(frame)
    return None if table is None else Section("Range over repeats", (Text(REPEAT_NOTE), table))
