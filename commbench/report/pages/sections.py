"""The sections of a report page, in page order, built as data (``report.pages.render.Section``) from a
folder read back (``report.folder.reading``): summary.md and report.html are the same list of sections
rendered twice (``summary_markdown``, ``report_html``).

Order: the title (INCOMPLETE first when the run stopped), the verdict, the headline figures against the
spec (plots in HTML), a table per pattern, link classes, skew cost, spread over windows, EPLB replicas, the
comm/compute budget, the profiler, torch.profiler, the pairwise link test, GPU health, per-rank plots
(HTML), the environment and the conventions. Each analysis module builds its own section; this module
orders them and builds the run's own (headline, results, pairs, health, environment, conventions).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from commbench.hardware.nvlink_counters import ALL_NVLINK_COUNTERS
from commbench.inputs.specs import SystemSpec, has_figures
from commbench.report.analysis.repeats import repeat_range_section
from commbench.report.analysis.replicas import replicas_section
from commbench.report.analysis.soak import soak_figure
from commbench.report.folder.reading import ExtraTables, incomplete_reason
from commbench.report.frame import CONVENTIONS, average_bus_bandwidth, balanced_rows, pair_frame
from commbench.report.judge.pairs import TEST_WORDS, class_words, cpu_pairs, heatmap_figure, pair_matrix
from commbench.report.judge.verdict import Verdict
from commbench.report.knobs import KNOB_SETTING_COLUMN, with_knob_setting
from commbench.report.pages.html import balanced_figure, per_gpu_figure, rank_figures
from commbench.report.pages.modes import check_text, timing_text
from commbench.report.pages.render import (
    Block,
    Code,
    Fields,
    Figure,
    FigureRow,
    Section,
    Text,
    html_page,
    markdown_page,
)
from commbench.report.pages.tables import (
    SKEW_COST_NOTE,
    Table,
    any_emulated,
    fmt_int,
    fmt_text,
    format_bandwidth,
    link_class_legend,
    link_class_table,
    pattern_tables,
    skew_cost_table,
    spec_legend,
    time_note,
)
from commbench.report.pages.verdict_view import verdict_section
from commbench.run.config_meta import command_options, meta_values

PAGE_TITLE = "commbench report"
EMULATED_NOTE = (
    "Emulated (a model, an emulator or CPU ranks): times and bandwidths below are not GPU fabric figures."
)
PAIRS_NOTE = (
    "Pairwise link test: every ordered pair of ranks in rounds of disjoint pairs (n-1 rounds of n/2 "
    "pairs), one way and both ways at once. Bandwidth = one message's bytes / (the receiver's window / "
    "messages), one direction (bidir: one direction while the other runs); latency = time per 8-byte "
    "message of a one-way stream (nccl-tests sendrecv_perf's time), not a ping-pong. The last message of "
    "every window is checked byte for byte. Each pair is judged against the median of its link class and "
    "test; outlined cells are flagged pairs (red FAIL: confirmed by reruns, orange WARN: not reproduced)."
)


def environment_lines(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """(item, value) of the environment meta.json recorded: command, host, versions, devices, env vars."""
    env = meta.get("env") or {}
    versions = env.get("versions") or {}
    devices = env.get("devices") or []
    device_text = ", ".join(f"{d.get('index')}: {d.get('name', d.get('error', '?'))}" for d in devices)
    nvml = env.get("nvml") or {}
    items = [
        ("command", env.get("command") or " ".join(meta.get("argv", []))),
        ("time (UTC)", env.get("time_utc")),
        ("host", env.get("hostname")),
        ("platform", env.get("platform")),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)),
        ("devices", device_text or "no CUDA devices"),
        ("driver", nvml.get("driver_version")),
        ("env vars", " ".join(f"{k}={v}" for k, v in (env.get("env_vars") or {}).items()) or "none set"),
    ]
    options = {key: value for key, value in command_options(meta).items() if value not in (None, "", [], ())}
    if options:
        items.append(("options", ", ".join(f"{k}={v}" for k, v in options.items())))
    plan = meta.get("plan")
    if isinstance(plan, dict) and plan:  # what the command made of them: sizes, repeats, the backend
        items.append(("resolved", ", ".join(f"{k}={v}" for k, v in plan.items())))
    return [(k, str(v)) for k, v in items if v not in (None, "")]


def topology_text(frame: pd.DataFrame, meta: dict[str, Any]) -> str | None:
    """The run's NVLink-domain layout and how it was found (meta.json, else the result rows)."""
    topology = meta.get("topology") or {}
    if topology.get("description"):
        return str(topology["description"])
    if frame.empty or "num_domains" not in frame.columns:
        return None
    first = frame.iloc[0]
    return (
        f"{fmt_int(first.get('world_size'))} ranks in {fmt_int(first.get('num_domains'))} NVLink domain(s) "
        f"of up to {fmt_int(first.get('ranks_per_domain'))} ranks; found by "
        f"{fmt_text(first.get('layout_source'))}"
    )


def incomplete_note(meta: dict[str, Any]) -> str | None:
    """The line the pages of a stopped run start with ("INCOMPLETE: <reason>. ..."), or None."""
    reason = incomplete_reason(meta)
    if reason is None:
        return None
    return f"INCOMPLETE: {reason}. Only the phases that finished before the run stopped are reported."


def average_text(frame: pd.DataFrame) -> str | None:
    """nccl-tests' "Avg bus bandwidth" of the balanced all-to-all rows (mean time), None without any."""
    if balanced_rows(frame).empty:
        return None
    average = format_bandwidth(average_bus_bandwidth(frame))
    return f"Avg bus bandwidth (balanced all-to-all only, busbw from the mean time): {average} GB/s"


def _cpu_run_note(spec: SystemSpec) -> str | None:
    """The line a run with no spec opens with (a CPU run says what its figures measure)."""
    return None if has_figures(spec) else (spec.description or "No spec: no %spec is shown.")


def report_sections(
    frame: pd.DataFrame,
    ranks: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
) -> list[Block]:
    """The report page of a run as data, in page order (see the module docstring): the blocks
    ``summary_markdown`` and ``report_html`` render."""
    from commbench.report.profiler.kineto_overlap import overlap_section
    from commbench.report.profiler.profile import profile_sections

    extras = extras or ExtraTables()
    frame = with_knob_setting(frame)
    ranks = with_knob_setting(ranks)
    note = incomplete_note(meta)
    page: list[Block] = [
        Section(PAGE_TITLE, (Text(note, warning=True),) if note else (), level=1, keep_empty=True),
        verdict_section(verdict),
    ]
    cpu_note = _cpu_run_note(spec)
    page += [Text(cpu_note, warning=True)] if cpu_note else []
    page += [Text(EMULATED_NOTE, warning=True)] if any_emulated(frame) else []
    page.append(_headline(frame, spec))
    page.append(_results(frame, spec))
    links = link_class_table(frame)
    if links is not None:
        page.append(Section("By link class", (Text(link_class_legend(spec)), links)))
    costs = skew_cost_table(frame)
    if costs is not None:
        page.append(Section("What skew costs", (Text(SKEW_COST_NOTE), costs)))
    page += [s for s in (repeat_range_section(frame), replicas_section(frame)) if s is not None]
    page += budget_sections(frame, meta, spec)
    if not extras.profile.empty:
        page += profile_sections(extras.profile, extras.arrivals, extras.peers)
    if extras.kineto is not None:
        page.append(overlap_section(extras.kineto))
    page += pairs_sections(extras.pairs, spec, verdict)
    page += health_sections(extras.health)
    per_rank = [Figure(f"Per-rank bytes: {title}", build) for title, build in rank_figures(ranks)]
    page.append(Section("Per rank", tuple(per_rank)))  # plots only: HTML
    page.append(Section("Environment", (Fields(environment_lines(meta)),)))
    conventions: list[Block] = [Text(f"{label}: {text}.") for label, text in _convention_lines(frame, meta)]
    page.append(Section("Conventions", (*conventions, Code(CONVENTIONS))))
    return page


def _headline(frame: pd.DataFrame, spec: SystemSpec) -> Section:
    """The spec compared with, nccl-tests' average bus bandwidth, and (HTML) the two headline plots: the
    balanced sweep and the per-GPU bandwidth, or the soak's bandwidth over time first."""
    blocks: list[Block] = [Text(f"Spec: {spec_legend(spec)}.")]
    average = average_text(frame)
    if average:
        blocks.append(Text(average))
    per_gpu = Figure(
        "Achieved per-GPU bandwidth" + (" vs spec" if has_figures(spec) else ""),
        lambda: per_gpu_figure(frame, spec),
    )
    soak = soak_figure(frame)
    if soak is not None:  # a soak run: bandwidth over time first (its balanced sweep is a single size)
        blocks += [Figure("Soak: bandwidth per round over time", lambda: soak), per_gpu]
    else:
        blocks += [Figure("Balanced all-to-all: bus bandwidth vs size", lambda: balanced_figure(frame, spec))]
        blocks.append(per_gpu)
    return Section("Headline", tuple(blocks))


def _results(frame: pd.DataFrame, spec: SystemSpec) -> Section:
    """A table per pattern, under the note saying which time each table's bandwidths use."""
    blocks: list[Block] = [] if frame.empty else [Text(time_note(spec))]
    blocks += [Section(name, (table,), level=3) for name, table in pattern_tables(frame)]
    return Section("Results", tuple(blocks), keep_empty=True)


def _convention_lines(frame: pd.DataFrame, meta: dict[str, Any]) -> list[tuple[str, str]]:
    """How this run was timed and checked, and its topology, as (label, text)."""
    lines = [
        ("Timing", timing_text(frame, meta_values(meta).get("blocking"))),
        ("Check", check_text(frame)),
        ("Topology", topology_text(frame, meta)),
    ]
    return [(label, text) for label, text in lines if text]


def budget_sections(frame: pd.DataFrame, meta: dict[str, Any], spec: SystemSpec) -> list[Section]:
    """The comm/compute budget of the run's MoE cases (``profiler.budget.moe_budget``); none when the run has
    no MoE case or its model cannot be read back."""
    from commbench.errors import CommbenchError
    from commbench.inputs.models import load_model
    from commbench.report.profiler.budget import moe_budget

    args = meta_values(meta)
    names = args.get("models") or args.get("model")  # the models the cases ran (plan), else the option
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
    shown = with_knob_setting(frame)  # the knobs that vary between cases, as every other table shows them
    if KNOB_SETTING_COLUMN in shown.columns:
        shown = shown.assign(knobs=shown[KNOB_SETTING_COLUMN])
    try:
        section = moe_budget(shown, models, float(tflops) if tflops else None, spec)
    except CommbenchError:
        return []
    return [] if section is None else [section]


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
    cpu = cpu_pairs(frame)
    for (test, link), group in frame.groupby(["test", "link_class"], sort=False):
        column, unit = ("time_us", "us") if test == "latency" else ("GBps", "GB/s")
        values = pd.to_numeric(group[column], errors="coerce")
        worst = group.loc[values.idxmax() if test == "latency" else values.idxmin()]
        rows.append(
            [
                TEST_WORDS.get(str(test), str(test)), class_words(str(link), cpu), str(len(group)),
                f"{values.median():.4g} {unit}", f"{int(worst['src'])}->{int(worst['dst'])}",
                f"{float(worst[column]):.4g} {unit}",
            ]
        )  # fmt: skip
    return rows


_SUMMARY_HEADERS = ["test", "link class", "pairs", "median", "worst pair", "worst"]


def pairs_sections(pairs: pd.DataFrame, spec: SystemSpec, verdict: Verdict | None) -> list[Section]:
    """The pairwise link test: the per-class table, and (HTML) the [src][dst] bandwidth and latency
    heatmaps with the verdict's flagged pairs outlined; none without a pairwise test."""
    if pairs.empty:
        return []
    frame = pair_frame(pairs, spec)
    flagged = _flagged(verdict)
    table = Table(_SUMMARY_HEADERS, _summary_rows(frame), text_columns={0, 1, 3, 4, 5})
    world = int(max(frame["src"].max(), frame["dst"].max())) + 1
    heatmaps = []
    for test, unit in (("bandwidth", "GB/s"), ("latency", "us"), ("bidir", "GB/s")):
        if (frame["test"] == test).any():
            title = f"[src][dst] {TEST_WORDS[test]} ({unit})"
            panel = (pair_matrix(frame, test, world), title, unit, flagged.get(test, {}))
            heatmaps.append((title, lambda panel=panel: heatmap_figure([panel])))
    blocks: list[Block] = [
        Text(PAIRS_NOTE),
        table,
        Text("Matrices: pairs.csv (long form).", only="markdown"),
        FigureRow("Heatmaps: rows = sender (src), columns = receiver (dst)", heatmaps),
    ]
    return [Section("Pairwise link test", tuple(blocks))]


_HEALTH_HEADERS = ["rank", "host", "GPU", "links up", "min link MB/s", "ECC", "persist.", "driver",
                   "NVLink errors before -> after", "ECC uncorr. before -> after", "Xid"]  # fmt: skip
_NVLINK_ERRORS = ALL_NVLINK_COUNTERS  # NVLink 4's and NVLink 5's: each GPU has one of the two
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


def health_sections(health: pd.DataFrame) -> list[Section]:
    """The GPU health table (one line on a run without GPUs); none without health.csv."""
    if health.empty:
        return []
    rows = _health_rows(health)
    text = HEALTH_NOTE if rows else "GPU health: no rank has a GPU (CPU run): nothing to read."
    table = [Table(_HEALTH_HEADERS, rows, text_columns=set(range(11)), wide=True)] if rows else []
    return [Section("GPU health", (Text(text), *table))]


def summary_markdown(
    frame: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
    ranks: pd.DataFrame | None = None,
) -> str:
    """summary.md: ``report_sections`` rendered as Markdown."""
    ranks = ranks if ranks is not None else pd.DataFrame()
    return markdown_page(report_sections(frame, ranks, meta, spec, verdict, extras))


def report_html(
    frame: pd.DataFrame,
    ranks: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
) -> str:
    """report.html: ``report_sections`` rendered as one self-contained HTML page (plots embedded as PNG)."""
    return html_page(PAGE_TITLE, report_sections(frame, ranks, meta, spec, verdict, extras))
