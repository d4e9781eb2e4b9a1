"""The report's tables beside results.csv (pairs.csv: the pairwise link test; health.csv: GPU health before
and after; profile.csv, arrivals.csv, peers.csv: the profiler) read from a folder, and their sections of
summary.md and report.html (heatmaps, tables, stacked bars)."""

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
from commbench.report.folder.reading import read_table
from commbench.report.frame import pair_frame
from commbench.report.judge.pairs import CLASS_WORDS, PAIRS_FILE, TEST_WORDS, heatmap_figure, pair_matrix
from commbench.report.judge.verdict import Verdict
from commbench.report.pages.tables import format_table
from commbench.report.profiler.profile import ARRIVALS_FILE, PEERS_FILE, PROFILE_FILE

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
    profile: pd.DataFrame = field(default_factory=pd.DataFrame)  # --profile: profile.csv
    arrivals: pd.DataFrame = field(default_factory=pd.DataFrame)  # arrivals.csv
    peers: pd.DataFrame = field(default_factory=pd.DataFrame)  # peers.csv
    kineto: Any = None  # --torch-profiler: report.kineto_overlap.KinetoOverlap of kineto/rank<R>.json


# The profiler's long tables, appended as phases finish: file -> ExtraTables field.
EXTRA_APPENDED = {PROFILE_FILE: "profile", ARRIVALS_FILE: "arrivals", PEERS_FILE: "peers"}
_REQUIRED = {
    PROFILE_FILE: ("phase", "rank", "iteration", "step", "us"),
    ARRIVALS_FILE: ("phase", "rank", "iteration", "entered_us", "waited_us"),
    PEERS_FILE: ("phase", "src", "dst", "iteration", "seen_us"),
}


def read_extra_tables(out_dir: str | os.PathLike[str]) -> ExtraTables:
    """pairs.csv and health.csv of a report folder, checked as results.csv is (UsageError naming the file)."""
    folder = Path(out_dir)
    pairs = folder / PAIRS_FILE
    health = folder / HEALTH_FILE
    profiled = {
        field_name: read_table(folder / name, _REQUIRED[name])
        if (folder / name).is_file()
        else pd.DataFrame()
        for name, field_name in EXTRA_APPENDED.items()
    }
    return ExtraTables(
        kineto=read_kineto(folder),
        pairs=read_table(pairs, ("test", "src", "dst", "size_bytes", "time_us", "link_class"))
        if pairs.is_file()
        else pd.DataFrame(),
        health=read_table(health, ("rank", "host", "device")) if health.is_file() else pd.DataFrame(),
        **profiled,
    )


KINETO_FOLDER = "kineto"
KINETO_NOTE = (
    "torch.profiler (Kineto) traces of every rank's measured calls (kineto/rank<R>.json; load them in "
    "ui.perfetto.dev). Kernels are classified as communication by a registry of names (NCCL, NVSHMEM, "
    "commbench's put and wait kernels, torch symm_mem all_to_all_vdev, DeepEP, pplx; peer-to-peer copies), "
    "not by a substring; everything else is compute. comm / compute = the union of their kernels' time on "
    "the GPU; overlap = the time both ran at once; exposed = communication not hidden behind compute."
)


def read_kineto(folder: str | os.PathLike[str]) -> Any:
    """The overlap analysis of a folder's kineto/ traces, or None when it has none."""
    from commbench.report.profiler.kineto_overlap import overlap_from_folder, trace_files

    traces = Path(folder) / KINETO_FOLDER
    if not traces.is_dir() or not trace_files(traces):
        return None
    return overlap_from_folder(traces)


def kineto_section(extras: ExtraTables, style: str) -> list[str]:
    """The torch.profiler section: communication time and its overlap with compute per rank."""
    from commbench.report.profiler.kineto_overlap import overlap_table

    if extras.kineto is None:
        return []
    table = overlap_table(extras.kineto, style)
    ranks = extras.kineto.ranks
    if ranks.empty or not (pd.to_numeric(ranks.get("gpu_events"), errors="coerce").fillna(0) > 0).any():
        table = "No GPU kernel in the traces (a CPU run): nothing to classify; the traces hold the CPU ops."
    title = "Communication kernels and their overlap with compute (torch.profiler)"
    if style == "markdown":
        return [f"## {title}", "", KINETO_NOTE, "", table, ""]
    return [
        f"<h2>{html.escape(title)}</h2>",
        f"<p>{html.escape(KINETO_NOTE)}</p>",
        f'<div class="wide">{table}</div>',
    ]


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


def profile_section(extras: ExtraTables, style: str) -> list[str]:
    """The profiler's section (markdown or html): the per-step table, the stacked bars per rank (html), the
    straggler table and the per-peer arrival matrix; nothing for a run without --profile."""
    from commbench.report.profiler.profile import (
        PROFILE_NOTE,
        STRAGGLER_NOTE,
        peer_table,
        stacked_bars_figure,
        step_table,
        straggler_table,
    )

    if extras.profile.empty:
        return []
    steps = step_table(extras.profile, style)
    stragglers = straggler_table(extras.arrivals, style) if not extras.arrivals.empty else None
    peers = peer_table(extras.peers, style) if not extras.peers.empty else None
    peer_note = (
        "Per-peer arrival matrix (us after the receiver entered the call, p50): when each source's data was "
        "seen, from the backend's per-source signals."
    )
    if style == "markdown":
        parts = ["## Profile: where the time goes", "", PROFILE_NOTE, "", steps or "", ""]
        if stragglers:
            parts += ["## Who arrives late", "", STRAGGLER_NOTE, "", stragglers, ""]
        if peers:
            parts += ["### Per-peer arrivals", "", peer_note, "", peers, ""]
        return parts
    esc = html.escape
    body = [
        "<h2>Profile: where the time goes</h2>",
        f"<p>{esc(PROFILE_NOTE)}</p>",
        f'<div class="wide">{steps}</div>',
    ]
    figure = stacked_bars_figure(extras.profile)
    if figure is not None:
        title = "Per rank: p50 of each step per iteration (stacked)"
        body.append(f'<h3>{esc(title)}</h3><img alt="{esc(title)}" src="{PNG_URL}{figure_png(figure)}">')
    if stragglers:
        body += [
            "<h2>Who arrives late</h2>",
            f"<p>{esc(STRAGGLER_NOTE)}</p>",
            f'<div class="wide">{stragglers}</div>',
        ]
    if peers:
        body += ["<h3>Per-peer arrivals</h3>", f"<p>{esc(peer_note)}</p>", peers]
    return body


BUDGET_TITLE = "Can the all-to-all hide behind the experts?"


def budget_section(frame: pd.DataFrame, meta: dict[str, Any], spec: SystemSpec, style: str) -> list[str]:
    """The comm/compute budget of the run's MoE cases (``report.budget``), for summary.md ("markdown") or
    report.html ("html"); nothing when the run has no MoE case or its model cannot be read back."""
    from commbench.errors import CommbenchError
    from commbench.inputs.models import load_model
    from commbench.report.profiler.budget import moe_budget

    args = meta.get("args") or {}
    names = args.get("model")
    names = [names] if isinstance(names, str) else list(names or [])
    models = []
    for name in names:
        try:
            models.append(load_model(str(name)))
        except CommbenchError:  # a model file moved away since the run: its cases are left out
            continue
    if not models:
        return []
    tflops = args.get("tflops")
    from commbench.report.knobs import KNOB_SETTING_COLUMN, with_knob_setting

    shown = with_knob_setting(frame)  # the knobs that vary between cases, as every other table shows them
    if KNOB_SETTING_COLUMN in shown.columns:
        shown = shown.assign(knobs=shown[KNOB_SETTING_COLUMN])
    try:
        text = moe_budget(shown, models, float(tflops) if tflops else None, spec, style)
    except CommbenchError:
        return []
    if not text:
        return []
    if style == "markdown":
        return [f"## {BUDGET_TITLE}", "", text, ""]
    return [f"<h2>{html.escape(BUDGET_TITLE)}</h2>", f'<div class="wide">{text}</div>']


def replicas_section(frame: pd.DataFrame, style: str) -> list[str]:
    """What EPLB replicas buy (run/suite --replicas: each MoE case without and with replicas), or nothing."""
    from commbench.report.analysis.replicas import REPLICAS_NOTE, replicas_table

    table = replicas_table(frame, style) if not frame.empty else None
    if not table:
        return []
    title = "What EPLB replicas buy"
    if style == "markdown":
        return [f"## {title}", "", REPLICAS_NOTE, "", table, ""]
    return [f"<h2>{title}</h2>", f"<p>{html.escape(REPLICAS_NOTE)}</p>", f'<div class="wide">{table}</div>']
