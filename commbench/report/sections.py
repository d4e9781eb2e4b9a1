"""The report's tables beside results.csv (pairs.csv: the pairwise link test; health.csv: GPU health before
and after) read from a folder, and their sections of summary.md and report.html (heatmaps, tables)."""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from commbench.inputs.specs import SystemSpec
from commbench.report.frame import pair_frame
from commbench.report.pairs import CLASS_WORDS, PAIRS_FILE, TEST_WORDS, heatmap_figure, pair_matrix
from commbench.report.reading import read_table
from commbench.report.tables import format_table
from commbench.report.verdict import Verdict

HEALTH_FILE = "health.csv"
PNG_URL = "data:image/png;base64,"
PAIRS_NOTE = (
    "Pairwise link test: every ordered pair of ranks in rounds of disjoint pairs (n-1 rounds of n/2 "
    "pairs), one way and both ways at once. Bandwidth = one message's bytes / (the receiver's window / "
    "messages), one direction (bidir: one direction while the other runs); latency = time per 8-byte "
    "message of a one-way stream (nccl-tests sendrecv_perf's time), not a ping-pong. The last message of "
    "every window is checked byte for byte. Each pair is judged against the median of its link class and "
    "test; outlined cells are flagged pairs (red FAIL: confirmed by reruns, orange WARN: not reproduced)."
)


def figure_png(figure: Any) -> str:
    """A matplotlib figure as base64 PNG for an <img> data URL."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass(frozen=True)
class ExtraTables:
    """What a run wrote beside results.csv and ranks.csv (empty frames when it did not)."""

    pairs: pd.DataFrame = field(default_factory=pd.DataFrame)
    health: pd.DataFrame = field(default_factory=pd.DataFrame)


def read_extra_tables(out_dir: str | os.PathLike[str]) -> ExtraTables:
    """pairs.csv and health.csv of a report folder, checked as results.csv is (UsageError naming the file)."""
    folder = Path(out_dir)
    pairs = folder / PAIRS_FILE
    health = folder / HEALTH_FILE
    return ExtraTables(
        read_table(pairs, ("test", "src", "dst", "size_bytes", "time_us", "link_class"))
        if pairs.is_file()
        else pd.DataFrame(),
        read_table(health, ("rank", "host", "device")) if health.is_file() else pd.DataFrame(),
    )


def _flagged(verdict: Verdict | None) -> dict[str, dict[tuple[int, int], str]]:
    """test -> {(src, dst): FAIL|WARN} of the verdict's flagged pairs ("bandwidth nvlink 1->2")."""
    out: dict[str, dict[tuple[int, int], str]] = {}
    for element in verdict.elements if verdict is not None else ():
        if element.group != "pairwise" or "->" not in element.name or element.status not in ("FAIL", "WARN"):
            continue
        test, _, pair = element.name.split(" ", 2)
        src, _, dst = pair.partition("->")
        if src.isdigit() and dst.isdigit():
            out.setdefault(test, {})[(int(src), int(dst))] = element.status
    return out


def _summary_rows(frame: pd.DataFrame) -> list[list[Any]]:
    """Per (test, class): pairs, median, slowest pair and its value."""
    rows = []
    for (test, link), group in frame.groupby(["test", "link_class"], sort=False):
        column, unit = ("time_us", "us") if test == "latency" else ("GBps", "GB/s")
        values = pd.to_numeric(group[column], errors="coerce")
        worst = group.loc[values.idxmax() if test == "latency" else values.idxmin()]
        rows.append(
            [
                TEST_WORDS.get(str(test), str(test)), CLASS_WORDS.get(str(link), str(link)), str(len(group)),
                f"{values.median():.4g} {unit}", f"{int(worst['src'])}->{int(worst['dst'])}",
                f"{float(worst[column]):.4g} {unit}",
            ]
        )  # fmt: skip
    return rows


_SUMMARY_HEADERS = ["test", "link class", "pairs", "median", "worst pair", "worst"]


def pairs_markdown(extras: ExtraTables, spec: SystemSpec) -> list[str]:
    """summary.md's pairwise section (empty without a pairwise test)."""
    if extras.pairs.empty:
        return []
    frame = pair_frame(extras.pairs, spec)
    table = format_table(_SUMMARY_HEADERS, _summary_rows(frame), "markdown", text_columns={0, 1, 3, 4, 5})
    return ["## Pairwise link test", "", PAIRS_NOTE, "", table, "", "Matrices: pairs.csv (long form).", ""]


def pairs_html(extras: ExtraTables, spec: SystemSpec, verdict: Verdict | None) -> list[str]:
    """report.html's pairwise section: the class table and the [src][dst] bandwidth and latency heatmaps."""
    if extras.pairs.empty:
        return []
    esc = html.escape
    frame = pair_frame(extras.pairs, spec)
    flagged = _flagged(verdict)
    table = format_table(_SUMMARY_HEADERS, _summary_rows(frame), "html", text_columns={0, 1, 3, 4, 5})
    body = ["<h2>Pairwise link test</h2>", f"<p>{esc(PAIRS_NOTE)}</p>", table]
    world = int(max(frame["src"].max(), frame["dst"].max())) + 1
    images = []
    for test, unit in (("bandwidth", "GB/s"), ("latency", "us"), ("bidir", "GB/s")):
        if (frame["test"] == test).any():
            title = f"[src][dst] {TEST_WORDS[test]} ({unit})"
            panel = (pair_matrix(frame, test, world), title, unit, flagged.get(test, {}))
            png = figure_png(heatmap_figure([panel]))
            images.append(
                f'<img class="heatmap" alt="heatmap: {esc(title)}" title="{esc(title)}" src="{PNG_URL}{png}">'
            )
    if images:
        body += [
            "<h3>Heatmaps: rows = sender (src), columns = receiver (dst)</h3>",
            '<div class="heatmaps">',
            *images,
            "</div>",
        ]
    return body


_HEALTH_HEADERS = ["rank", "host", "GPU", "links up", "min link MB/s", "ECC", "persist.", "driver",
                   "NVLink errors before -> after", "ECC uncorr. before -> after", "Xid"]  # fmt: skip
_NVLINK_ERRORS = ("nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data")
_ECC = ("ecc_uncorrected",)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _errors(record: dict[str, Any], names: tuple[str, ...], when: str) -> str:
    values = [record.get(f"{name}_{when}") for name in names]
    known = [float(v) for v in values if v is not None and v == v]
    return _cell(sum(known)) if known else "-"


def _health_rows(frame: pd.DataFrame) -> list[list[str]]:
    rows = []
    for record in frame.to_dict("records"):
        device = record.get("device")
        if device is None or device != device or int(device) < 0:
            continue
        rows.append(
            [
                _cell(record.get("rank")), _cell(record.get("host")),
                f"{int(device)} {_cell(record.get('bus_id'))}", _cell(record.get("nvlink_active")),
                _cell(record.get("nvlink_min_speed_MBps")), _cell(record.get("ecc_current")),
                _cell(record.get("persistence")), _cell(record.get("driver_version")),
                f"{_errors(record, _NVLINK_ERRORS, 'before')} -> {_errors(record, _NVLINK_ERRORS, 'after')}",
                f"{_errors(record, _ECC, 'before')} -> {_errors(record, _ECC, 'after')}",
                _cell(record.get("xid_events")) if record.get("xid_events") else "-",
            ]
        )  # fmt: skip
    return rows


HEALTH_NOTE = (
    "GPU health read through NVML before the run (links, speeds, ECC, persistence, versions, fabric clique) "
    "and the error counters before and after it; every increase is a finding (verdict groups preflight and "
    "health; all columns in health.csv)."
)


def health_section(extras: ExtraTables, style: str) -> list[str]:
    """summary.md (style "markdown") or report.html ("html") lines of the GPU health table; one line on a
    run without GPUs, nothing without health.csv."""
    if extras.health.empty:
        return []
    rows = _health_rows(extras.health)
    text = HEALTH_NOTE if rows else "GPU health: no rank has a GPU (CPU run): nothing to read."
    if style == "markdown":
        parts = ["## GPU health", "", text, ""]
        if rows:
            parts += [format_table(_HEALTH_HEADERS, rows, "markdown", text_columns=set(range(11))), ""]
        return parts
    parts = ["<h2>GPU health</h2>", f"<p>{html.escape(text)}</p>"]
    if rows:
        table = format_table(_HEALTH_HEADERS, rows, "html", text_columns=set(range(11)))
        parts.append(f'<div class="wide">{table}</div>')
    return parts
