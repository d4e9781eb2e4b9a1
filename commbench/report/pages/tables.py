"""The one table printer (aligned text, GitHub Markdown, HTML) and the report's tables built on it.

Every table commbench prints or writes goes through ``format_table``: the stdout tables
(``report.console``), the summary.md and report.html tables (``pattern_tables``, ``link_class_table``,
``skew_cost_table``), ``commbench pattern``, ``topo`` and ``simulate``. A column whose cells all look numeric
(a number, optionally followed by a unit, or a placeholder such as "-" or "n/a") is right-aligned, any other
column left-aligned, so numbers line up on their last digit as in nccl-tests; a caller names the columns
that hold text (``text_columns``) so that a text column of placeholders only stays left-aligned.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from commbench.inputs.specs import NO_SPEC_NAME, SystemSpec, has_figures
from commbench.plain import is_missing
from commbench.report.frame import emulated_rows
from commbench.report.knobs import KNOB_SETTING_COLUMN
from commbench.report.pages.modes import mixes_timing, with_timing

STYLES = ("text", "markdown", "html")
# Cells that stand for "no value" and must not make a numeric column left-aligned.
_PLACEHOLDERS = frozenset({"", "-", "n/a", "nan", "inf", "-inf"})


def _looks_numeric(cell: str) -> bool:
    text = cell.strip()
    if text.lower() in _PLACEHOLDERS:
        return True
    head = text.split(" ")[0].rstrip("%x")
    try:
        float(head)
    except ValueError:
        return False
    return True


def right_aligned(
    headers: Sequence[str], rows: Sequence[Sequence[str]], text_columns: Collection[int] = ()
) -> list[bool]:
    """Per column: True when every cell looks numeric (and there is at least one row), unless it is text."""
    return [
        bool(rows) and i not in text_columns and all(_looks_numeric(row[i]) for row in rows)
        for i in range(len(headers))
    ]


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    style: str = "text",
    *,
    min_widths: Sequence[int] | None = None,
    header_prefix: str = "",
    row_prefix: str = "",
    separator: str = "  ",
    text_columns: Collection[int] = (),
) -> str:
    """Render ``rows`` (lists of already formatted cell strings) under ``headers``.

    ``style`` is "text" (space-aligned; ``header_prefix``/``row_prefix`` let the header be a ``#`` comment
    line as in nccl-tests' output), "markdown" (GitHub table with alignment colons) or "html" (a ``<table>``
    with escaped cells; numeric columns get ``class="num"``). ``text_columns``: indices of columns that are
    left-aligned whatever their cells look like.
    """
    if style not in STYLES:
        raise ValueError(f"unknown table style {style!r}; choose one of {', '.join(STYLES)}")
    headers = [str(h) for h in headers]
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"table row has {len(row)} cells for {len(headers)} headers")
    if style == "markdown":  # a "|" or a line break in a cell would split the row
        headers = [markdown_text(h).replace("|", "\\|") for h in headers]
        cells = [[markdown_text(c).replace("|", "\\|") for c in row] for row in cells]
    right = right_aligned(headers, cells, text_columns)
    if style == "html":
        return _html(headers, cells, right)
    minimum = list(min_widths) if min_widths is not None else [0] * len(headers)
    widths = [max([minimum[i], len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def aligned(row: Sequence[str]) -> list[str]:
        return [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)]

    if style == "markdown":
        rule = [("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right, strict=True)]
        lines = ["| " + " | ".join(aligned(headers)) + " |", "|" + "|".join(rule) + "|"]
        lines += ["| " + " | ".join(aligned(row)) + " |" for row in cells]
        return "\n".join(lines)
    lines = [(header_prefix + separator.join(aligned(headers))).rstrip()]
    lines += [(row_prefix + separator.join(aligned(row))).rstrip() for row in cells]
    return "\n".join(lines)


def markdown_text(text: str) -> str:
    """``text`` on one Markdown line: line breaks become spaces (a break would end a table row or a
    paragraph's heading)."""
    return " ".join(str(text).replace("\r\n", "\n").replace("\r", "\n").split("\n"))


def _html(headers: list[str], cells: list[list[str]], right: list[bool]) -> str:
    def cell(tag: str, text: str, numeric: bool) -> str:
        attribute = ' class="num"' if numeric else ""
        return f"<{tag}{attribute}>{html.escape(text, quote=True)}</{tag}>"

    head = "".join(cell("th", h, r) for h, r in zip(headers, right, strict=True))
    body = "".join(
        "<tr>" + "".join(cell("td", c, r) for c, r in zip(row, right, strict=True)) + "</tr>\n"
        for row in cells
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


@dataclass(frozen=True)
class Table:
    """A table as data: headers and rows of formatted cell text; ``text_columns`` stay left-aligned, ``wide``
    tables scroll sideways in report.html. Printed by ``format_table`` (``text``, ``markdown``, ``html``)."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    text_columns: Collection[int] = ()
    wide: bool = False

    def text(self, **options: Any) -> str:
        """The aligned text table (stdout), ``format_table``'s ``options`` (prefixes, minimum widths)."""
        return format_table(self.headers, self.rows, "text", text_columns=self.text_columns, **options)

    def markdown(self) -> str:
        """The GitHub Markdown table (cells with "|" or line breaks neutralised)."""
        return format_table(self.headers, self.rows, "markdown", text_columns=self.text_columns)

    def html(self) -> str:
        """The ``<table>`` with every cell escaped."""
        return format_table(self.headers, self.rows, "html", text_columns=self.text_columns)


# ----------------------------------------------------------------------------------------------------------
# Cell formatters: "-" for a missing value


def fmt_int(value: Any) -> str:
    return "-" if is_missing(value) else str(int(value))


def fmt_wrong(value: Any) -> str:
    """#wrong: "n/a" where nothing was verified (a backend that moves no data), never a 0."""
    return "n/a" if is_missing(value) else str(int(value))


def fmt_float(digits: int) -> Callable[[Any], str]:
    def fmt(value: Any) -> str:
        return "-" if is_missing(value) else f"{float(value):.{digits}f}"

    return fmt


def fmt_text(value: Any) -> str:
    return "-" if is_missing(value) or value == "" else str(value)


def fmt_size(value: Any) -> str:
    """Bytes with a binary-unit hint, e.g. "1048576 (1 MiB)"."""
    if is_missing(value):
        return "-"
    size = int(value)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size} ({size / scale:.3g} {unit})"
    return str(size)


def format_bandwidth(value: Any) -> str:
    """GB/s with 2 decimals (as nccl-tests), 3 significant digits below 1 GB/s (CPU and small sizes)."""
    if is_missing(value):
        return "-"
    value = float(value)
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def fmt_pct(value: Any) -> str:
    """Percent with 3 significant digits below 100 (CPU runs reach tiny fractions of an NVLink spec)."""
    if is_missing(value):
        return "-"
    value = float(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


fmt_time = fmt_float(1)


# ----------------------------------------------------------------------------------------------------------
# The report's tables: each a tuple of Columns over a results frame


@dataclass(frozen=True)
class Column:
    """One table column: its header, the frame column it reads (a table leaves out the columns its frame
    lacks), the cell text of a row, whether it holds text (left-aligned) and its minimum width on stdout."""

    header: str
    source: str
    cell: Callable[[dict[str, Any]], str]
    text: bool = False
    min_width: int = 0


def column(source: str, header: str, fmt: Callable[[Any], str], min_width: int = 0) -> Column:
    """A column showing ``source`` through ``fmt``; a text column when ``fmt`` formats text."""
    return Column(header, source, lambda record: fmt(record.get(source)), fmt is fmt_text, min_width)


def _neck(name: str, header: str) -> Column:
    """The bottleneck rank and direction of link class ``name``, e.g. "3 send"; "-" if it carries nothing."""

    def cell(record: dict[str, Any]) -> str:
        rank = record.get(f"{name}_bottleneck_rank")
        if is_missing(rank) or int(rank) < 0:
            return "-"
        return f"{int(rank)} {fmt_text(record.get(f'{name}_bottleneck_dir'))}"

    return Column(header, f"{name}_bottleneck_rank", cell)


def column_table(columns: Sequence[Column], frame: pd.DataFrame, wide: bool = True) -> Table:
    """``frame``'s rows under ``columns`` (those whose source column it has; no %spec column in a run with
    no spec)."""
    no_spec = "spec_name" in frame.columns and frame["spec_name"].eq(NO_SPEC_NAME).all()
    shown = [c for c in columns if c.source in frame.columns and not (no_spec and "spec" in c.source)]
    records = frame.to_dict("records")
    return Table(
        [c.header for c in shown],
        [[c.cell(record) for c in shown] for record in records],
        text_columns={i for i, c in enumerate(shown) if c.text},
        wide=wide,
    )


KNOBS = column(KNOB_SETTING_COLUMN, "knobs", fmt_text)
TIMING = column("timing", "timing", fmt_text)  # shown only where the rows mix timing modes
REPEAT = column("repeat", "repeat", fmt_int)  # shown only where a case was measured several times (--repeat)
_CASE = (column("pattern", "pattern", fmt_text), column("skew", "skew", fmt_text))
_PHASE = column("phase", "phase", fmt_text)
_BACKEND = column("backend", "backend", fmt_text)
_SIZE = column("size_bytes", "size(B)", fmt_size)
_OTHER_TIMES = (
    column("time_us_p50", "p50(us)", fmt_time),
    column("time_us_min", "min(us)", fmt_time),
    column("time_us_p99", "p99(us)", fmt_time),
)
_WRONG = column("wrong", "#wrong", fmt_wrong)
# The balanced all-to-all: nccl-tests' time (the mean) and the bandwidths from it.
_BALANCED_TABLE = (
    _BACKEND,
    KNOBS,
    TIMING,
    REPEAT,
    _SIZE,
    column("time_us_mean", "time mean(us)", fmt_time),
    *_OTHER_TIMES,
    column("algbw_mean_GBps", "algbw(GB/s)", format_bandwidth),
    column("busbw_mean_GBps", "busbw(GB/s)", format_bandwidth),
    column("pct_spec_mean", "%spec", fmt_pct),
    # nccl-tests' in-place columns (rows of a run that timed them): the mean and the busbw from it.
    column("in_place_time_us_mean", "in-place mean(us)", fmt_time),
    Column(
        "in-place busbw(GB/s)",
        "in_place_time_us_mean",
        lambda record: format_bandwidth(record.get("in_place_busbw_mean_GBps")),
    ),
    _WRONG,  # last, as in every table: the out-of-place run's (the in-place one is never checked)
)
# MoE phases: the mean shown too, the bandwidths from p50.
_MOE_TABLE = (
    _BACKEND,
    KNOBS,
    TIMING,
    REPEAT,
    column("skew", "skew", fmt_text),
    column("send_mode", "send mode", fmt_text),
    column("tokens_per_rank", "tokens/rank", fmt_int),
    _PHASE,
    _SIZE,
    column("time_us_mean", "time mean(us)", fmt_time),
    *_OTHER_TIMES,
    column("algbw_GBps", "algbw(GB/s)", format_bandwidth),
    column("busbw_GBps", "busbw(GB/s)", format_bandwidth),
    column("pct_spec", "%spec", fmt_pct),
    column("agg_GBps", "agg(GB/s)", format_bandwidth),
    column("pct_agg_spec", "%agg", fmt_pct),
    column("maxvio", "maxvio", fmt_float(3)),
    _WRONG,
)
# Which time each table's bandwidths use, said under the tables of summary.md and report.html.
TIME_NOTE = (
    "Balanced all-to-all tables: time = the mean over the timed iterations (nccl-tests' time), algbw, "
    "busbw and %spec from it; in-place = the same exchange with one buffer as input and output "
    "(nccl-tests' in-place columns), its mean time and busbw, not checked. MoE tables: time mean, p50, "
    "min and p99 shown; algbw, busbw, %spec and agg from p50. The timing column (where rows were timed in "
    "more than one way) says how: see Conventions."
)


def time_note(spec: SystemSpec) -> str:
    """TIME_NOTE, without the %spec it does not show when there is no spec."""
    if has_figures(spec):
        return TIME_NOTE
    return TIME_NOTE.replace("algbw, busbw and %spec", "algbw and busbw").replace(
        "algbw, busbw, %spec and agg", "algbw, busbw and agg"
    )


def _class_columns(name: str, label: str, spec_label: str) -> tuple[Column, ...]:
    """Link class ``name``'s per-GPU bandwidth, bottleneck, %spec, aggregate and %aggregate columns."""
    return (
        column(f"{name}_GBps", f"{label}/GPU(GB/s)", format_bandwidth),
        _neck(name, f"{label} neck"),
        column(f"{name}_pct_spec", f"%{spec_label} spec", fmt_pct),
        column(f"{name}_agg_GBps", f"{label} agg(GB/s)", format_bandwidth),
        column(f"{name}_agg_pct_spec", f"%{spec_label} agg", fmt_pct),
    )


# Every bandwidth is one direction.
_LINK_CLASS_TABLE = (
    *_CASE,
    _PHASE,
    KNOBS,
    REPEAT,
    column("size_bytes", "size(B)", fmt_int),
    column("algbw_GBps", "algbw self incl.(GB/s)", format_bandwidth),
    column("busbw_GBps", "link bw self excl.(GB/s)", format_bandwidth),
    column("self_bytes", "self(B)", fmt_int),
    column("nvlink_bytes", "NVLink(B)", fmt_int),
    column("scaleout_bytes", "scale-out(B)", fmt_int),
    *_class_columns("nvlink", "NVLink", "NVLink"),
    *_class_columns("scaleout", "scale-out", "NIC"),
)
_SKEW_COST_TABLE = (
    *_CASE,
    _PHASE,
    KNOBS,
    REPEAT,
    column("maxvio", "maxvio", fmt_float(3)),
    column("total_bytes", "total(B)", fmt_int),
    column("time_us_p50", "time p50(us)", fmt_time),
    column("uniform_ref_time_us_p50", "uniform ref p50(us)", fmt_time),
    column("skew_cost", "skew cost(x)", fmt_float(2)),
    column("skew_bw_loss_pct", "bw loss(%)", fmt_float(1)),
)


def any_emulated(frame: pd.DataFrame) -> bool:
    """Whether any row comes from an emulated backend (``emulated`` is a bool, read back once)."""
    return bool(emulated_rows(frame).any())


def timing_shown(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``timing`` cell in every row where the rows mix timing modes, else without the
    column, and without ``repeat`` unless a case has several (tables show what tells rows apart)."""
    frame = with_timing(frame) if mixes_timing(frame) else frame.drop(columns="timing", errors="ignore")
    if "repeat" in frame.columns and pd.to_numeric(frame["repeat"], errors="coerce").fillna(0).max() < 1:
        frame = frame.drop(columns="repeat")  # one measurement per case: the column says nothing
    return frame


def pattern_tables(frame: pd.DataFrame) -> list[tuple[str, Table]]:
    """(pattern name, table) per pattern in run order: the balanced sweep's columns (nccl-tests' mean
    time) for balanced all-to-all rows, the MoE columns otherwise; a timing column where rows mix modes."""
    if frame.empty:
        return []
    mixing = mixes_timing(frame)
    if "pattern" not in frame.columns:
        groups = [("results", frame)]
    else:
        names = list(dict.fromkeys(frame["pattern"].astype(str)))
        groups = [(name, frame[frame["pattern"].astype(str) == name]) for name in names]
    tables = []
    for name, group in groups:
        balanced = "phase" in group.columns and bool((group["phase"] == "alltoall").all())
        # A timing (or repeat) column only where this table's own rows differ in it; where the run mixes
        # modes but this table does not, its title says which.
        if mixing and not mixes_timing(group):
            name = f"{name} (timing: {with_timing(group)['timing'].iloc[0]})"
        tables.append((name, column_table(_BALANCED_TABLE if balanced else _MOE_TABLE, timing_shown(group))))
    return tables


def link_class_table(frame: pd.DataFrame) -> Table | None:
    """Per-link-class bytes and bandwidths of every result row; None for rows without link-class columns."""
    if frame.empty or "nvlink_bytes" not in frame.columns:
        return None
    return column_table(_LINK_CLASS_TABLE, timing_shown(frame))


def skew_cost_table(frame: pd.DataFrame) -> Table | None:
    """The "what skew costs" table: MoE rows that carry a uniform reference time; None without any."""
    if frame.empty or "uniform_ref_time_us_p50" not in frame.columns:
        return None
    rows = frame[pd.to_numeric(frame["uniform_ref_time_us_p50"], errors="coerce").notna()]
    return None if rows.empty else column_table(_SKEW_COST_TABLE, timing_shown(rows), wide=False)


def spec_legend(spec: SystemSpec) -> str:
    """The spec figures the report compares with, and how they scale to the ranks used."""
    if not has_figures(spec):
        return f"none ({spec.description or 'no spec'}); no %spec is shown"
    per_gpu = spec.nvlink_GBps_per_direction
    aggregate = spec.domain_aggregate_GBps_bidirectional
    nic = spec.nic_GBps_per_direction
    return (
        f"{spec.name}: NVLink {per_gpu:g} GB/s per GPU per direction ({2 * per_gpu:g} GB/s bidirectional); "
        f"NVLink-domain aggregate {aggregate:g} GB/s bidirectional for {spec.gpus_per_domain} GPUs = "
        f"{aggregate / 2:g} GB/s per direction, scaled by ranks / {spec.gpus_per_domain}; scale-out NIC "
        f"{nic:g} GB/s ({8 * nic:g} Gb/s) per GPU per direction"
    )


def link_class_legend(spec: SystemSpec) -> str:
    """Which convention each column of the per-link-class table uses."""
    if not has_figures(spec):
        return (
            "All bandwidths are one direction, GB = 1e9 B. algbw self incl. = size / time; link bw self "
            "excl. = the bottleneck rank's link bytes / time (busbw); per class: the class's bottleneck rank "
            f"bytes / time, agg = all bytes of the class / time. No spec: {spec.description or 'none given'}."
        )
    nic = spec.nic_GBps_per_direction
    return (
        "All bandwidths are one direction, GB = 1e9 B. algbw self incl. = size / time (what the layer sees); "
        "link bw self excl. = the bottleneck rank's link bytes / time (busbw). NVLink/GPU and scale-out/GPU "
        "= the class's bottleneck rank (neck: rank and direction) bytes / time, against the per-GPU spec per "
        f"direction (NVLink {spec.nvlink_GBps_per_direction:g} GB/s, NIC {nic:g} GB/s); agg = all bytes of "
        "the class / time, against the aggregate per direction scaled to the ranks used (NVLink: domain "
        f"aggregate / 2 x ranks / {spec.gpus_per_domain}; scale-out: ranks x {nic:g} GB/s)."
    )


SKEW_COST_NOTE = (
    "skew cost = time / time of the same phase (same code path: packing, counts exchange, weighted "
    "reduction) on a balanced layout of the same rows, every rank pair total / world^2 rows, timed right "
    "after in the same launch (1 = skew costs nothing); bw loss = bandwidth lost against that balanced "
    "layout."
)
