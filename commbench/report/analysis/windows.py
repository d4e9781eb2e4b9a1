"""The spread of a case over its measurement windows (--repeat): min, median and max of its busbw
and skew cost, so that a difference between two figures can be told from run-to-run noise."""

from __future__ import annotations

import pandas as pd

from commbench.report.knobs import KNOB_SETTING_COLUMN
from commbench.report.pages.render import Section, Text
from commbench.report.pages.tables import Table, fmt_float, fmt_text, format_bandwidth

# What makes a case: its rows in different windows differ only in their "window" column.
_CASE_COLUMNS = ("pattern", "skew", "phase", "size_bytes", KNOB_SETTING_COLUMN)
WINDOW_NOTE = (
    "Each case ran in several measurement windows (--repeat), round after round. busbw: balanced "
    "rows from the mean time, MoE rows from p50, per window; spread = (max - min) / median. A difference "
    "between two cases smaller than their spreads is noise on this host."
)


def busbw_per_window(rows: pd.DataFrame) -> pd.Series:
    """Each row's busbw as the window spread compares it: balanced rows from the mean time, MoE from p50."""
    balanced = rows["phase"].astype(str).eq("alltoall")
    mean_based = pd.to_numeric(rows.get("busbw_mean_GBps"), errors="coerce")
    p50_based = pd.to_numeric(rows.get("busbw_GBps"), errors="coerce")
    return mean_based.where(balanced, p50_based)


def case_columns(frame: pd.DataFrame) -> list[str]:
    """The columns that make a case (rows of one case in different windows differ only in ``window``)."""
    return [column for column in _CASE_COLUMNS if column in frame.columns]


def case_name(frame: pd.DataFrame, key: object) -> str:
    """ "balanced 16777216 B alltoall", "deepseek-v3 zipf:1.2 dispatch": a case from its group key."""
    values = dict(zip(case_columns(frame), key if isinstance(key, tuple) else (key,), strict=True))
    case = values.get("skew") if values.get("phase") != "alltoall" else f"{int(values['size_bytes'])} B"
    setting = values.get(KNOB_SETTING_COLUMN)
    parts = [values.get("pattern"), case, values.get("phase"), f"[{setting}]" if setting else None]
    return " ".join(str(part) for part in parts if part is not None and part == part and part != "")


def _stats(values: pd.Series) -> tuple[float, float, float]:
    values = values.dropna()
    if values.empty:
        return float("nan"), float("nan"), float("nan")
    return float(values.min()), float(values.median()), float(values.max())


def window_spread_table(frame: pd.DataFrame) -> Table | None:
    """One row per case that ran in more than one window; None when no case did."""
    if frame.empty or "window" not in frame.columns:
        return None
    windows = pd.to_numeric(frame["window"], errors="coerce").fillna(0)
    if windows.max() < 1:
        return None
    keys = case_columns(frame)
    rows = []
    for key, group in frame.assign(_busbw=busbw_per_window(frame)).groupby(keys, dropna=False, sort=False):
        if len(group) < 2:
            continue
        values = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        low, median, high = _stats(group["_busbw"])
        skew_cost = pd.to_numeric(group.get("skew_cost"), errors="coerce") if "skew_cost" in group else None
        cost = _stats(skew_cost) if skew_cost is not None else (float("nan"),) * 3
        spread = (high - low) / median * 100 if median and median == median else float("nan")
        case = values.get("skew") if values.get("phase") != "alltoall" else f"{int(values['size_bytes'])} B"
        rows.append(
            [
                fmt_text(values.get("pattern")),
                fmt_text(case),
                fmt_text(values.get("phase")),
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
        "pattern", "case", "phase", "windows", "busbw min(GB/s)", "busbw median(GB/s)", "busbw max(GB/s)",
        "spread(%)", "skew cost min", "skew cost median", "skew cost max",
    ]  # fmt: skip
    return Table(headers, rows, text_columns={0, 1, 2}, wide=True)


def window_spread_section(frame: pd.DataFrame) -> Section | None:
    """The page's "Spread over windows" section, or None when no case ran in several windows."""
    table = window_spread_table(frame)
    return None if table is None else Section("Spread over windows", (Text(WINDOW_NOTE), table))
