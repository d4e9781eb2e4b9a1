"""Each dispatcher library's bandwidth vocabulary beside commbench's: the conversion table, and every row's
figure "as the library prints it", computed from the row's bytes and times (``frame.gbps``, the one formula).

A library's figure is not busbw: DeepEP's normal kernels count every token row a rank received, its own
included, over the dispatch call; its low-latency test counts selections over the kernel alone; pplx-kernels
and NCCL EP pick their own bytes (each backend class's ``bandwidth_vocabulary`` says which, per library and
mode; the adapters' are in ``backends.adapters.bandwidth``). The pages
show both so a user can match the library's own printout: ``library_figures`` (one row per figure),
``with_library_columns`` (two columns beside busbw) and ``vocabulary_table`` (the table of definitions).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from commbench.report.frame import gbps
from commbench.report.knobs import knob_setting
from commbench.report.pages.tables import format_table
from commbench.run.case import CASE_FIELDS
from commbench.run.describe import LibraryBandwidth

FIGURE_COLUMNS = ("library_figure", "library_GBps")
VOCABULARY_HEADERS = (
    "backend",
    "mode",
    "phase",
    "library figure",
    "bytes the library counts",
    "time it divides by",
    "from commbench's row",
)
# A figure's row names its case by the case columns (``run.case.CASE_FIELDS``) the frame has.
_CASE_COLUMNS = CASE_FIELDS


def definitions(backend_name: str) -> tuple[LibraryBandwidth, ...]:
    """The library figures of ``backend_name``: its class's ``bandwidth_vocabulary`` (the class loaded
    lazily, a plug-in's as a built-in's); () for a backend without one (nccl, gloo, ...), an unknown name or
    a class that does not load."""
    from commbench.backends import ENTRIES, load_backend

    if backend_name not in ENTRIES:
        return ()
    backend_class, _ = load_backend(backend_name)
    declared = getattr(backend_class, "bandwidth_vocabulary", ()) or ()
    return tuple(item for item in declared if isinstance(item, LibraryBandwidth))


def _number(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame.columns:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def library_bytes(frame: pd.DataFrame, item: LibraryBandwidth) -> pd.Series:
    """Per row, the bytes ``item``'s library counts: ``bytes_column``, plus for each of the row's rows
    (``bytes_column`` / ``row_bytes``) the bytes the library sends with it (``LibraryBandwidth``)."""
    payload = _number(frame, item.bytes_column)
    if not item.extra_bytes_per_row and not item.extra_bytes_column:
        return payload
    extra = pd.Series(float(item.extra_bytes_per_row), index=frame.index)
    if item.extra_bytes_column:
        extra = extra + _number(frame, item.extra_bytes_column)
    rows = payload / _number(frame, "row_bytes")
    return payload + rows * extra


def _matches(frame: pd.DataFrame) -> Iterable[tuple[LibraryBandwidth, pd.Index]]:
    """(figure, the rows of ``frame`` it applies to): the row's backend, phase and ``mode`` knob."""
    if frame.empty or "backend_name" not in frame.columns or "phase" not in frame.columns:
        return
    names = frame["backend_name"].astype(str)
    phases = frame["phase"].astype(str)
    knobs = frame["knobs"] if "knobs" in frame.columns else pd.Series("", index=frame.index)
    modes = pd.Series([knob_setting(cell).get("mode", "") for cell in knobs], index=frame.index)
    for name in dict.fromkeys(names):
        for item in definitions(name):
            mask = (names == name) & (phases == item.phase)
            if item.modes:
                mask &= modes.isin(item.modes)
            if mask.any():
                yield item, frame.index[mask]


def library_figures(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (result row, library figure that applies to it): the row's case, the library and the
    figure's name as the library prints it, ``library_GBps`` (the library's bytes / its time, from the
    row's columns), commbench's ``busbw_GBps`` and ``algbw_GBps`` of the same row (frame from
    ``results_frame``), and what the library counts and times."""
    parts = []
    for item, index in _matches(frame):
        rows = frame.loc[index]
        part = pd.DataFrame({column: rows[column] for column in _CASE_COLUMNS if column in rows.columns})
        part["library"] = item.library
        part["library_figure"] = item.label
        part["library_GBps"] = gbps(library_bytes(rows, item), _number(rows, item.time_column))
        part["busbw_GBps"] = _number(rows, "busbw_GBps")
        part["algbw_GBps"] = _number(rows, "algbw_GBps")
        part["library_bytes"] = f"{item.bytes_meaning} ({_bytes_formula(item)})"
        part["library_time"] = f"{item.time_meaning} ({item.time_column})"
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=[*_CASE_COLUMNS, "library", "library_figure", "library_GBps"])
    return pd.concat(parts).sort_index(kind="stable")


def with_library_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` plus ``library_figure`` ("DeepEP GB/s (NVL)") and ``library_GBps``: each row's figure as its
    library prints it (the first that applies), empty and NaN where the backend has none."""
    out = frame.copy()
    out["library_figure"] = pd.Series("", index=frame.index, dtype=object)
    out["library_GBps"] = pd.Series(np.nan, index=frame.index, dtype=float)
    seen: set = set()
    for item, index in _matches(frame):
        fresh = index.difference(pd.Index(list(seen)))
        if fresh.empty:
            continue
        rows = frame.loc[fresh]
        out.loc[fresh, "library_figure"] = f"{item.library} {item.label}"
        out.loc[fresh, "library_GBps"] = gbps(library_bytes(rows, item), _number(rows, item.time_column))
        seen.update(fresh)
    return out


def vocabulary_rows(backends: Iterable[str] | None = None) -> list[list[str]]:
    """The definitions as table cells, one row per (backend, figure); ``backends`` None = every registered
    backend that has any."""
    if backends is None:
        from commbench.backends import loaded_backends

        backends = [name for name, _ in loaded_backends()]
    rows = []
    for name in backends:
        for item in definitions(name):
            rows.append(
                [
                    name,
                    ", ".join(item.modes) or "any",
                    item.phase,
                    f"{item.library} {item.label}",
                    item.bytes_meaning,
                    item.time_meaning,
                    f"{_bytes_formula(item)} / {item.time_column}",
                ]
            )
    return rows


def _bytes_formula(item: LibraryBandwidth) -> str:
    """How a figure's bytes come from the row: "max_send_bytes", or with what the library adds per row
    "max_send_bytes x (row_bytes + 16) / row_bytes"."""
    extra = " + ".join(
        part
        for part in (
            str(item.extra_bytes_per_row) if item.extra_bytes_per_row else "",
            item.extra_bytes_column,
        )
        if part
    )
    return f"{item.bytes_column} x (row_bytes + {extra}) / row_bytes" if extra else item.bytes_column


def vocabulary_table(style: str = "markdown", backends: Iterable[str] | None = None) -> str:
    """The conversion table (``tables.format_table``): how each library defines the figure it prints, and
    which of commbench's row columns reproduce it."""
    return format_table(
        VOCABULARY_HEADERS, vocabulary_rows(backends), style, text_columns=range(len(VOCABULARY_HEADERS))
    )
