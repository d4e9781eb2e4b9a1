"""report.html's plots: matplotlib figures of the results and rank frames (the renderer,
``report.pages.render``, embeds them as PNG data URLs).

Plots use matplotlib's object API (no pyplot: no global state, no display backend needed); each returns a
figure, or None when there is nothing to plot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from commbench.inputs.specs import SystemSpec, has_figures
from commbench.plain import is_missing
from commbench.report.frame import balanced_rows
from commbench.report.knobs import KNOB_SETTING_COLUMN
from commbench.report.pages.tables import fmt_size, fmt_text
from commbench.run.case import group_by_case

_LOG_SPAN = 20.0  # largest/smallest value beyond which the per-GPU bar chart goes log


def _balanced_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The balanced all-to-all rows with a finite busbw (nccl-tests' mean time)."""
    balanced = balanced_rows(frame)
    return (
        balanced[np.isfinite(balanced["busbw_mean_GBps"].astype(float))] if not balanced.empty else balanced
    )


def _setting_keys(frame: pd.DataFrame) -> list[str]:
    """One line per backend, and per knob setting in a sweep."""
    return ["backend", KNOB_SETTING_COLUMN] if KNOB_SETTING_COLUMN in frame.columns else ["backend"]


def balanced_figure(frame: pd.DataFrame, spec: SystemSpec) -> Any:
    """The balanced all-to-all's busbw and algbw against size, one line per backend (and knob setting)."""
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
    return figure


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


def per_gpu_figure(frame: pd.DataFrame, spec: SystemSpec) -> Any:
    """One bar per MoE row and the balanced sweep's peak per backend: per-GPU GB/s (against the spec)."""
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
    # Each bar's label: its % of the spec, or without a spec its value.
    labels = [f"{r['pct_spec']:.2g}%" for r in records] if has_figures(spec) else [f"{v:.3g}" for v in values]
    for bar, label in zip(bars, labels, strict=True):
        axes.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="x-small",
        )
    if has_figures(spec):  # a CPU run has no spec line to draw
        axes.axhline(spec.nvlink_GBps_per_direction, color="red", linestyle="--", label=f"spec {spec.name}")
    # A bar's length reads as its value only on a linear axis from 0: log only when the bars and the spec
    # line span more than _LOG_SPAN (a CPU run next to a 900 GB/s spec).
    shown = np.append(values, spec.nvlink_GBps_per_direction) if has_figures(spec) else values
    positive = shown[shown > 0]
    if positive.size and positive.max() / positive.min() > _LOG_SPAN:
        axes.set_yscale("log")
    else:
        axes.set_ylim(bottom=0)
    axes.set_xticks(positions, [_case_label(r) for r in records], fontsize="x-small")
    axes.set_ylabel("per-GPU GB/s, one direction")
    title = "Achieved per-GPU bandwidth (busbw; balanced: mean time, MoE: p50)"
    axes.set_title(title + (" vs spec, labels: % of spec" if has_figures(spec) else ", no spec"))
    axes.grid(True, axis="y", which="both", alpha=0.3)
    if has_figures(spec):
        axes.legend(fontsize="small")
    return figure


_MAX_RANK_PLOTS = 12


def rank_figures(ranks: pd.DataFrame) -> list[tuple[str, Callable[[], Any]]]:
    """(title, build) of a plot per MoE case (at most ``_MAX_RANK_PLOTS``): per-rank sent/received bytes,
    where skew shows as one hot rank."""
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
        plots.append((title, lambda case=case, title=title: _rank_figure(case, title)))
    return plots


def _rank_figure(case: pd.DataFrame, title: str) -> Any:
    from matplotlib.figure import Figure

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
    return figure
