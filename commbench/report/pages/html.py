"""The human-readable pages of a report folder: summary.md and report.html (tables, plots as embedded PNG).

Both read a ``results_frame``, the per-rank frame (``rank_frame``), meta.json's content and the spec; the
figures come from ``commbench.report.frame``, the tables from ``commbench.report.pages.tables``. Plots use
matplotlib's object API (no pyplot: no global state, no display backend needed).
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd

from commbench.inputs.specs import SystemSpec, has_figures
from commbench.plain import is_missing
from commbench.report.analysis.repeats import REPEAT_NOTE, repeat_range_table
from commbench.report.analysis.soak import soak_figure
from commbench.report.frame import CONVENTIONS, average_bus_bandwidth, balanced_rows
from commbench.report.judge.verdict import Verdict
from commbench.report.knobs import KNOB_SETTING_COLUMN, with_knob_setting
from commbench.report.pages.modes import check_text, timing_text
from commbench.report.pages.sections import (
    PNG_URL,
    ExtraTables,
    budget_section,
    figure_png,
    health_section,
    kineto_section,
    pairs_html,
    pairs_markdown,
    profile_section,
    replicas_section,
)
from commbench.report.pages.tables import (
    SKEW_COST_NOTE,
    any_emulated,
    fmt_int,
    fmt_size,
    fmt_text,
    format_bandwidth,
    format_table,
    link_class_legend,
    link_class_table,
    pattern_tables,
    skew_cost_table,
    spec_legend,
    time_note,
)
from commbench.report.pages.verdict_view import verdict_html, verdict_markdown
from commbench.run.case import group_by_case


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
    args = meta.get("args") or {}
    if args:
        items.append(("arguments", ", ".join(f"{k}={v}" for k, v in args.items())))
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


def incomplete_reason(meta: dict[str, Any]) -> str | None:
    """Why a stopped run's report is incomplete (meta.json ``status`` "incomplete"), or None for a run that
    finished."""
    if meta.get("status") != "incomplete":
        return None
    reason = meta.get("incomplete_reason")
    return reason if isinstance(reason, str) and reason else "the run stopped before every case finished"


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


EMULATED_NOTE = (
    "Emulated (a model, an emulator or CPU ranks): times and bandwidths below are not GPU fabric figures."
)


def _cpu_run_note(spec: SystemSpec) -> str | None:
    """The line a run with no spec opens with (a CPU run says what its figures measure)."""
    return None if has_figures(spec) else (spec.description or "No spec: no %spec is shown.")


def summary_markdown(
    frame: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
) -> str:
    """summary.md: the verdict, the headline figures against the spec, a table per pattern, link classes,
    skew cost, the pairwise link test, then the environment and the conventions."""
    frame = with_knob_setting(frame)
    parts = ["# commbench report", ""]
    if incomplete_note(meta):
        parts += [f"**{incomplete_note(meta)}**", ""]
    parts += verdict_markdown(verdict)
    if _cpu_run_note(spec):
        parts += [f"**{_cpu_run_note(spec)}**", ""]
    if any_emulated(frame):
        parts += [f"**{EMULATED_NOTE}**", ""]
    parts += ["## Headline", "", f"Spec: {spec_legend(spec)}.", ""]
    if average_text(frame):
        parts += [average_text(frame), ""]
    parts += ["## Results", ""]
    if not frame.empty:
        parts += [time_note(spec), ""]
    for name, table in pattern_tables(frame, "markdown"):
        parts += [f"### {name}", "", table, ""]
    links = link_class_table(frame, "markdown")
    if links:
        parts += ["## By link class", "", link_class_legend(spec), "", links, ""]
    costs = skew_cost_table(frame, "markdown")
    if costs:
        parts += ["## What skew costs", "", SKEW_COST_NOTE, "", costs, ""]
    spread = repeat_range_table(frame, "markdown")
    if spread:
        parts += ["## Range over repeats", "", REPEAT_NOTE, "", spread, ""]
    parts += replicas_section(frame, "markdown")
    parts += budget_section(frame, meta, spec, "markdown")
    parts += profile_section(extras or ExtraTables(), "markdown")
    parts += kineto_section(extras or ExtraTables(), "markdown")
    parts += pairs_markdown(extras or ExtraTables(), spec)
    parts += health_section(extras or ExtraTables(), "markdown")
    parts += ["## Environment", ""]
    parts += [f"- {key}: `{value}`" for key, value in environment_lines(meta)]
    parts += ["", "## Conventions", ""]
    for label, text in _convention_lines(frame, meta):
        parts += [f"{label}: {text}.", ""]
    parts += ["```", CONVENTIONS, "```"]
    return "\n".join(parts) + "\n"


def _convention_lines(frame: pd.DataFrame, meta: dict[str, Any]) -> list[tuple[str, str]]:
    """How this run was timed and checked, and its topology, as (label, text)."""
    lines = [
        ("Timing", timing_text(frame)),
        ("Check", check_text(frame)),
        ("Topology", topology_text(frame, meta)),
    ]
    return [(label, text) for label, text in lines if text]


_HTML_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: 1em; white-space: pre-wrap; }
.warning { color: #a00; font-weight: bold; }
img { max-width: 100%; }
.wide { max-width: 100%; overflow-x: auto; }
.wide table { font-size: 0.8em; }
.wide th, .wide td { padding: 0.2em 0.4em; }
.verdict.PASS { color: #060; } .verdict.WARN { color: #a60; }
.verdict.FAIL, .verdict.stopped { color: #a00; }
.wide td { white-space: nowrap; }
.heatmaps { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.heatmaps img { max-width: 32%; min-width: 420px; }
"""


def report_html(
    frame: pd.DataFrame,
    ranks: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
) -> str:
    """A self-contained HTML page in summary.md's order, with plots (PNG embedded as base64) after the
    tables."""
    esc = html.escape
    frame = with_knob_setting(frame)
    ranks = with_knob_setting(ranks)
    body = ["<h1>commbench report</h1>"]
    if incomplete_note(meta):
        body.append(f'<p class="warning">{esc(incomplete_note(meta) or "")}</p>')
    body += verdict_html(verdict)
    if _cpu_run_note(spec):
        body.append(f'<p class="warning">{esc(_cpu_run_note(spec) or "")}</p>')
    if any_emulated(frame):
        body.append(f'<p class="warning">{html.escape(EMULATED_NOTE)}</p>')
    body += ["<h2>Headline</h2>", f"<p>Spec: {esc(spec_legend(spec))}.</p>"]
    if average_text(frame):
        body.append(f"<p>{esc(average_text(frame) or '')}</p>")
    plots = [
        ("Balanced all-to-all: bus bandwidth vs size", _plot_balanced(frame, spec)),
        (
            "Achieved per-GPU bandwidth" + (" vs spec" if has_figures(spec) else ""),
            _plot_per_gpu_vs_spec(frame, spec),
        ),
        *((f"Per-rank bytes: {title}", png) for title, png in _plot_ranks(ranks)),
    ]
    soak = soak_figure(frame)
    if soak is not None:  # a soak run: bandwidth over time first of the plots
        plots.insert(0, ("Soak: bandwidth per round over time", figure_png(soak)))
        plots = plots[:1] + plots[2:]  # one plot of the balanced sweep is a single size: drop it
    for title, png in plots[:2]:
        if png:
            body.append(f'<h3>{esc(title)}</h3><img alt="{esc(title)}" src="{PNG_URL}{png}">')
    body.append("<h2>Results</h2>")
    if not frame.empty:
        body.append(f"<p>{esc(time_note(spec))}</p>")
    for name, table in pattern_tables(frame, "html"):
        body += [f"<h3>{esc(name)}</h3>", f'<div class="wide">{table}</div>']
    links = link_class_table(frame, "html")
    if links:
        body += [
            "<h2>By link class</h2>",
            f"<p>{esc(link_class_legend(spec))}</p>",
            f'<div class="wide">{links}</div>',
        ]
    costs = skew_cost_table(frame, "html")
    if costs:
        body += ["<h2>What skew costs</h2>", f"<p>{esc(SKEW_COST_NOTE)}</p>", costs]
    spread = repeat_range_table(frame, "html")
    if spread:
        body += [
            "<h2>Range over repeats</h2>",
            f"<p>{esc(REPEAT_NOTE)}</p>",
            f'<div class="wide">{spread}</div>',
        ]
    body += replicas_section(frame, "html")
    body += budget_section(frame, meta, spec, "html")
    body += profile_section(extras or ExtraTables(), "html")
    body += kineto_section(extras or ExtraTables(), "html")
    body += pairs_html(extras or ExtraTables(), spec, verdict)
    body += health_section(extras or ExtraTables(), "html")
    if any(png for _, png in plots[2:]):
        body.append("<h2>Per rank</h2>")
    for title, png in plots[2:]:
        if png:
            body.append(f'<h3>{esc(title)}</h3><img alt="{esc(title)}" src="{PNG_URL}{png}">')
    environment = format_table(["item", "value"], environment_lines(meta), "html", text_columns={0, 1})
    body += ["<h2>Environment</h2>", environment, "<h2>Conventions</h2>"]
    body += [f"<p>{esc(label)}: {esc(text)}.</p>" for label, text in _convention_lines(frame, meta)]
    body.append(f"<pre>{esc(CONVENTIONS)}</pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>commbench report</title>'
        f"<style>{_HTML_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# ----------------------------------------------------------------------------------------------------------
# Plots


def _balanced_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The balanced all-to-all rows with a finite busbw (nccl-tests' mean time)."""
    balanced = balanced_rows(frame)
    return (
        balanced[np.isfinite(balanced["busbw_mean_GBps"].astype(float))] if not balanced.empty else balanced
    )


def _setting_keys(frame: pd.DataFrame) -> list[str]:
    """One line per backend, and per knob setting in a sweep."""
    return ["backend", KNOB_SETTING_COLUMN] if KNOB_SETTING_COLUMN in frame.columns else ["backend"]


def _plot_balanced(frame: pd.DataFrame, spec: SystemSpec) -> str | None:
    from matplotlib.figure import Figure

    balanced = _balanced_rows(frame)
    if balanced.empty:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.add_subplot()
    for key, group in balanced.groupby(_setting_keys(balanced), sort=False):
        name = " ".join(str(part) for part in key) if isinstance(key, tuple) else str(key)
        group = group.sort_values("size_bytes")
        axes.plot(group["size_bytes"], group["busbw_mean_GBps"], marker="o", label=f"{name} busbw")
        axes.plot(group["size_bytes"], group["algbw_mean_GBps"], marker=".", ls=":", label=f"{name} algbw")
    if has_figures(spec):  # a CPU run has no spec line to draw
        axes.axhline(spec.nvlink_GBps_per_direction, color="red", linestyle="--", label=f"spec {spec.name}")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("size: bytes each rank sends (B)")
    axes.set_ylabel("GB/s (1e9 B/s), one direction")
    axes.set_title("Balanced all-to-all: bus bandwidth vs size (time: the mean, as nccl-tests)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    return figure_png(figure)


def _case_label(record: dict[str, Any]) -> str:
    parts = [fmt_text(record.get("pattern"))]
    if record.get("phase") == "alltoall":
        parts.append("peak " + fmt_size(record.get("size_bytes")).split(" (")[-1].rstrip(")"))
    else:
        parts.append(fmt_text(record.get("skew")))
    parts.append(fmt_text(record.get("phase")))
    if not is_missing(record.get(KNOB_SETTING_COLUMN)):
        parts.append(str(record[KNOB_SETTING_COLUMN]))
    return "\n".join(parts)


def _plot_per_gpu_vs_spec(frame: pd.DataFrame, spec: SystemSpec) -> str | None:
    from matplotlib.figure import Figure

    if frame.empty:
        return None
    # One bar per MoE row, plus the balanced sweep's peak busbw per backend (the best-case reference).
    moe = frame[frame["phase"] != "alltoall"] if "phase" in frame else frame
    balanced = _balanced_rows(frame)
    if not balanced.empty:  # nccl-tests' figures: from the mean time
        balanced = balanced.assign(
            per_gpu_GBps=balanced["busbw_mean_GBps"], pct_spec=balanced["pct_spec_mean"]
        )
        balanced = balanced.sort_values("per_gpu_GBps").groupby(_setting_keys(balanced), sort=False).tail(1)
    cases = pd.concat([balanced, moe])
    cases = cases[np.isfinite(cases["per_gpu_GBps"].astype(float))]
    if cases.empty:
        return None
    records = cases.to_dict("records")
    figure = Figure(figsize=(max(6.0, 0.9 * len(records) + 2), 4.8))
    axes = figure.add_subplot()
    positions = np.arange(len(records))
    values = cases["per_gpu_GBps"].astype(float).to_numpy()
    bars = axes.bar(positions, values, color="tab:blue")
    for bar, record in zip(bars, records, strict=True):
        if not has_figures(spec):  # no spec: no % label
            break
        axes.annotate(
            f"{record['pct_spec']:.2g}%",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="x-small",
        )
    if has_figures(spec):  # a CPU run has no spec line to draw
        axes.axhline(spec.nvlink_GBps_per_direction, color="red", linestyle="--", label=f"spec {spec.name}")
    axes.set_yscale("log")
    axes.set_xticks(positions, [_case_label(r) for r in records], fontsize="x-small")
    axes.set_ylabel("per-GPU GB/s, one direction")
    title = "Achieved per-GPU bandwidth (busbw; balanced: mean time, MoE: p50)"
    axes.set_title(title + (" vs spec, labels: % of spec" if has_figures(spec) else ", no spec"))
    axes.grid(True, axis="y", which="both", alpha=0.3)
    if has_figures(spec):
        axes.legend(fontsize="small")
    return figure_png(figure)


_MAX_RANK_PLOTS = 12


def _plot_ranks(ranks: pd.DataFrame) -> list[tuple[str, str]]:
    """Per-rank sent/received bytes of each MoE case (where skew shows as one hot rank)."""
    from matplotlib.figure import Figure

    needed = {"rank", "phase", "sent_bytes", "recv_bytes"}
    if ranks.empty or not needed <= set(ranks.columns):
        return []
    moe = ranks[ranks["phase"] != "alltoall"]
    if moe.empty:
        return []
    plots = []
    # One plot per MoE layer (run.case.Case.layer); its bytes are the same in every repeat: the first's.
    layers = [
        (layer, rows) for layer, rows in group_by_case(moe, repeat=True, layer=True) if layer.repeat == 0
    ]
    for layer, case in layers[:_MAX_RANK_PLOTS]:
        title = layer.label
        phases = list(dict.fromkeys(case["phase"]))
        figure = Figure(figsize=(4.5 * len(phases) + 1, 3.5), layout="constrained")
        for index, phase in enumerate(phases, start=1):
            axes = figure.add_subplot(1, len(phases), index)
            data = case[case["phase"] == phase].sort_values("rank")
            positions = np.arange(len(data))
            axes.bar(positions - 0.2, data["sent_bytes"] / 1e6, width=0.4, label="sent")
            axes.bar(positions + 0.2, data["recv_bytes"] / 1e6, width=0.4, label="received")
            axes.set_xticks(positions, [str(r) for r in data["rank"]], fontsize="x-small")
            axes.set_xlabel("rank")
            axes.set_ylabel("MB (1e6 B), self included")
            axes.set_title(phase)
            axes.legend(fontsize="x-small")
        figure.suptitle(title)
        plots.append((title, figure_png(figure)))
    return plots
