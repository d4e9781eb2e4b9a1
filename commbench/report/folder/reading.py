"""A saved report folder read back with every file checked before anything is rendered or written.

``read_report`` refuses, with one line naming the file (UsageError, exit 2), a folder whose files are cut or
malformed:

- every file is read bounded (``MAX_META_BYTES``, ``MAX_CSV_BYTES``), must be a regular file and UTF-8 text;
  nothing is unpickled (CSV and JSON only);
- meta.json: a JSON object whose known keys (``args``, ``env``, ``topology``, ``spec``, ``system_spec``,
  ``status``, ...) have the types commbench writes;
- results.csv and ranks.csv: whole rows (the last line ends with a line break, every row has the header's
  number of fields, quotes closed), unique column names, the required columns, non-empty ``pattern`` and
  ``phase``, and numbers in numeric columns (finite; whole numbers within int64 in byte, count and rank
  columns). Empty cells are missing values (a balanced row has no skew, mock's #wrong is n/a).

Only empty cells read as missing: text such as "n/a" or "None" stays text, as the run wrote it. Every column
comes back typed once, here (``typed_rows``): text columns as text ("" where nothing is "", e.g. no knobs),
numbers as numbers, ``emulated`` as a bool; the pages are rendered from this read-back alone, at the end of a
run and on a re-render alike, so both write the same files.

``read_folder`` reads a whole folder at once (``ReportFolder``): meta.json, results.csv, ranks.csv, the
tables beside them (pairs.csv, health.csv, the profiler's profile.csv, arrivals.csv and peers.csv), the
torch.profiler traces under kineto/ and verdict.json.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import UsageError
from commbench.inputs.userfiles import clip, decode_user_text, kind_of, load_json, read_user_bytes, show_path
from commbench.plain import is_missing, knobs_text
from commbench.report.judge.pairs import PAIRS_FILE
from commbench.report.judge.verdict import VERDICT_FILE, Verdict, read_verdict_json
from commbench.report.profiler.profile import ARRIVALS_FILE, PEERS_FILE, PROFILE_FILE

# meta.json holds the environment and the layout (a few KiB; ~100 bytes per rank): 32 MiB is ~300,000 ranks.
MAX_META_BYTES = 32 << 20
# ~1 KiB per result row and ~300 bytes per rank row: 256 MiB is a 1,000-rank run of ~800 phases.
MAX_CSV_BYTES = 256 << 20

_DAMAGED = "the file is cut or damaged: restore it or run the benchmark again"

# Text columns the harness writes: text in every frame, even where no row has a value (a balanced
# all-to-all has no skew), so that pandas never guesses their type from the values at hand.
TEXT_COLUMNS = (
    "pattern",
    "phase",
    "backend",
    "backend_name",
    "skew",
    "send_mode",
    "dispatch_dtype",
    "model_digest",  # hex digits: "123456789012" or "12e345678901" must not read back as a number
    "layout_source",
    "nvlink_bottleneck_dir",
    "scaleout_bottleneck_dir",
    "check",
    "knobs",
    "spec_name",
)
# Text columns whose "nothing" is "" (no knobs; a link class that carries nothing has no direction), never a
# missing value: an empty CSV cell cannot tell the two apart, and the harness writes "".
EMPTY_AS_TEXT = ("knobs", "nvlink_bottleneck_dir", "scaleout_bottleneck_dir")
_NUMBER_TYPES = (int, float, np.integer, np.floating)
HEALTH_FILE = "health.csv"
KINETO_FOLDER = "kineto"


def _missing(value: Any) -> bool:
    """An empty cell: None or NaN (or pd.NA)."""
    return is_missing(value) or value is pd.NA


def typed_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The columns of rows read from a CSV, typed once:

    - ``knobs``: "k=v k=v" text (``plain.knobs_text``), "" for none;
    - ``TEXT_COLUMNS``: text (pandas' text dtype), missing values missing, "" in ``EMPTY_AS_TEXT`` columns;
    - ``emulated``: a bool (True / False cells; missing only where an older file left it empty);
    - any other column pandas left as objects: bools where its cells are True / False, else the text of each
      cell (a knob that is 4 in one row and "auto" in another); missing values None.

    Columns pandas already holds as numbers, booleans or text keep their type. ``frame`` itself is changed
    and returned."""
    text_dtype = pd.Series([""]).dtype  # this pandas' text dtype: "str" (pandas 3), object (pandas 2)
    for column in frame.columns:
        values = frame[column]
        if column == "knobs":
            frame[column] = pd.Series([knobs_text(v) for v in values], index=frame.index, dtype=text_dtype)
        elif column in TEXT_COLUMNS:
            frame[column] = _text(values, "" if column in EMPTY_AS_TEXT else None, text_dtype)
        elif values.dtype == object:
            frame[column] = _objects(values, text_dtype)
    return frame


def _text(values: pd.Series, empty: str | None, text_dtype: Any) -> pd.Series:
    """``values`` as text, missing values ``empty`` (None: missing)."""
    if values.dtype == text_dtype and not pd.api.types.is_object_dtype(values):  # pandas 3 text: fill gaps
        return values if empty is None else values.fillna(empty)
    cells = [empty if _missing(value) else str(value) for value in values]
    return pd.Series(cells, index=values.index, dtype=text_dtype)


def _objects(values: pd.Series, text_dtype: Any) -> pd.Series:
    """A column of Python objects that is not one of the harness's text columns (a backend's knob column,
    a number column that is None in every row), as its CSV cells read back."""
    cells = [None if _missing(value) else value for value in values]
    present = [value for value in cells if value is not None]
    if all(isinstance(value, _NUMBER_TYPES) and not isinstance(value, (bool, np.bool_)) for value in present):
        numbers = pd.to_numeric(pd.Series(cells, index=values.index, dtype=object))
        return values if numbers.dtype == object else numbers  # whole numbers beyond int64 stay as they are
    if all(isinstance(value, (bool, np.bool_)) for value in present):
        return pd.Series(cells, index=values.index, dtype=object if len(present) < len(cells) else bool)
    if not all(isinstance(value, str) for value in present):
        cells = [None if value is None else str(value) for value in cells]
    return pd.Series(cells, index=values.index, dtype=text_dtype)


# Text columns (TEXT_COLUMNS) are read as text, exactly as written; these may not be empty.
_NON_EMPTY = ("pattern", "phase")
RESULT_COLUMNS = (
    "pattern",
    "phase",
    "size_bytes",
    "time_us_p50",
    "max_send_link_bytes",
    "max_recv_link_bytes",
)
RANK_COLUMNS = ("pattern", "phase", "rank")

_WHOLE_NAMES = frozenset(
    (
        "world_size",
        "tokens_per_rank",
        "topk",
        "hidden",
        "seed",
        "warmup",
        "iters",
        "row_bytes",
        "num_domains",
        "ranks_per_domain",
        "wrong",
        "rank",
        "domain",
        "host",
        "repeat",
        "job_index",
    )
)
# Columns renamed since earlier folders were written (old name -> new): the repeat index of a case was
# "window", the imbalance-cost reference "balanced_*". Old folders read back under the new names.
RENAMED_COLUMNS = {
    "window": "repeat",
    "balanced_size_bytes": "uniform_ref_size_bytes",
    "balanced_total_bytes": "uniform_ref_total_bytes",
    "balanced_time_us_p50": "uniform_ref_time_us_p50",
}
_WHOLE_SUFFIXES = ("_bytes", "_bottleneck_rank")
_NUMBER_NAMES = frozenset(
    ("expert_max_mean", "maxvio", "expert_cv", "skew_cost", "skew_bw_loss_pct", "pct_spec", "pct_agg_spec")
)
_NUMBER_SUFFIXES = ("_GBps", "_pct_spec", "_us_min", "_us_p50", "_us_p99", "_us_mean")
_INT64_LIMIT = 2.0**63

_NULL = type(None)
# Known keys of meta.json and the types commbench writes there (null: the pages treat it as absent).
_META_TYPES: dict[str, tuple[type, ...]] = {
    "commbench_version": (str, _NULL),
    "subcommand": (str, _NULL),
    "args": (dict, _NULL),  # folders of earlier versions
    "config": (dict, _NULL),
    "plan": (dict, _NULL),
    "acceptance": (dict, _NULL),
    "backend_choice": (str, _NULL),
    "launcher": (str, _NULL),
    "argv": (list,),
    "command": (str, _NULL),
    "env": (dict, _NULL),
    "topology": (dict, _NULL),
    "spec": (dict, _NULL),
    "system_spec": (dict, _NULL),
    "status": (str,),
    "incomplete_reason": (str, _NULL),
}
_ENV_TYPES: dict[str, tuple[type, ...]] = {
    "versions": (dict, _NULL),
    "devices": (list, _NULL),
    "nvml": (dict, _NULL),
    "env_vars": (dict, _NULL),
    "argv": (list, _NULL),
}
_TOPOLOGY_TYPES: dict[str, tuple[type, ...]] = {"description": (str, _NULL), "method": (str, _NULL)}
STATUSES = ("complete", "incomplete")


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json of a report folder, checked (see the module docstring); UsageError naming the file."""
    meta, where = load_json(path, "report file", MAX_META_BYTES, _DAMAGED, prefix="cannot read ")
    if not isinstance(meta, dict):
        raise UsageError(f"{where} is not a JSON object (it holds {kind_of(meta)}); {_DAMAGED}")
    _check_types(meta, _META_TYPES, where, "")
    _check_types(meta.get("env") or {}, _ENV_TYPES, where, "env.")
    _check_types(meta.get("topology") or {}, _TOPOLOGY_TYPES, where, "topology.")
    env = meta.get("env") or {}
    for name in ("argv",):
        for key, values in ((name, meta.get(name)), (f"env.{name}", env.get(name))):
            if isinstance(values, list) and not all(isinstance(value, str) for value in values):
                raise UsageError(f"{where}: {key} must be a list of text; {_DAMAGED}")
    devices = env.get("devices") or []
    if not all(isinstance(device, dict) for device in devices):
        raise UsageError(f"{where}: env.devices must be a list of JSON objects; {_DAMAGED}")
    if "status" in meta and meta["status"] not in STATUSES:
        raise UsageError(
            f"{where}: status must be one of {', '.join(STATUSES)}, got {clip(repr(meta['status']))}; "
            f"{_DAMAGED}"
        )
    return meta


def incomplete_reason(meta: Mapping[str, Any]) -> str | None:
    """Why a stopped run's report is incomplete (meta.json ``status`` "incomplete"), or None for a run that
    finished."""
    if meta.get("status") != "incomplete":
        return None
    reason = meta.get("incomplete_reason")
    return reason if isinstance(reason, str) and reason else "the run stopped before every case finished"


def _check_types(values: dict[str, Any], types: dict[str, tuple[type, ...]], where: str, prefix: str) -> None:
    for key, allowed in types.items():
        if key in values and not isinstance(values[key], allowed):
            wanted = " or ".join(_TYPE_WORDS[kind] for kind in allowed)
            raise UsageError(
                f"{where}: {prefix}{key} must be {wanted}, got {kind_of(values[key])}; {_DAMAGED}"
            )


_TYPE_WORDS = {str: "text", dict: "a JSON object", list: "a list", _NULL: "null"}


def read_rows(path: str | os.PathLike[str], required: Sequence[str] = RESULT_COLUMNS) -> pd.DataFrame:
    """One CSV of a report folder (results.csv, ranks.csv), checked (see the module docstring) and read as
    the run wrote it; UsageError naming the file and the line."""
    where = f"report file {show_path(path)}"
    text = decode_user_text(read_user_bytes(path, "report file", MAX_CSV_BYTES), where)
    header, lines = _whole_rows(text, where)
    missing = [column for column in required if column not in header]
    if missing:
        raise UsageError(
            f"{where}: the rows lack column(s) {', '.join(missing)}; not a commbench results file?"
        )
    frame = pd.read_csv(
        io.StringIO(text),
        keep_default_na=False,
        na_values=[""],
        dtype={column: str for column in TEXT_COLUMNS if column in header},
    )
    frame = renamed_columns(frame)
    for column in _NON_EMPTY:
        if column in frame.columns and frame[column].isna().any():
            line = lines[int(np.flatnonzero(frame[column].isna().to_numpy())[0])]
            raise UsageError(f"{where}: line {line} has no {column}; {_DAMAGED}")
    if "emulated" in frame.columns and not pd.api.types.is_bool_dtype(frame["emulated"]):
        flags = frame["emulated"]
        bad = flags.notna() & ~flags.astype(str).isin(("True", "False"))
        if bad.any():
            index = int(np.flatnonzero(bad.to_numpy())[0])
            raise UsageError(
                f"{where}: line {lines[index]}, column emulated: {clip(str(flags.iloc[index]))!r} is not "
                f"True or False; {_DAMAGED}"
            )
    for column in frame.columns:
        whole = column in _WHOLE_NAMES or column.endswith(_WHOLE_SUFFIXES)
        if whole or column in _NUMBER_NAMES or column.endswith(_NUMBER_SUFFIXES):
            frame[column] = _numbers(frame[column], whole, where, lines)
    return typed_rows(frame)


def renamed_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the columns of an earlier folder under their current names (``RENAMED_COLUMNS``)."""
    old = {name: new for name, new in RENAMED_COLUMNS.items() if name in frame.columns}
    return frame.rename(columns=old) if old and not set(old.values()) & set(frame.columns) else frame


def read_table(path: str | os.PathLike[str], required: Sequence[str]) -> pd.DataFrame:
    """A table a run wrote beside results.csv (pairs.csv, health.csv): bounded, UTF-8, whole rows, the
    ``required`` columns present; cells as pandas reads them (numbers where a column holds numbers).
    UsageError naming the file."""
    where = f"report file {show_path(path)}"
    text = decode_user_text(read_user_bytes(path, "report file", MAX_CSV_BYTES), where)
    header, _ = _whole_rows(text, where)
    missing = [column for column in required if column not in header]
    if missing:
        raise UsageError(f"{where}: the rows lack column(s) {', '.join(missing)}; {_DAMAGED}")
    try:
        return renamed_columns(pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""]))
    except (ValueError, pd.errors.ParserError) as exc:
        raise UsageError(f"{where}: {clip(str(exc))}; {_DAMAGED}") from None


def _whole_rows(text: str, where: str) -> tuple[list[str], list[int]]:
    """(header, the line each row ends on) of CSV ``text`` whose rows are all whole; UsageError otherwise."""
    if not text.strip():
        raise UsageError(f"{where} is empty; {_DAMAGED}")
    if not text.endswith("\n"):
        raise UsageError(f"{where}: the last row is cut (no line break after it); {_DAMAGED}")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    lines: list[int] = []
    try:
        header = next(reader)
        if len(set(header)) != len(header) or not all(header):
            raise UsageError(f"{where}: the header repeats a column name or has an empty one; {_DAMAGED}")
        for record in reader:
            if len(record) != len(header):
                raise UsageError(
                    f"{where}: line {reader.line_num} has {len(record)} fields, the header {len(header)}; "
                    f"{_DAMAGED}"
                )
            lines.append(reader.line_num)
    except csv.Error as exc:
        problem = clip(str(exc))
        raise UsageError(f"{where}: bad CSV at line {reader.line_num} ({problem}); {_DAMAGED}") from None
    return header, lines


def _numbers(values: pd.Series, whole: bool, where: str, lines: list[int]) -> pd.Series:
    """A numeric column as numbers, unchanged where it already is; UsageError at the first cell that is not
    a finite number (a whole number within int64 where ``whole``)."""
    if pd.api.types.is_bool_dtype(values):
        return values
    parsed = pd.api.types.is_numeric_dtype(values)  # pandas read the column as numbers: nothing to convert
    numbers = values if parsed else pd.to_numeric(values, errors="coerce")
    as_float = numbers.astype(float)
    bad = np.isinf(as_float)
    if not parsed:  # a cell pandas could not read as a number; text "nan" is a missing value, as in pandas
        text = values.astype(str).str.strip().str.lower()
        bad |= values.notna() & as_float.isna() & (text != "nan")
    wanted = "a number"
    if whole:
        finite = as_float.where(np.isfinite(as_float))
        bad |= (finite.abs() >= _INT64_LIMIT) | (finite % 1 != 0) & finite.notna()
        wanted = "a whole number"
    if bad.any():
        index = int(np.flatnonzero(bad.to_numpy())[0])
        shown = clip(str(values.iloc[index]))
        raise UsageError(
            f"{where}: line {lines[index]}, column {clip(str(values.name))}: {shown!r} is not {wanted}; "
            f"{_DAMAGED}"
        )
    return values if parsed else numbers


def read_report(
    out_dir: str | os.PathLike[str], stopped: bool = False
) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """(meta, results rows, rank rows) of a report folder, as written, every file checked; UsageError naming
    the file. A stopped run (``stopped``, or meta.json status "incomplete") may have no results.csv yet, and
    a run of the pairwise link test alone (pairs.csv) has none: no rows."""
    path = Path(out_dir)
    meta_path = path / "meta.json"
    meta = read_meta(meta_path) if meta_path.exists() else {}
    results_csv = path / "results.csv"
    if results_csv.exists():
        results = read_rows(results_csv, RESULT_COLUMNS)
    elif stopped or meta.get("status") == "incomplete" or (meta and (path / "pairs.csv").is_file()):
        results = pd.DataFrame()
    else:
        raise UsageError(f"{str(results_csv)!r} not found; pass a report folder written by 'commbench run'")
    ranks_csv = path / "ranks.csv"
    ranks = read_rows(ranks_csv, RANK_COLUMNS) if ranks_csv.exists() else pd.DataFrame()
    return meta, results, ranks


@dataclass(frozen=True)
class ExtraTables:
    """What a run wrote beside results.csv and ranks.csv (empty frames when it did not)."""

    pairs: pd.DataFrame = field(default_factory=pd.DataFrame)  # the pairwise link test: pairs.csv
    health: pd.DataFrame = field(default_factory=pd.DataFrame)  # GPU health before and after: health.csv
    profile: pd.DataFrame = field(default_factory=pd.DataFrame)  # --profile: profile.csv
    arrivals: pd.DataFrame = field(default_factory=pd.DataFrame)  # arrivals.csv
    peers: pd.DataFrame = field(default_factory=pd.DataFrame)  # peers.csv
    kineto: Any = None  # --torch-profiler: profiler.kineto_overlap.KinetoOverlap of kineto/rank<R>.json


# The profiler's long tables, appended as phases finish: file -> ExtraTables field.
EXTRA_APPENDED = {PROFILE_FILE: "profile", ARRIVALS_FILE: "arrivals", PEERS_FILE: "peers"}
# The tables written whole (replaced by a later write): file -> ExtraTables field.
EXTRA_WHOLE = {PAIRS_FILE: "pairs", HEALTH_FILE: "health"}
_EXTRA_REQUIRED = {
    PAIRS_FILE: ("test", "src", "dst", "size_bytes", "time_us", "link_class"),
    HEALTH_FILE: ("rank", "host", "device"),
    PROFILE_FILE: ("phase", "rank", "iteration", "step", "us"),
    ARRIVALS_FILE: ("phase", "rank", "iteration", "entered_us", "waited_us"),
    PEERS_FILE: ("phase", "src", "dst", "iteration", "seen_us"),
}


def read_extra_tables(out_dir: str | os.PathLike[str]) -> ExtraTables:
    """The tables beside results.csv (pairs.csv, health.csv, profile.csv, arrivals.csv, peers.csv) and the
    kineto/ traces of a report folder, each checked as results.csv is (UsageError naming the file)."""
    folder = Path(out_dir)
    tables = {
        name: read_table(folder / file, _EXTRA_REQUIRED[file])
        if (folder / file).is_file()
        else pd.DataFrame()
        for file, name in {**EXTRA_WHOLE, **EXTRA_APPENDED}.items()
    }
    return ExtraTables(kineto=read_kineto(folder), **tables)


def read_kineto(folder: str | os.PathLike[str]) -> Any:
    """The overlap analysis of a folder's kineto/ traces, or None when it has none."""
    from commbench.report.profiler.kineto_overlap import overlap_from_folder, trace_files

    traces = Path(folder) / KINETO_FOLDER
    if not traces.is_dir() or not trace_files(traces):
        return None
    return overlap_from_folder(traces)


def read_saved_verdict(out_dir: str | os.PathLike[str]) -> Verdict | None:
    """The folder's verdict.json read back, or None when it has none."""
    path = Path(out_dir) / VERDICT_FILE
    return read_verdict_json(path) if path.is_file() else None


@dataclass(frozen=True)
class ReportFolder:
    """Every file of a report folder read back and checked: what the pages are rendered from."""

    path: Path
    meta: dict[str, Any]
    results: pd.DataFrame  # results.csv as written (bytes and times; no bandwidth column trusted)
    ranks: pd.DataFrame  # ranks.csv
    extras: ExtraTables
    verdict: Verdict | None  # verdict.json, None when the folder has none


def read_folder(out_dir: str | os.PathLike[str], stopped: bool = False) -> ReportFolder:
    """Every file of a report folder (meta.json, results.csv, ranks.csv, ``ExtraTables``, verdict.json), each
    checked before anything is rendered; UsageError naming the first file that is refused. ``stopped``: a
    run being finished as stopped (it may have no results.csv)."""
    meta, results, ranks = read_report(out_dir, stopped)
    extras = read_extra_tables(out_dir)
    return ReportFolder(Path(out_dir), meta, results, ranks, extras, read_saved_verdict(out_dir))
