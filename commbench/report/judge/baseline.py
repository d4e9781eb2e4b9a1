"""Baselines: per-case median and robust spread over known-good report folders, saved and read back as JSON.

A case is what a figure is compared across runs by: a ``run.case.Case`` (its identity fields, without the
repeat index; ``run.case`` says which fields and why). Each result row is one measurement (repeat) of its
case; a folder written with --repeat gives several. The figures (``FIGURES``) are the row's time p50 and
the busbw / algbw that ``report.frame.results_frame`` derives from it (the only place commbench computes a
bandwidth).

Per case and figure the baseline keeps every repeat's value, their median, min, max, MAD and the robust
run-to-run spread ``spread_pct`` = 100 x 3 x 1.4826 x MAD / median (three scaled MADs, ~3 standard
deviations for normal noise; one bad run of three cannot widen it much, unlike a mean or the range); null
with a single measurement (spread unknown). Report folders are read with ``report.reading``'s checked reads
(CSV and JSON only, nothing unpickled).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import commbench
from commbench.errors import UsageError
from commbench.inputs.userfiles import clip, kind_of, load_json, show_path
from commbench.plain import plain
from commbench.report.folder.claim import write_atomic
from commbench.report.folder.reading import incomplete_reason, read_report
from commbench.report.folder.writer import spec_from_meta
from commbench.report.frame import emulated_rows, results_frame
from commbench.run.case import IDENTITY, Case, cell, group_by_case
from commbench.run.config_meta import meta_values

SCHEMA = "commbench.baseline/1"
# A baseline holds a few numbers per case and repeat: 64 MiB is far beyond any real sweep.
MAX_BASELINE_BYTES = 64 << 20
# The fields of a baseline's case objects (``Case.as_dict``): the identity of ``run.case``.
CASE_COLUMNS = IDENTITY
# Figure name -> (result column, unit, True when a higher value is better).
FIGURES: dict[str, tuple[str, str, bool]] = {
    "time_us": ("time_us_p50", "us", False),
    "busbw_GBps": ("busbw_GBps", "GB/s", True),
    "algbw_GBps": ("algbw_GBps", "GB/s", True),
}
# 1.4826 x MAD estimates the standard deviation of normal noise; three of them is the noise band.
MAD_TO_SIGMA = 1.4826
SPREAD_MADS = 3.0
SPREAD_RULE = (
    "spread_pct = 100 x 3 x 1.4826 x MAD / median over the case's repeats (every run's rows); "
    "null with one measurement: run-to-run spread unknown"
)


@dataclass(frozen=True)
class ReportRun:
    """A report folder read back: its path, meta.json and results frame (bandwidths from results_frame)."""

    path: Path
    meta: dict[str, Any]
    frame: pd.DataFrame

    @property
    def incomplete(self) -> str | None:
        """Why the run stopped before every case finished, or None."""
        return incomplete_reason(self.meta)

    @property
    def wrong(self) -> int:
        """#wrong summed over the verified rows (0 when nothing was verified)."""
        if "wrong" not in self.frame.columns:
            return 0
        return int(pd.to_numeric(self.frame["wrong"], errors="coerce").fillna(0).sum())


def read_run(path: str | os.PathLike[str], known_good: bool = False) -> ReportRun:
    """A report folder, every file checked (``report.reading``); UsageError in one line for a missing folder,
    one without meta.json or results, a malformed file, and with ``known_good`` an INCOMPLETE run or one
    with #wrong > 0."""
    folder = Path(path)
    shown = show_path(folder)
    if not folder.exists():
        raise UsageError(f"report folder {shown} not found; pass a folder written by 'commbench run'")
    if not folder.is_dir():
        raise UsageError(f"{shown} is not a folder; pass a report folder written by 'commbench run'")
    if not (folder / "meta.json").is_file():
        raise UsageError(
            f"{shown} is not a commbench report folder (no meta.json); pass a 'commbench run' folder"
        )
    meta, results, _ = read_report(folder)
    frame = results_frame(results, spec_from_meta(meta, str(folder / "meta.json")))
    run = ReportRun(folder, meta, frame)
    if known_good and run.incomplete:
        raise UsageError(
            f"report folder {shown} is INCOMPLETE ({clip(run.incomplete, 120)}); a baseline takes only "
            "finished runs: pass a complete, known-good run"
        )
    if known_good and run.wrong > 0:
        raise UsageError(
            f"report folder {shown} has #wrong {run.wrong} (corrupted data); a baseline takes only "
            "known-good runs: pass one with #wrong 0"
        )
    if frame.empty:
        raise UsageError(f"report folder {shown} has no result rows; pass a run that finished some cases")
    return run


def case_of(record: Mapping[str, Any]) -> Case:
    """The case of one result row (``Case.from_row``: the repeat index is not part of it)."""
    return replace(Case.from_row(record), repeat=0)


def figure_values(rows: pd.DataFrame, figure: str) -> list[float]:
    """The finite values of ``figure`` (a ``FIGURES`` name) in ``rows``, one per measurement."""
    column = FIGURES[figure][0]
    if column not in rows.columns:
        return []
    values = pd.to_numeric(rows[column], errors="coerce").astype(float)
    return [float(value) for value in values if math.isfinite(value)]


def robust_spread_pct(values: Sequence[float]) -> float | None:
    """100 x 3 x 1.4826 x MAD / |median|: the noise band of ``values`` in percent of their median; None
    with fewer than two values or a zero median."""
    if len(values) < 2:
        return None
    median = float(np.median(values))
    if median == 0:
        return None
    mad = float(np.median(np.abs(np.asarray(values) - median)))
    return 100.0 * SPREAD_MADS * MAD_TO_SIGMA * mad / abs(median)


def figure_stats(values: Sequence[float]) -> dict[str, Any]:
    """n, median, min, max, MAD, spread_pct (robust, see ``robust_spread_pct``), range_pct and the values."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "mad": None}
    array = np.asarray(values, dtype=float)
    median = float(np.median(array))
    spread = float(array.max() - array.min())
    return {
        "n": len(values),
        "median": median,
        "min": float(array.min()),
        "max": float(array.max()),
        "mad": float(np.median(np.abs(array - median))),
        "spread_pct": robust_spread_pct(values),
        "range_pct": 100.0 * spread / abs(median) if len(values) > 1 and median else None,
        "values": [float(value) for value in array],
    }


def iteration_spread(rows: pd.DataFrame) -> dict[str, float | None]:
    """The spread of single timed iterations inside the measurements (medians over repeats): how far the p99
    and the min lie from the p50, in percent of the p50. Not a run-to-run spread: a p50 over many iterations
    varies much less than one iteration does."""
    out: dict[str, float | None] = {"p99_over_p50_pct": None, "p50_over_min_pct": None}
    if "time_us_p50" not in rows.columns:
        return out
    p50 = pd.to_numeric(rows["time_us_p50"], errors="coerce").astype(float)
    for name, column, sign in (
        ("p99_over_p50_pct", "time_us_p99", 1.0),
        ("p50_over_min_pct", "time_us_min", -1.0),
    ):
        if column in rows.columns:
            other = pd.to_numeric(rows[column], errors="coerce").astype(float)
            pct = (sign * 100.0 * (other - p50) / p50.where(p50 > 0)).dropna()
            out[name] = float(pct.median()) if len(pct) else None
    return out


def group_cases(frame: pd.DataFrame) -> dict[tuple[Any, ...], tuple[Case, pd.DataFrame]]:
    """The rows of ``frame`` by case (``run.case.group_by_case``), in first-seen order: key -> (case,
    rows)."""
    return {case.key: (case, rows) for case, rows in group_by_case(frame)}


def find_case(case: Case, table: Mapping[tuple[Any, ...], Any]) -> Any:
    """``table``'s entry for ``case`` (by ``Case.key``), or for the case without its model digest where the
    table was made from rows written before they carried one; None when neither is there."""
    entry = table.get(case.key)
    if entry is None and case.model_digest is not None:
        entry = table.get(case.without_model_digest().key)
    return entry


def run_meta(run: ReportRun) -> dict[str, Any]:
    """What a baseline keeps of a source run: path, host, world size, backend, spec, version, date."""
    meta, env, args = run.meta, run.meta.get("env") or {}, meta_values(run.meta)
    first = run.frame.iloc[0] if not run.frame.empty else {}
    spec = meta.get("spec") or {}
    versions = env.get("versions") or {}
    return plain(
        {
            "path": str(run.path),
            "host": env.get("hostname"),
            "world_size": cell(first.get("world_size")) if len(run.frame) else args.get("world_size"),
            "backend": cell(first.get("backend")) if len(run.frame) else args.get("backend"),
            "emulated": bool(emulated_rows(run.frame).any()) if "emulated" in run.frame.columns else None,
            "spec": spec.get("name"),
            "commbench_version": meta.get("commbench_version") or versions.get("commbench"),
            "versions": versions,
            "date": env.get("time_utc"),
            "command": meta.get("command") or env.get("command"),
            "rows": len(run.frame),
        }
    )


def build_baseline(runs: Sequence[ReportRun]) -> dict[str, Any]:
    """The baseline of known-good ``runs``: per case, every figure's statistics over all their repeats."""
    if not runs:
        raise UsageError("a baseline needs at least one report folder")
    cases: dict[tuple[Any, ...], dict[str, Any]] = {}
    for index, run in enumerate(runs):
        for key, (case, rows) in group_cases(run.frame).items():
            entry = cases.setdefault(key, {"case": case, "parts": [], "runs": set()})
            entry["parts"].append(rows)
            entry["runs"].add(index)
    out_cases = []
    for entry in cases.values():
        rows = pd.concat(entry["parts"], ignore_index=True)
        sizes = sorted({int(v) for v in pd.to_numeric(rows["size_bytes"], errors="coerce").dropna()})
        out_cases.append(
            {
                "case": entry["case"].as_dict(),
                "label": entry["case"].label,
                "runs": len(entry["runs"]),
                "repeats": len(rows),
                "size_bytes": sizes,
                "figures": {name: figure_stats(figure_values(rows, name)) for name in FIGURES},
                "iteration_spread": iteration_spread(rows),
            }
        )
    return plain(
        {
            "schema": SCHEMA,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commbench_version": commbench.__version__,
            "spread_rule": SPREAD_RULE,
            "figures": {
                name: {"column": column, "unit": unit, "higher_is_better": better}
                for name, (column, unit, better) in FIGURES.items()
            },
            "runs": [run_meta(run) for run in runs],
            "cases": out_cases,
        }
    )


def check_out_file(out: str | os.PathLike[str], force: bool) -> Path:
    """``out`` as a file a baseline may be written to; UsageError (nothing written) when it exists without
    ``force``, is a folder, or its folder does not exist."""
    path = Path(out)
    shown = show_path(path)
    if path.is_dir():
        raise UsageError(f"--out {shown} is a folder; pass a file name, e.g. baseline.json")
    if path.exists() and not force:
        raise UsageError(f"--out {shown} already exists; pass another file or --force to replace it")
    if not path.parent.is_dir():
        raise UsageError(f"the folder of --out {shown} does not exist; create it or pass another path")
    return path


def write_baseline(baseline: Mapping[str, Any], out: str | os.PathLike[str]) -> None:
    """The baseline as indented JSON, written atomically (a reader never sees part of it)."""
    write_atomic(out, json.dumps(plain(dict(baseline)), indent=2) + "\n")


_NOT_BASELINE = "not a commbench baseline: make one with 'commbench baseline RUN_DIR... --out FILE'"


def read_baseline(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A baseline file, bounded and checked (schema, every case and figure typed); UsageError in one line
    naming the file."""
    data, where = load_json(path, "baseline file", MAX_BASELINE_BYTES, _NOT_BASELINE)
    if not isinstance(data, dict):
        raise UsageError(f"{where} holds {kind_of(data)}, not a JSON object; {_NOT_BASELINE}")
    if data.get("schema") != SCHEMA:
        schema = clip(repr(data.get("schema")))
        raise UsageError(f"{where}: schema {schema}, expected {SCHEMA!r}; {_NOT_BASELINE}")
    for name in ("runs", "cases"):
        if not isinstance(data.get(name), list):
            raise UsageError(f"{where}: {name} must be a list; the file is damaged: make the baseline again")
    for index, entry in enumerate(data["cases"]):
        _check_case_entry(entry, f"{where}: cases[{index}]")
    return data


def _check_case_entry(entry: Any, where: str) -> None:
    damaged = "the file is damaged: make the baseline again"
    if not isinstance(entry, dict) or not isinstance(entry.get("case"), dict):
        raise UsageError(f"{where} must be an object with a 'case' object; {damaged}")
    for column, value in entry["case"].items():
        if column not in CASE_COLUMNS or not (value is None or isinstance(value, (str, int, float))):
            raise UsageError(
                f"{where}.case.{clip(str(column))} is not a case field of text or a number; {damaged}"
            )
    figures = entry.get("figures")
    if not isinstance(figures, dict):
        raise UsageError(f"{where}.figures must be an object; {damaged}")
    for name, stats in figures.items():
        if name not in FIGURES or not isinstance(stats, dict):
            raise UsageError(f"{where}.figures.{clip(str(name))} is not a known figure; {damaged}")
        for field in ("median", "min", "max", "mad", "spread_pct"):
            value = stats.get(field)
            if value is not None and (isinstance(value, bool) or not _finite(value)):
                raise UsageError(f"{where}.figures.{name}.{field} must be a finite number or null; {damaged}")
            if value is not None and value < 0:  # times, bandwidths and their spreads are never negative
                raise UsageError(f"{where}.figures.{name}.{field} is {value:g}, below 0; {damaged}")
        low, middle, high = (stats.get(field) for field in ("min", "median", "max"))
        if None not in (low, middle, high) and not low <= middle <= high:
            raise UsageError(
                f"{where}.figures.{name}: min {low:g} <= median {middle:g} <= max {high:g} does not hold; "
                f"{damaged}"
            )
        n = stats.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise UsageError(f"{where}.figures.{name}.n must be a whole number >= 0; {damaged}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def baseline_cases(baseline: Mapping[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The cases of a baseline (``read_baseline`` or ``build_baseline``) by ``Case.key``; each entry's
    ``case`` a ``Case`` (a field a baseline file lacks, such as an older file's model digest, is None)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for entry in baseline.get("cases", []):
        case = Case.from_dict(entry["case"])
        out[case.key] = {**entry, "case": case}
    return out


def read_runs(paths: Iterable[str | os.PathLike[str]], known_good: bool) -> list[ReportRun]:
    """Each report folder read with ``read_run``; UsageError for a folder named twice (it would count
    twice)."""
    runs: list[ReportRun] = []
    seen: set[Path] = set()
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen:
            raise UsageError(f"report folder {show_path(path)} is named twice; name each run once")
        seen.add(resolved)
        runs.append(read_run(path, known_good=known_good))
    return runs
