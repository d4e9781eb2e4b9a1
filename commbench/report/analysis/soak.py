"""A soak run (suite --soak DURATION) judged and drawn: each case's bandwidth drift from its first soak
rounds to its last, and bandwidth over time.

Every soak round runs the same cases (a large balanced all-to-all and the MoE dispatch/combine), each a
repeat of its case (``run.case.Case``: rounds are its ``repeat``); a case's bandwidth per round is the busbw
of ``analysis.repeats`` (balanced: mean time, MoE: p50). Drift = how much the last rounds lost against the
first: 100 x (1 - median of the last rounds / median of the first), each end the median of up to
``END_ROUNDS`` rounds (so one noisy round at either end is not a drift);
WARN above ``soak.drift_warn_pct``, FAIL above ``soak.drift_fail_pct`` (a CPU run's drift is WARN at most:
``outliers.timing_status``). A gain is never a finding. Wrong
data and health-counter increases during the soak are judged by their own groups (data, health).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from commbench.inputs.limits import Limits
from commbench.report.analysis.repeats import busbw_per_repeat
from commbench.report.judge.outliers import timing_status
from commbench.report.judge.verdict import Element
from commbench.run.case import REPEAT_COLUMN, group_by_case

END_ROUNDS = 3  # rounds at each end whose median is compared (fewer when the soak had few)
SOAK_COLUMN = "soak_s"  # seconds from the soak's start to the row's end (result rows of a soak run)
_DRIFT_REMEDY = (
    "bandwidth fell during the soak: check `nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` (throttling), "
    "`nvidia-smi nvlink -e` (errors and replays) and the health group of this verdict"
)


def is_soak(frame: pd.DataFrame) -> bool:
    """Whether ``frame`` holds the rows of a soak run."""
    return not frame.empty and SOAK_COLUMN in frame.columns and frame[SOAK_COLUMN].notna().any()


def drift_pct(values: pd.Series) -> float:
    """100 x (1 - median of the last rounds / median of the first), rounds in order."""
    values = values.dropna()
    ends = max(1, min(END_ROUNDS, len(values) // 2))
    first = float(values.iloc[:ends].median())
    last = float(values.iloc[-ends:].median())
    return 100.0 * (1.0 - last / first) if first > 0 else float("nan")


def soak_elements(frame: pd.DataFrame, limits: Limits) -> list[Element]:
    """One element per case of a soak run (group soak); [] for another run."""
    if not is_soak(frame):
        return []
    warn, fail = limits.value("soak.drift_warn_pct"), limits.value("soak.drift_fail_pct")
    elements = []
    repeat = pd.to_numeric(frame[REPEAT_COLUMN], errors="coerce") if REPEAT_COLUMN in frame else 0
    ordered = frame.assign(_round=repeat).sort_values("_round", kind="stable")
    ordered = ordered.assign(_busbw=busbw_per_repeat(ordered))
    for case, group in group_by_case(ordered):
        name = f"{case.label} drift"
        rounds = len(group)
        if rounds < 2:
            elements.append(Element("soak", name, "SKIP", f"{name}: one round only, nothing to compare"))
            continue
        drift = drift_pct(group["_busbw"])
        first, last = float(group["_busbw"].iloc[0]), float(group["_busbw"].iloc[-1])
        status = "FAIL" if drift > fail else "WARN" if drift > warn else "PASS"
        limit = fail if status == "FAIL" else warn
        change = f"{drift:.1f}% lost" if drift >= 0 else f"{-drift:.1f}% gained"
        message = (
            f"{name}: {change} over {rounds} rounds ({float(group[SOAK_COLUMN].max()):.0f} s; "
            f"busbw {first:.3g} -> {last:.3g} GB/s, ends compared as medians of up to {END_ROUNDS} rounds)"
        )
        status, message = timing_status(status, message, limits.cpu_run, planted=False)
        remedy = _DRIFT_REMEDY if status != "PASS" else ""
        elements.append(Element("soak", name, status, message, round(drift, 2), limit, "%", remedy))
    return elements


def soak_figure(frame: pd.DataFrame) -> Any:
    """busbw of every case over the soak's time (matplotlib object API), or None for another run."""
    if not is_soak(frame):
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.5))
    axes = figure.add_subplot()
    ordered = frame.assign(_busbw=busbw_per_repeat(frame)).sort_values(SOAK_COLUMN, kind="stable")
    for case, group in group_by_case(ordered):
        axes.plot(group[SOAK_COLUMN], group["_busbw"], marker="o", markersize=3, label=case.label)
    axes.set_xlabel("time since the soak started (s)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title("Soak: bandwidth per round over time")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    return figure
