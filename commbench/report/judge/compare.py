"""A run against a baseline (PASS/WARN/FAIL findings per case) and two runs side by side (Markdown or JSON).

``compare_to_baseline`` is pure: a results frame and a baseline (``report.baseline``) in, one
``BaselineFinding`` per case out, whose first eight fields are the verdict's element fields (group
"baseline").
The figure checked is busbw (GB/s, higher is better; the time where a case moves no link bytes). A case is:

- FAIL when it is more than ``fail_pct`` worse than the baseline median AND beyond the baseline's run-to-run
  spread (``spread_pct``: three scaled MADs over the baseline's repeats);
- WARN when more than ``warn_pct`` worse and beyond the spread;
- PASS otherwise; a drop past a threshold but inside the spread is PASS with the note "within run-to-run
  spread" (noise is not a finding). A baseline from one measurement has no known spread: the thresholds alone
  decide, and the message says so;
- SKIP when the baseline has no such case, the figure is missing, or the row's #wrong > 0 (its time is not a
  measurement of a correct exchange).

``compare_runs`` matches the cases of two runs (``run.case.Case``; ``baseline.find_case``); "beyond
spread?" uses the repeats' spread where both runs have two or more repeats of the case, else the timed
iterations' spread inside each run (each p50 outside the other run's [min, p99] iteration times), else
"unknown".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from commbench.plain import plain
from commbench.report.frame import results_frame
from commbench.report.judge.baseline import (
    CASE_COLUMNS,
    FIGURES,
    ReportRun,
    baseline_cases,
    figure_values,
    find_case,
    group_cases,
    robust_spread_pct,
    run_meta,
)
from commbench.report.pages.tables import fmt_text, fmt_time, format_bandwidth, format_table
from commbench.run.case import Case

GROUP = "baseline"
ELEMENT_FIELDS = ("group", "name", "status", "value", "limit", "unit", "message", "remedy")
COMPARE_SCHEMA = "commbench.compare/1"
WITHIN_SPREAD = "within run-to-run spread"
_REMEDY = (
    "rerun this case to confirm; if it repeats, look for what changed since the baseline runs (driver, NCCL "
    "and CUDA versions, NCCL_* variables, topology, GPU clocks: meta.json of both) and compare a rerun with "
    "a baseline run folder: commbench compare BASELINE_RUN THIS_RUN"
)


@dataclass(frozen=True)
class BaselineFinding:
    """One case against the baseline: the verdict element's fields, then the comparison's details."""

    group: str
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    value: float | None  # measured (median over this run's repeats of the case)
    limit: float | None  # the WARN floor (bandwidth) or ceiling (time) the status was judged against
    unit: str
    message: str
    remedy: str | None
    case: dict[str, Any] = field(default_factory=dict)  # Case.as_dict()
    figure: str | None = None
    baseline_median: float | None = None
    difference_pct: float | None = None  # (measured - baseline median) / median x 100, signed
    worse_pct: float | None = None  # how much worse, in percent of the median (negative: better)
    spread_pct: float | None = None  # the baseline's run-to-run spread; None: unknown
    beyond_spread: bool | None = None
    note: str | None = None

    def element(self) -> dict[str, Any]:
        """The verdict element: exactly ``ELEMENT_FIELDS``."""
        return {name: getattr(self, name) for name in ELEMENT_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        return plain(asdict(self))


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _figure_for(entry: Mapping[str, Any]) -> str:
    """busbw when the baseline has a positive busbw median for the case, else the time."""
    stats = entry["figures"].get("busbw_GBps") or {}
    median = stats.get("median")
    return "busbw_GBps" if isinstance(median, (int, float)) and median > 0 else "time_us"


def _skip(case: Case, message: str, **details: Any) -> BaselineFinding:
    """A case that is not judged: status SKIP, ``message`` saying why."""
    fields: dict[str, Any] = {"name": case.label, "unit": "", "value": None, **details}
    return BaselineFinding(
        group=GROUP, status="SKIP", limit=None, message=message, remedy=None, case=case.as_dict(), **fields
    )


def _judge(
    case: Case, rows: pd.DataFrame, entry: Mapping[str, Any], warn_pct: float, fail_pct: float
) -> BaselineFinding:
    figure = _figure_for(entry)
    _, unit, higher_is_better = FIGURES[figure]
    stats = entry["figures"].get(figure) or {}
    base, spread, runs = stats.get("median"), stats.get("spread_pct"), entry.get("runs", stats.get("n"))
    name = f"{case.label} {figure.split('_')[0]}"
    measured = _median(figure_values(rows, figure))
    details = dict(name=name, unit=unit, figure=figure, baseline_median=base, value=measured)
    wrong = pd.to_numeric(rows.get("wrong", pd.Series(dtype=float)), errors="coerce").fillna(0)
    if (wrong > 0).any():
        message = f"not compared: #wrong {int(wrong.sum())} (the time is not that of a correct exchange)"
        return _skip(case, message, **details)
    if measured is None or base is None or base == 0:
        return _skip(case, f"not compared: no {figure} in this run or the baseline", **details)
    sign = 1.0 if higher_is_better else -1.0
    worse = sign * 100.0 * (base - measured) / base
    difference = 100.0 * (measured - base) / base
    beyond = None if spread is None else worse > spread
    warn_limit = base * (1 - sign * warn_pct / 100.0)
    fail_limit = base * (1 - sign * fail_pct / 100.0)
    direction = "below" if difference < 0 else "above"
    spread_text = (
        f"baseline spread +-{spread:.1f}% over {stats.get('n')} repeats of {runs} run(s)"
        if spread is not None
        else f"run-to-run spread unknown (baseline has {stats.get('n')} repeat(s)): thresholds alone decide"
    )
    text = (
        f"{figure.split('_')[0]} {_fmt(measured, unit)} {unit}, {abs(difference):.1f}% {direction} the "
        f"baseline median {_fmt(base, unit)} {unit} ({spread_text})"
    )
    note = None
    if worse > fail_pct and beyond is not False:
        status, limit = "FAIL", fail_limit
    elif worse > warn_pct and beyond is not False:
        status, limit = "WARN", warn_limit
    else:
        status, limit = "PASS", warn_limit
        if worse > warn_pct:  # past a threshold, but no more than the known-good runs differ among themselves
            note = WITHIN_SPREAD
            text = f"{text}; {WITHIN_SPREAD}"
    worst = fail_pct if status == "FAIL" else warn_pct
    if status != "PASS":
        text = f"{text}; more than {worst:g}% worse"
    return BaselineFinding(
        group=GROUP,
        status=status,
        limit=limit,
        message=text,
        remedy=_REMEDY if status in ("WARN", "FAIL") else None,
        case=case.as_dict(),
        difference_pct=difference,
        worse_pct=worse,
        spread_pct=spread,
        beyond_spread=beyond,
        note=note,
        **details,
    )


def _fmt(value: float, unit: str) -> str:
    return fmt_time(value) if unit == "us" else format_bandwidth(value)


def compare_to_baseline(
    frame: pd.DataFrame, baseline: Mapping[str, Any], warn_pct: float = 5.0, fail_pct: float = 10.0
) -> list[BaselineFinding]:
    """One finding per case of ``frame`` (a results frame: rows with bytes and times; bandwidths are taken
    from ``results_frame``), then a SKIP per baseline case this run did not measure. See the module
    docstring for the rule."""
    if not (0 <= warn_pct <= fail_pct) or not all(map(math.isfinite, (warn_pct, fail_pct))):
        raise ValueError(f"need 0 <= warn_pct <= fail_pct, got {warn_pct} and {fail_pct}")
    if not frame.empty and "busbw_GBps" not in frame.columns:
        frame = results_frame(frame)
    known = baseline_cases(baseline)
    findings = []
    measured = group_cases(frame) if not frame.empty else {}
    matched: set[tuple[Any, ...]] = set()
    for case, rows in measured.values():
        entry = find_case(case, known)
        if entry is None:
            findings.append(_skip(case, "not compared: the baseline has no such case"))
        else:
            matched.add(entry["case"].key)
            findings.append(_judge(case, rows, entry, warn_pct, fail_pct))
    missing = [entry["case"] for key, entry in known.items() if key not in matched]
    findings += [_skip(case, "not compared: this run did not measure this baseline case") for case in missing]
    return findings


# -----------------------------------------------------------------------------------------------------------
# Two runs side by side


def _side(rows: pd.DataFrame) -> dict[str, Any]:
    """One run's figures of a case: medians over its repeats, the repeats' spread, the iteration times."""
    out: dict[str, Any] = {"repeats": len(rows)}
    for figure in FIGURES:
        values = figure_values(rows, figure)
        out[figure] = _median(values)
        out[f"{figure}_spread_pct"] = robust_spread_pct(values)
    for column in ("time_us_min", "time_us_p99"):
        values = pd.to_numeric(rows.get(column, pd.Series(dtype=float)), errors="coerce").dropna()
        out[column] = float(values.median()) if len(values) else None
    wrong = pd.to_numeric(rows.get("wrong", pd.Series(dtype=float)), errors="coerce")
    out["wrong"] = None if wrong.isna().all() else int(wrong.fillna(0).sum())
    return out


def _has_iteration_spread(side: dict[str, Any]) -> bool:
    """Whether a run's rows hold several timed samples of the case: window timing (one sample per rank:
    min = p50 = p99) and rows without min/p99 have none."""
    low, mid, high = side["time_us_min"], side["time_us"], side["time_us_p99"]
    return None not in (low, mid, high) and low < high


def _beyond(a: dict[str, Any], b: dict[str, Any], difference: float | None) -> tuple[bool | None, str]:
    """Whether the time differs by more than the spread, and what spread was used."""
    if a["repeats"] >= 2 and b["repeats"] >= 2:
        spreads = [s for s in (a["time_us_spread_pct"], b["time_us_spread_pct"]) if s is not None]
        if spreads and difference is not None:
            return abs(difference) > max(spreads), "repeats"
    if _has_iteration_spread(a) and _has_iteration_spread(b):
        a_outside = not b["time_us_min"] <= a["time_us"] <= b["time_us_p99"]
        b_outside = not a["time_us_min"] <= b["time_us"] <= a["time_us_p99"]
        return a_outside and b_outside, "iterations"
    return None, "unknown"


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else 100.0 * (b - a) / a


def compare_runs(run_a: ReportRun, run_b: ReportRun) -> dict[str, Any]:
    """The cases of two runs side by side (A, B, difference % of B against A, beyond spread?), and the cases
    only one run has; JSON-safe."""
    cases_a, cases_b = group_cases(run_a.frame), group_cases(run_b.frame)
    # A folder written before rows carried a model digest: its cases match on the other fields.
    old_a = any(case.model_digest is None for case, _ in cases_a.values())
    old_b = any(case.model_digest is None for case, _ in cases_b.values())
    if old_a or old_b:
        cases_a = {case.without_model_digest().key: (case, rows) for case, rows in cases_a.values()}
        cases_b = {case.without_model_digest().key: (case, rows) for case, rows in cases_b.values()}
    matched = []
    for key, (case, rows_a) in cases_a.items():
        if key not in cases_b:
            continue
        a, b = _side(rows_a), _side(cases_b[key][1])
        differences = {figure: _difference(a[figure], b[figure]) for figure in FIGURES}
        beyond, basis = _beyond(a, b, differences["time_us"])
        matched.append(
            {
                "case": case.as_dict(),
                "label": case.label,
                "a": a,
                "b": b,
                "difference_pct": differences,
                "beyond_spread": beyond,
                "spread_basis": basis,
            }
        )
    only = {
        "only_in_a": [case.as_dict() for key, (case, _) in cases_a.items() if key not in cases_b],
        "only_in_b": [case.as_dict() for key, (case, _) in cases_b.items() if key not in cases_a],
    }
    return plain(
        {
            "schema": COMPARE_SCHEMA,
            "a": {**run_meta(run_a), "incomplete": run_a.incomplete, "wrong": run_a.wrong},
            "b": {**run_meta(run_b), "incomplete": run_b.incomplete, "wrong": run_b.wrong},
            "difference": "100 x (B - A) / A, of the medians over each run's repeats of the case",
            "cases": matched,
            **only,
        }
    )


_CASE_HEADERS = {
    "pattern": "pattern",
    "model_digest": "model",
    "skew": "skew",
    "phase": "phase",
    "size_bytes": "size(B)",
    "tokens_per_rank": "tokens/rank",
    "send_mode": "send mode",
    "knobs": "knobs",
    "backend": "backend",
    "world_size": "ranks",
    "check": "check",
    "timing": "timing",
}


def _case_columns(cases: list[dict[str, Any]]) -> list[str]:
    """The case fields worth a column: those with a value somewhere, backend/ranks/check only if they vary."""
    varying_only = ("backend", "world_size", "check", "model_digest")
    columns = []
    for column in CASE_COLUMNS:
        values = {case.get(column) for case in cases}
        if values == {None} or (column in varying_only and len(values) == 1):
            continue
        columns.append(column)
    return columns


def _text_columns(columns: list[str]) -> set[int]:
    """The case columns that hold text (left-aligned); sizes, tokens and ranks line up as numbers."""
    return {
        i for i, column in enumerate(columns) if column not in ("size_bytes", "tokens_per_rank", "world_size")
    }


def _yes_no(beyond: bool | None, basis: str) -> str:
    if beyond is None:
        return "unknown"
    return f"{'yes' if beyond else 'no'} ({basis})"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _run_line(name: str, side: Mapping[str, Any]) -> str:
    state = f"; INCOMPLETE: {side['incomplete']}" if side.get("incomplete") else ""
    wrong = f"; #wrong {side['wrong']}" if side.get("wrong") else ""
    return (
        f"- {name}: `{side['path']}`: host {side.get('host') or '?'}, backend {side.get('backend')}, "
        f"{side.get('world_size')} ranks, spec {side.get('spec')}, "
        f"commbench {side.get('commbench_version') or '?'}, "
        f"{side.get('date') or 'date unknown'}{state}{wrong}"
    )


def comparison_markdown(comparison: Mapping[str, Any]) -> str:
    """``compare_runs``'s result as Markdown: the two runs, the table (through ``format_table``), the notes
    on the spread and the cases only one run has."""
    cases = comparison["cases"]
    columns = _case_columns([entry["case"] for entry in cases])
    headers = [_CASE_HEADERS[column] for column in columns] + [
        "A time(us)",
        "B time(us)",
        "time diff",
        "A busbw(GB/s)",
        "B busbw(GB/s)",
        "busbw diff",
        "beyond spread?",
    ]
    rows = []
    for entry in cases:
        a, b, diff = entry["a"], entry["b"], entry["difference_pct"]
        rows.append(
            [fmt_text(entry["case"].get(column)) for column in columns]
            + [
                fmt_time(a["time_us"]),
                fmt_time(b["time_us"]),
                _signed(diff["time_us"]),
                format_bandwidth(a["busbw_GBps"]),
                format_bandwidth(b["busbw_GBps"]),
                _signed(diff["busbw_GBps"]),
                _yes_no(entry["beyond_spread"], entry["spread_basis"]),
            ]
        )
    lines = ["# commbench compare", "", _run_line("A", comparison["a"]), _run_line("B", comparison["b"]), ""]
    lines.append(format_table(headers, rows, "markdown", text_columns=_text_columns(columns)))
    lines += [
        "",
        f"Difference: {comparison['difference']}; time: the rows' time p50 in us (window timing: "
        "window / iterations); busbw: GB/s (1e9 B/s), one direction, from that time.",
    ]
    bases = {entry["spread_basis"] for entry in cases}
    if "repeats" in bases:
        lines.append(
            "- repeats: both runs have 2 or more repeats of the case; beyond = the time differs by more "
            "than 3 scaled MADs of either run's repeats."
        )
    if "iterations" in bases:
        lines.append(
            "- iterations: one measurement per run, so the run-to-run spread is unknown; beyond = each "
            "run's p50 lies outside the other's [min, p99] iteration times (single iterations "
            "vary more than a p50 does: repeat the runs, or build a baseline of 3 or more, to know)."
        )
    if "unknown" in bases:
        lines.append(
            "- unknown: one measurement per run and no spread of timed iterations in the rows (window timing "
            "gives one time per measurement): the run-to-run spread is unknown; repeat the runs to know it."
        )
    for name, side in (("A", "only_in_a"), ("B", "only_in_b")):
        if comparison[side]:
            lines += ["", f"Only in {name} ({len(comparison[side])}):"]
            lines += [f"- {Case.from_dict(case).label}" for case in comparison[side]]
    return "\n".join(lines) + "\n"


def findings_markdown(findings: list[BaselineFinding]) -> str:
    """Baseline findings as a Markdown table (through ``format_table``)."""
    headers = ["status", "case", "figure", "measured", "baseline median", "diff", "spread", "note"]
    rows = []
    for finding in findings:
        unit = finding.unit
        rows.append(
            [
                finding.status,
                finding.name if finding.figure is None else Case.from_dict(finding.case).label,
                f"{finding.figure.split('_')[0]}({unit})" if finding.figure else "-",
                "-" if finding.value is None else _fmt(finding.value, unit),
                "-" if finding.baseline_median is None else _fmt(finding.baseline_median, unit),
                _signed(finding.difference_pct),
                "unknown" if finding.spread_pct is None else f"+-{finding.spread_pct:.1f}%",
                finding.note or ("" if finding.status != "SKIP" else finding.message),
            ]
        )
    return format_table(headers, rows, "markdown", text_columns={0, 1, 2, 7})
