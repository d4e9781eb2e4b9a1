"""The profiler's report: where each microsecond of a phase goes (steps), who arrives late (stragglers), the
per-peer arrival matrix, and the merged Chrome/Perfetto trace of every rank.

Inputs are the long tables a profiled run writes (``run.profile``): profile.csv (rank, iteration, step, us;
steps "phase" = the whole call, the API time, "transfer" = the payload steps, "other" = what no step
covers), arrivals.csv (rank, iteration, entered_us / left_us on rank 0's clock from the iteration's first
entry, waited_us until the last rank entered) and peers.csv (shmem-emu: when each source's data was seen).

A case is a ``run.case.Case`` with its repeat (the profile rows carry every case column of their result
row), named by its label. Statistics: a step's "max across ranks" is the largest per-rank p50 (the rank
that spends longest in it); p50 and p99 are over every (rank, iteration). A rank's lateness in an iteration
is its entry minus the median entry of the other ranks; "last" counts the iterations where it entered after
every other rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from commbench.report.pages.render import Figure, Section, Text
from commbench.report.pages.tables import Table
from commbench.run.case import Case, group_by_case

PROFILE_FILE = "profile.csv"
ARRIVALS_FILE = "arrivals.csv"
PEERS_FILE = "peers.csv"
TRACE_FILE = "trace.json"
SUMMARY_STEPS = ("phase", "transfer")  # not parts of the stacked bar: the whole call and a sum of steps
PROFILE_NOTE = (
    "Per step of each phase: max across ranks = the largest per-rank p50 (us), p50 / p99 over every (rank, "
    "iteration); share = the step's p50 sum over ranks / the phase's. phase = the API time (the whole call, "
    "the timer's figure); transfer = the payload steps alone (payload transfer or send-back; put issue + "
    "signal wait on NVSHMEM-style backends); other = what no step covers (Python glue, buffer growth). "
    "Steps are host clock on CPU, CUDA events on GPU, each call synchronized (iteration timing)."
)
STRAGGLER_NOTE = (
    "Who arrives late, per phase: every rank's entry into each timed call on rank 0's clock (offsets from "
    "ping-pongs at start; uncertainty in the table). last = share of iterations the rank entered after all "
    "others; lateness = its entry minus the median entry of the other ranks (mean and p50 over iterations); "
    "waited = time from its entry until the last rank entered."
)


def _groups(frame: pd.DataFrame) -> list[tuple[Case, pd.DataFrame]]:
    """The rows of each measured case (``run.case.Case`` with its repeat: one profile per measurement)."""
    return group_by_case(frame, repeat=True)


def step_stats(profile: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, step): max across ranks (of per-rank p50), p50, p99 and the share of the phase."""
    records = []
    for case, rows in _groups(profile):
        phase_sum = float(rows[rows["step"] == "phase"].groupby("rank")["us"].median().sum())
        for step, steps in rows.groupby("step", sort=False):
            per_rank = steps.groupby("rank")["us"].median()
            values = steps["us"].to_numpy(dtype=float)
            records.append(
                {
                    "case": case.label, "step": step, "max_rank_us": float(per_rank.max()),
                    "slowest_rank": int(per_rank.idxmax()), "p50_us": float(np.percentile(values, 50)),
                    "p99_us": float(np.percentile(values, 99)),
                    "share_pct": 100.0 * float(per_rank.sum()) / phase_sum if phase_sum > 0 else float("nan"),
                }
            )  # fmt: skip
    return pd.DataFrame(records)


def step_table(profile: pd.DataFrame) -> Table | None:
    """The per-step table, or None without a profile."""
    if profile.empty:
        return None
    stats = step_stats(profile)
    order = {"phase": 0, "transfer": 1, "other": 3}
    stats = stats.assign(_order=[order.get(step, 2) for step in stats["step"]])
    stats = stats.sort_values(["case", "_order"], kind="stable")
    rows = [
        [r.case, r.step, f"{r.max_rank_us:.1f} (rank {r.slowest_rank})", f"{r.p50_us:.1f}", f"{r.p99_us:.1f}",
         f"{r.share_pct:.1f}" if r.step not in SUMMARY_STEPS or r.step == "transfer" else "100.0"]
        for r in stats.itertuples()
    ]  # fmt: skip
    headers = ["case", "step", "max across ranks (us)", "p50 (us)", "p99 (us)", "share of phase (%)"]
    return Table(headers, rows, text_columns={0, 1, 2}, wide=True)


def straggler_stats(arrivals: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, rank): share of iterations it arrived last, its lateness (mean, p50) and wait."""
    records = []
    for case, rows in _groups(arrivals):
        table = rows.pivot_table(index="iteration", columns="rank", values="entered_us", aggfunc="first")
        entered = table.to_numpy(dtype=float)
        ranks = [int(rank) for rank in table.columns]
        if entered.shape[1] < 2:
            continue
        last = entered.argmax(axis=1)
        waited = rows.pivot_table(index="iteration", columns="rank", values="waited_us", aggfunc="first")
        uncertainty = rows.groupby("rank")["uncertainty_us"].max()
        for column, rank in enumerate(ranks):
            others = np.delete(entered, column, axis=1)
            lateness = entered[:, column] - np.median(others, axis=1)
            records.append(
                {
                    "case": case.label, "rank": rank, "iterations": int(entered.shape[0]),
                    "last_pct": 100.0 * float(np.mean(last == column)),
                    "lateness_mean_us": float(np.mean(lateness)),
                    "lateness_p50_us": float(np.median(lateness)),
                    "waited_p50_us": float(np.median(waited[rank].to_numpy(dtype=float))),
                    "clock_uncertainty_us": float(uncertainty.get(rank, 0.0)),
                }
            )  # fmt: skip
    return pd.DataFrame(records)


def straggler_table(arrivals: pd.DataFrame, names: dict[int, str] | None = None) -> Table | None:
    """The straggler table: per case, the ranks sorted by how often they came last."""
    if arrivals.empty:
        return None
    stats = straggler_stats(arrivals)
    if stats.empty:
        return None
    stats = stats.sort_values(["case", "last_pct", "lateness_mean_us"], ascending=[True, False, False])
    rows = [
        [r.case, str(r.rank) + (f" ({names[r.rank]})" if names and r.rank in names else ""),
         f"{r.last_pct:.0f}", f"{r.lateness_mean_us:.1f}", f"{r.lateness_p50_us:.1f}",
         f"{r.waited_p50_us:.1f}", f"{r.clock_uncertainty_us:.1f}"]
        for r in stats.itertuples()
    ]  # fmt: skip
    headers = ["case", "rank", "last (%)", "lateness mean (us)", "lateness p50 (us)", "waited p50 (us)",
               "clock uncertainty (us)"]  # fmt: skip
    return Table(headers, rows, text_columns={0, 1}, wide=True)


def peer_table(peers: pd.DataFrame) -> list[Section]:
    """Per case, the [src][dst] p50 of when the receiver saw each source's data (us after it entered): a
    sub-section titled by the case, holding its matrix."""
    if peers.empty:
        return []
    parts = []
    for case, rows in _groups(peers):
        matrix = rows.pivot_table(index="src", columns="dst", values="seen_us", aggfunc="median")
        headers = ["src \\ dst", *(str(int(dst)) for dst in matrix.columns)]
        body = [
            [str(int(src)), *(f"{value:.1f}" if value == value else "-" for value in matrix.loc[src])]
            for src in matrix.index
        ]
        parts.append(Section(case.label, (Table(headers, body, text_columns={0}),), level=4))
    return parts


PEER_NOTE = (
    "Per-peer arrival matrix (us after the receiver entered the call, p50): when each source's data was "
    "seen, from the backend's per-source signals."
)


def profile_sections(profile: pd.DataFrame, arrivals: pd.DataFrame, peers: pd.DataFrame) -> list[Section]:
    """The page's profiler sections: where the time goes (the per-step table, the stacked bars per rank),
    who arrives late, and the per-peer arrival matrices; none for a run without --profile."""
    steps = step_table(profile)
    if steps is None:
        return []
    title = "Per rank: p50 of each step per iteration (stacked)"
    sections = [
        Section(
            "Profile: where the time goes",
            (Text(PROFILE_NOTE), steps, Figure(title, lambda: stacked_bars_figure(profile))),
        )
    ]
    stragglers = straggler_table(arrivals) if not arrivals.empty else None
    if stragglers is not None:
        sections.append(Section("Who arrives late", (Text(STRAGGLER_NOTE), stragglers)))
    matrices = peer_table(peers)
    if matrices:
        sections.append(Section("Per-peer arrivals", (Text(PEER_NOTE), *matrices), level=3))
    return sections


def stacked_bars_figure(profile: pd.DataFrame) -> Any:
    """Per case, a stacked bar per rank of its steps' p50 (us): where each rank's time goes."""
    from matplotlib.figure import Figure

    groups = _groups(profile)
    if not groups:
        return None
    columns = min(len(groups), 3)
    lines = (len(groups) + columns - 1) // columns
    figure = Figure(figsize=(5.0 * columns, 3.6 * lines), layout="constrained")
    names = sorted(set(profile["step"]) - set(SUMMARY_STEPS))
    colors = {name: f"C{index % 10}" for index, name in enumerate(names)}  # one color per step in every plot
    for index, (case, rows) in enumerate(groups):
        axes = figure.add_subplot(lines, columns, index + 1)
        parts = rows[~rows["step"].isin(SUMMARY_STEPS)]
        table = parts.groupby(["rank", "step"])["us"].median().unstack(fill_value=0.0)
        bottom = np.zeros(len(table))
        for step in table.columns:
            values = table[step].to_numpy(dtype=float)
            axes.bar(table.index.astype(str), values, bottom=bottom, label=str(step), color=colors.get(step))
            bottom += values
        axes.set_title(case.label, fontsize=9)
        axes.set_xlabel("rank")
        axes.set_ylabel("p50 per iteration (us)")
        axes.legend(fontsize=6)
    return figure


def chrome_trace(spans: Sequence[dict[str, Any]], names: dict[int, str] | None = None) -> dict[str, Any]:
    """The Chrome trace (Perfetto, chrome://tracing) of every rank: a process per rank, a thread per track
    (the phase, then each step), complete ("X") events in microseconds from the first span, on rank 0's
    clock; arguments carry the iteration, bytes and case."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(float(span["start"]) for span in spans)
    tracks: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for rank in sorted({int(span["rank"]) for span in spans}):
        label = f"rank {rank}" + (f" ({names[rank]})" if names and rank in names else "")
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "ts": 0, "args": {"name": label}}
        )
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                       "args": {"sort_index": rank}})  # fmt: skip
    for span in spans:
        rank, track = int(span["rank"]), str(span["track"])
        if (rank, track) not in tracks:
            tid = 0 if track == "phase" else len([key for key in tracks if key[0] == rank]) + 1
            tracks[(rank, track)] = tid
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "ts": 0,
                           "args": {"name": track}})  # fmt: skip
        events.append(
            {
                "name": str(span["name"]), "ph": "X", "pid": rank, "tid": tracks[(rank, track)],
                "ts": round(1e6 * (float(span["start"]) - origin), 3),
                "dur": round(1e6 * max(float(span["duration"]), 0.0), 3), "cat": track,
                "args": {key: value for key, value in span.get("args", {}).items() if value is not None},
            }
        )  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def trace_text(spans: Sequence[dict[str, Any]], names: dict[int, str] | None = None) -> str:
    return json.dumps(chrome_trace(spans, names), separators=(",", ":")) + "\n"
