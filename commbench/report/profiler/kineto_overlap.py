"""Communication time and communication/compute overlap per rank, from Kineto (torch.profiler) traces.

One trace file is one rank (Kineto writes one per process): its rank is the trace's ``distributedInfo.rank``,
else the ``rank<R>`` of its file name, else its position among the files read. Its GPU events (Chrome trace
``ph: "X"`` events of category ``kernel``, ``gpu_memcpy`` or ``gpu_memset``) are classified by
``report.kernels`` (a registry of names, not a substring), and per rank:

- comm_us: the time at least one communication event runs on any of the rank's GPU streams (the union of
  their intervals: two overlapping NCCL kernels count once);
- compute_us: the same union over every other GPU event;
- overlap_us: the time both unions cover (the intersection of the two);
- exposed_comm_us = comm_us - overlap_us; overlap_pct = 100 x overlap_us / comm_us (n/a without
  communication);
- the same per communication library (that library's union against the compute union; libraries that run
  at the same time each count that time, so their comm_us can add up to more than the rank's).

When the trace marks measured calls (``run.torch_profiler.measured``: CPU ranges named
``commbench.measured/...``), only the GPU events those calls launched count: an event whose launch (a
``cuda_runtime`` / ``cuda_driver`` event with the same ``correlation`` id) lies inside a measured range, or,
for an event whose launch is not in the trace, whose own start does. Without marks the whole trace counts
(``window`` says which). All interval arithmetic is one sort and a cumulative sum (a sweep), O(n log n).

Files are read bounded (``MAX_TRACE_BYTES``, compressed and decompressed), plain or gzip (``.json.gz``),
with the json module only; a file that is not a Chrome trace is a one-line UsageError naming it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import UsageError
from commbench.inputs.userfiles import check_json_values, read_maybe_gzip, show_path
from commbench.report.pages.render import Section, Text
from commbench.report.pages.tables import Table, fmt_float, fmt_int, fmt_pct, fmt_text
from commbench.report.profiler.kernels import COMMUNICATION, classify_event
from commbench.run.torch_profiler import MEASURED_PREFIX

# A profile of a few hundred measured iterations is tens of MiB; 512 MiB (as read and once decompressed)
# refuses a wrong file or a gzip bomb before it fills the memory json.loads needs (several times the text).
MAX_TRACE_BYTES = 512 << 20
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # CPU side of a launch: args.correlation names its event
MARK_CATEGORY = "user_annotation"  # record_function ranges on the CPU timeline
WINDOW_MEASURED, WINDOW_WHOLE = "measured", "whole trace"
_RANK_IN_NAME = re.compile(r"rank(\d+)")
_HINT = "pass a Chrome trace written by torch.profiler (export_chrome_trace) or --torch-profiler"

RANK_COLUMNS = (
    "rank", "window", "gpus", "gpu_events", "comm_events", "comm_us", "compute_us", "overlap_us",
    "exposed_comm_us", "overlap_pct", "file",
)  # fmt: skip
LIBRARY_COLUMNS = ("rank", "library", "events", "comm_us", "overlap_us", "exposed_comm_us", "overlap_pct")
KERNEL_COLUMNS = ("name", "category", "library", "kind", "events", "total_us", "ranks")


@dataclass(frozen=True)
class KinetoOverlap:
    """Per rank (``ranks``), per rank and communication library (``libraries``), and per GPU event name over
    all ranks (``kernels``: what was classified how, the largest total first)."""

    ranks: pd.DataFrame
    libraries: pd.DataFrame
    kernels: pd.DataFrame


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Chrome trace file as a dict with a ``traceEvents`` list (a bare JSON list of events is accepted as
    one); plain or gzip, bounded; UsageError naming the file when it is none."""
    data, where = read_maybe_gzip(path, "Kineto trace", MAX_TRACE_BYTES)
    check_json_values(data, where)
    try:
        trace = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, nesting deeper than the stack
        raise UsageError(f"{where}: not valid JSON ({_first_line(exc)}); {_HINT}") from None
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UsageError(f"{where}: no traceEvents list, so not a Chrome trace; {_HINT}")
    return trace


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return (lines[0] if lines else type(exc).__name__)[:120]


def trace_rank(trace: dict[str, Any], path: str | os.PathLike[str] | None, position: int) -> int:
    """The rank of a trace: distributedInfo.rank, else rank<R> in the file name, else ``position``."""
    info = trace.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
        return rank
    match = _RANK_IN_NAME.search(Path(path).name) if path is not None else None
    return int(match.group(1)) if match else position


def _numbers(events: list[dict], key: str, where: str) -> np.ndarray:
    """float64 of ``event[key]`` for each event; UsageError naming the first event without a number."""
    values = pd.to_numeric(pd.Series([event.get(key) for event in events], dtype=object), errors="coerce")
    array = values.to_numpy(dtype=np.float64, na_value=np.nan)
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        name = str(events[bad[0]].get("name"))[:80]
        raise UsageError(f"{where}: event {name!r} has no numeric {key!r}; {_HINT}")
    return array


def _args(event: dict) -> dict:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def gpu_events(trace: dict[str, Any], where: str = "trace") -> pd.DataFrame:
    """The GPU events of a trace, one row each: name, category, device, start_us, end_us, correlation (-1
    when absent), library, kind. A negative duration counts as zero."""
    events = [
        event
        for event in trace["traceEvents"]
        if isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES
    ]
    start = _numbers(events, "ts", where)
    end = start + np.maximum(_numbers(events, "dur", where), 0.0)
    names = [str(event.get("name", "")) for event in events]
    categories = [str(event["cat"]) for event in events]
    args = [_args(event) for event in events]
    cache: dict[tuple, tuple[str, str]] = {}  # each distinct name (and copy direction) classified once
    classes = []
    for category, name, arg in zip(categories, names, args, strict=True):
        key = (category, name, repr(arg.get("fromDevice")), repr(arg.get("toDevice")))  # any JSON value
        if key not in cache:
            cache[key] = classify_event(category, name, arg)
        classes.append(cache[key])
    return pd.DataFrame(
        {
            "name": names,
            "category": categories,
            "device": [_device(arg, event) for arg, event in zip(args, events, strict=True)],
            "start_us": start,
            "end_us": end,
            "correlation": [_int_or(arg.get("correlation"), -1) for arg in args],
            "library": [library for library, _ in classes],
            "kind": [kind for _, kind in classes],
        }
    )


def _int_or(value: Any, default: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _device(args: dict, event: dict) -> Any:
    """The GPU of an event: args.device (a peer copy: inDevice, the GPU that runs it), else Kineto's pid."""
    pid = _int_or(event.get("pid"), repr(event.get("pid")))
    return _int_or(args.get("device"), _int_or(args.get("inDevice"), pid))


def measured_windows(trace: dict[str, Any], where: str = "trace") -> np.ndarray:
    """float64 [n, 2]: the disjoint, sorted [start, end] microsecond ranges of the measured-call marks."""
    marks = [
        event
        for event in trace["traceEvents"]
        if isinstance(event, dict)
        and event.get("ph") == "X"
        and event.get("cat") == MARK_CATEGORY
        and str(event.get("name", "")).startswith(MEASURED_PREFIX)
    ]
    start = _numbers(marks, "ts", where)
    return union_segments(start, start + np.maximum(_numbers(marks, "dur", where), 0.0))


def union_segments(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The union of intervals as disjoint sorted [start, end] rows (touching intervals merge)."""
    if len(starts) == 0:
        return np.empty((0, 2), dtype=np.float64)
    order = np.argsort(starts)  # ties need no order: equal starts merge
    starts, ends = np.asarray(starts, np.float64)[order], np.asarray(ends, np.float64)[order]
    reach = np.maximum.accumulate(ends)  # the furthest end so far
    opens = np.ones(len(starts), dtype=bool)
    opens[1:] = starts[1:] > reach[:-1]  # a new segment starts past everything before it
    first = np.flatnonzero(opens)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return np.column_stack([starts[first], reach[last]])


def _inside(points: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """bool per point: inside one of the disjoint sorted ``windows`` (ends included)."""
    if len(windows) == 0:
        return np.zeros(len(points), dtype=bool)
    index = np.searchsorted(windows[:, 0], points, side="right") - 1
    clipped = np.maximum(index, 0)
    return (index >= 0) & (points <= windows[clipped, 1])


def select_measured(events: pd.DataFrame, trace: dict[str, Any], windows: np.ndarray) -> pd.DataFrame:
    """The GPU events the measured calls launched (see the module docstring)."""
    launches = [
        event
        for event in trace["traceEvents"]
        if isinstance(event, dict)
        and event.get("cat") in LAUNCH_CATEGORIES
        and isinstance(_args(event).get("correlation"), int)
        and isinstance(event.get("ts"), int | float)
    ]
    ids = np.array([_args(event)["correlation"] for event in launches], dtype=np.int64)
    launched_at = np.array([event["ts"] for event in launches], dtype=np.float64)
    in_window = ids[_inside(launched_at, windows)]
    correlation = events["correlation"].to_numpy(dtype=np.int64)
    launched_inside = np.isin(correlation, in_window)
    no_launch = ~np.isin(correlation, ids)  # a launch the trace lacks: judge the event by its own start
    started_inside = _inside(events["start_us"].to_numpy(), windows)
    return events[launched_inside | (no_launch & started_inside)]


def covered_time(
    a_starts: np.ndarray, a_ends: np.ndarray, b_starts: np.ndarray, b_ends: np.ndarray
) -> tuple[float, float, float]:
    """(time covered by set A, time covered by set B, time covered by both) of two sets of intervals, each
    possibly overlapping itself: one sort of all boundaries, then a running count per set."""
    positions = np.concatenate([a_starts, a_ends, b_starts, b_ends]).astype(np.float64)
    if positions.size == 0:
        return 0.0, 0.0, 0.0
    na, nb = len(a_starts), len(b_starts)
    step_a = np.concatenate([np.ones(na), -np.ones(na), np.zeros(2 * nb)])
    step_b = np.concatenate([np.zeros(2 * na), np.ones(nb), -np.ones(nb)])
    order = np.argsort(positions)  # ties need no order: the gap between them is 0
    gaps = np.diff(positions[order])  # gap i lies between boundary i and boundary i + 1
    in_a = np.cumsum(step_a[order])[:-1] > 0
    in_b = np.cumsum(step_b[order])[:-1] > 0
    return float(gaps[in_a].sum()), float(gaps[in_b].sum()), float(gaps[in_a & in_b].sum())


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else float("nan")


def _round(value: float) -> float:
    return round(value, 3)  # Kineto's timestamps are whole nanoseconds


def rank_overlap(
    trace: dict[str, Any], rank: int, where: str = "trace"
) -> tuple[dict, list[dict], pd.DataFrame]:
    """(the rank's row, its per-library rows, its counted GPU events) of one trace."""
    events = gpu_events(trace, where)
    windows = measured_windows(trace, where)
    if len(windows):
        events = select_measured(events, trace, windows)
    is_comm = (events["kind"] == COMMUNICATION).to_numpy()
    start, end = events["start_us"].to_numpy(), events["end_us"].to_numpy()
    compute_start, compute_end = start[~is_comm], end[~is_comm]
    comm_us, compute_us, overlap_us = covered_time(start[is_comm], end[is_comm], compute_start, compute_end)
    row = {
        "rank": rank,
        "window": WINDOW_MEASURED if len(windows) else WINDOW_WHOLE,
        "gpus": int(events["device"].nunique()),
        "gpu_events": len(events),
        "comm_events": int(is_comm.sum()),
        "comm_us": _round(comm_us),
        "compute_us": _round(compute_us),
        "overlap_us": _round(overlap_us),
        "exposed_comm_us": _round(comm_us - overlap_us),
        "overlap_pct": _pct(overlap_us, comm_us),
    }
    libraries = []
    comm_libraries = events["library"].to_numpy()[is_comm]
    comm_start, comm_end = start[is_comm], end[is_comm]
    for library in sorted(set(comm_libraries)):
        mine = comm_libraries == library
        lib_us, _, lib_overlap = covered_time(comm_start[mine], comm_end[mine], compute_start, compute_end)
        libraries.append(
            {
                "rank": rank,
                "library": library,
                "events": int(mine.sum()),
                "comm_us": _round(lib_us),
                "overlap_us": _round(lib_overlap),
                "exposed_comm_us": _round(lib_us - lib_overlap),
                "overlap_pct": _pct(lib_overlap, lib_us),
            }
        )
    return row, libraries, events.assign(rank=rank)


def overlap_from_traces(paths: Sequence[str | os.PathLike[str]]) -> KinetoOverlap:
    """Read each trace file (one per rank) and measure it; ranks in rank order. UsageError when two files
    claim the same rank."""
    rows: list[dict] = []
    libraries: list[dict] = []
    counted: list[pd.DataFrame] = []
    seen: dict[int, str] = {}
    for position, path in enumerate(paths):
        where = f"Kineto trace {show_path(path)}"
        trace = load_trace(path)
        rank = trace_rank(trace, path, position)
        if rank in seen:
            raise UsageError(f"{where}: rank {rank} again (also {seen[rank]}); pass one trace per rank")
        seen[rank] = show_path(path)
        row, library_rows, events = rank_overlap(trace, rank, where)
        rows.append({**row, "file": Path(path).name})
        libraries.extend(library_rows)
        counted.append(events)
    ranks = pd.DataFrame(rows, columns=list(RANK_COLUMNS)).sort_values("rank", kind="stable")
    by_library = pd.DataFrame(libraries, columns=list(LIBRARY_COLUMNS)).sort_values(["rank", "library"])
    return KinetoOverlap(
        ranks.reset_index(drop=True), by_library.reset_index(drop=True), _kernel_summary(counted)
    )


def _kernel_summary(counted: Iterable[pd.DataFrame]) -> pd.DataFrame:
    frames = [frame for frame in counted if len(frame)]
    if not frames:
        return pd.DataFrame(columns=list(KERNEL_COLUMNS))
    events = pd.concat(frames, ignore_index=True)
    events["duration_us"] = events["end_us"] - events["start_us"]
    summary = events.groupby(["name", "category", "library", "kind"], as_index=False, sort=False).agg(
        events=("duration_us", "size"), total_us=("duration_us", "sum"), ranks=("rank", "nunique")
    )
    summary["total_us"] = summary["total_us"].round(3)
    summary = summary.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)
    return summary[list(KERNEL_COLUMNS)]


def trace_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The rank<R>.json(.gz) files of a folder (<out_dir>/kineto), in rank order; UsageError if none."""
    base = Path(folder)
    if not base.is_dir():
        raise UsageError(f"Kineto trace folder {show_path(base)} not found; pass <report>/kineto")
    files = [
        path
        for path in base.iterdir()
        if path.is_file() and re.fullmatch(r"rank\d+\.json(?:\.gz)?", path.name)
    ]
    if not files:
        raise UsageError(f"Kineto trace folder {show_path(base)} holds no rank<R>.json traces; {_HINT}")
    return sorted(files, key=lambda path: int(_RANK_IN_NAME.match(path.name).group(1)))  # type: ignore[union-attr]


def overlap_from_folder(folder: str | os.PathLike[str]) -> KinetoOverlap:
    """``overlap_from_traces`` of every rank<R>.json(.gz) in ``folder``."""
    return overlap_from_traces(trace_files(folder))


def _library_cell(libraries: pd.DataFrame, rank: int) -> str:
    mine = libraries[libraries["rank"] == rank]
    return ", ".join(f"{row.library} {row.comm_us:.1f}" for row in mine.itertuples()) or "-"


def overlap_table(result: KinetoOverlap) -> Table:
    """The per-rank table of the report: times in us, overlap in %, and each library's communication us."""
    headers = ["rank", "window", "comm(us)", "compute(us)", "overlap(us)", "exposed comm(us)", "overlap(%)",
               "comm by library (us)"]  # fmt: skip
    time = fmt_float(1)
    cells = [
        [
            fmt_int(row.rank),
            fmt_text(row.window),
            time(row.comm_us),
            time(row.compute_us),
            time(row.overlap_us),
            time(row.exposed_comm_us),
            fmt_pct(row.overlap_pct),
            _library_cell(result.libraries, row.rank),
        ]
        for row in result.ranks.itertuples()
    ]
    return Table(headers, cells, text_columns=(1, 7), wide=True)


KINETO_NOTE = (
    "torch.profiler (Kineto) traces of every rank's measured calls (kineto/rank<R>.json; load them in "
    "ui.perfetto.dev). Kernels are classified as communication by a registry of names (NCCL, NVSHMEM, "
    "commbench's put and wait kernels, torch symm_mem all_to_all_vdev, DeepEP, pplx; peer-to-peer copies), "
    "not by a substring; everything else is compute. comm / compute = the union of their kernels' time on "
    "the GPU; overlap = the time both ran at once; exposed = communication not hidden behind compute."
)


def overlap_section(result: KinetoOverlap) -> Section:
    """The page's torch.profiler section: communication time and its overlap with compute per rank."""
    ranks = result.ranks
    if ranks.empty or not (pd.to_numeric(ranks.get("gpu_events"), errors="coerce").fillna(0) > 0).any():
        shown: Table | Text = Text(
            "No GPU kernel in the traces (a CPU run): nothing to classify; the traces hold the CPU ops."
        )
    else:
        shown = overlap_table(result)
    title = "Communication kernels and their overlap with compute (torch.profiler)"
    return Section(title, (Text(KINETO_NOTE), shown))
