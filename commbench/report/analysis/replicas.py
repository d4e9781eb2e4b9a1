"""What EPLB replicas buy: MoE cases without and with --replicas side by side, and the placement printed.

``replicas_table`` pairs every MoE case run with ``--replicas N`` (its rows carry the knob ``replicas=N``)
with the same case without them (no ``replicas`` knob), from the result rows alone, so a report re-rendered
from disk shows the same table. Per pair: the busiest rank's dispatch rows received over the mean
(``max_recv_bytes / (total_bytes / world_size)``: received tokens in token mode, selections in selection
mode), and each phase's time p50 (the median over the case's repeats) without and with, and their ratio.
A pair is one MoE layer (``run.case.Case.layer``) whose knob setting, the replicas knob aside, is the same.

``describe_replicas`` and ``replicas_json`` are what ``commbench pattern --replicas N`` prints: the placement
and the rank load (selections received per rank) before and after.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from commbench.plain import is_missing, knob_setting, knobs_text
from commbench.report.pages.render import Section, Text
from commbench.report.pages.tables import Table, fmt_int, format_table
from commbench.run.case import group_by_case
from commbench.traffic.pattern import Pattern, build_pattern
from commbench.traffic.replicas import Placement
from commbench.traffic.routing import RoutingConfig, replica_placement

REPLICAS_KNOB = "replicas"
REPLICAS_NOTE = (
    "Each MoE case ran twice in the same launch: with contiguous expert placement and with N EPLB replicas "
    "(redundant experts placed by a greedy balance of this routing's measured expert load, each expert's "
    "tokens split among its replicas). recv max/mean = dispatch rows received by the busiest rank / the mean "
    "over ranks (tokens in token mode, selections in selection mode; 1 = balanced); time = p50, the median "
    "over repeats; ratio = with / without (below 1: the replicas made the phase faster)."
)
# Columns a results frame needs for the table.
_NEEDED = (
    "pattern",
    "skew",
    "tokens_per_rank",
    "phase",
    "knobs",
    "time_us_p50",
    "max_recv_bytes",
    "total_bytes",
)


def _replicas(knobs: Any) -> int:
    value = knob_setting(None if is_missing(knobs) else knobs).get(REPLICAS_KNOB, "0")
    return int(value) if str(value).isdigit() else 0


def _other_knobs(knobs: Any) -> str:
    setting = knob_setting(None if is_missing(knobs) else knobs)
    return knobs_text({key: value for key, value in setting.items() if key != REPLICAS_KNOB})


def _cell(value: float, digits: int = 1) -> str:
    return "-" if not np.isfinite(value) else f"{value:.{digits}f}"


def _phase_figures(rows: pd.DataFrame) -> dict[str, float]:
    """recv max/mean of the dispatch rows, and each phase's p50 time (median over repeats)."""
    figures: dict[str, float] = {}
    for phase in ("dispatch", "combine"):
        mine = rows[rows["phase"] == phase]
        times = pd.to_numeric(mine["time_us_p50"], errors="coerce").dropna()
        figures[phase] = float(times.median()) if len(times) else float("nan")
    dispatch = rows[rows["phase"] == "dispatch"]
    mean = pd.to_numeric(dispatch["total_bytes"], errors="coerce") / pd.to_numeric(
        dispatch["world_size"], errors="coerce"
    )
    ratio = (pd.to_numeric(dispatch["max_recv_bytes"], errors="coerce") / mean.where(mean > 0)).dropna()
    figures["recv"] = float(ratio.median()) if len(ratio) else float("nan")
    return figures


def replicas_table(frame: pd.DataFrame) -> Table | None:
    """The "What EPLB replicas buy" table of a results frame; None when no MoE case ran with --replicas
    next to the same case without."""
    if frame.empty or not set(_NEEDED) <= set(frame.columns):
        return None
    moe = frame[frame["phase"].isin(["dispatch", "combine"])]
    if moe.empty:
        return None
    # The pair's case: the MoE layer with its knob setting less the replicas knob.
    moe = moe.assign(_replicas=[_replicas(knobs) for knobs in moe["knobs"]])
    moe = moe.assign(knobs=[_other_knobs(knobs) for knobs in moe["knobs"]])
    swept = moe["knobs"].nunique() > 1
    table_rows = []
    for layer, case in group_by_case(moe, layer=True):
        without = case[case["_replicas"] == 0]
        if without.empty:
            continue
        before = _phase_figures(without)
        for replicas, with_rows in case[case["_replicas"] > 0].groupby("_replicas", sort=True):
            after = _phase_figures(with_rows)
            row = [str(layer.pattern), str(layer.skew), fmt_int(layer.tokens_per_rank)]
            row += [layer.knobs or "-"] if swept else []
            row += [str(replicas), _cell(before["recv"], 3), _cell(after["recv"], 3)]
            for phase in ("dispatch", "combine"):
                ratio = after[phase] / before[phase] if before[phase] > 0 else float("nan")
                row += [_cell(before[phase]), _cell(after[phase]), _cell(ratio, 2)]
            table_rows.append(row)
    if not table_rows:
        return None
    headers = ["model", "skew", "tokens/rank", *(["knobs"] if swept else []), "replicas"]
    headers += ["recv max/mean without", "with"]
    for phase in ("dispatch", "combine"):
        headers += [f"{phase} p50 without (us)", "with (us)", "ratio"]
    text_columns = (0, 1, 3) if swept else (0, 1)
    return Table(headers, table_rows, text_columns=text_columns, wide=True)


def replicas_section(frame: pd.DataFrame) -> Section | None:
    """The page's "What EPLB replicas buy" section, or None (no case ran with and without --replicas)."""
    table = replicas_table(frame) if not frame.empty else None
    return None if table is None else Section("What EPLB replicas buy", (Text(REPLICAS_NOTE), table))


def _rank_load_ratio(pattern: Pattern) -> float:
    received = pattern.dispatch_selections.sum(axis=0)
    mean = float(received.mean())
    return float(received.max()) / mean if mean else float("nan")


def _token_ratio(pattern: Pattern) -> float:
    received = pattern.dispatch_tokens.sum(axis=0)
    mean = float(received.mean())
    return float(received.max()) / mean if mean else float("nan")


def describe_replicas(placement: Placement, without: Pattern, replicated: Pattern, top: int = 16) -> str:
    """``commbench pattern --replicas N``: the rank load before and after, the replicated experts and every
    rank's slots."""
    expected = placement.expected_rank_load()
    expected_ratio = float(expected.max() / expected.mean()) if expected.mean() else float("nan")
    kept = int(placement.expert_load.sum())
    lines = [
        f"EPLB replicas: {placement.replicas} redundant experts, {placement.num_slots} slots on "
        f"{placement.world_size} ranks ({placement.slots_per_rank} per rank), placed from the measured "
        "expert load of this routing (EPLB's global policy, the one layer modelled)",
        f"rank load (selections received) max/mean: {_cell(_rank_load_ratio(without), 3)} without -> "
        f"{_cell(_rank_load_ratio(replicated), 3)} with replicas (expected from the placement "
        f"{_cell(expected_ratio, 3)})",
        f"tokens received (dispatch rows, token mode) max/mean: {_cell(_token_ratio(without), 3)} without -> "
        f"{_cell(_token_ratio(replicated), 3)} with replicas",
    ]
    ranks = placement.expert_ranks()
    multi = [e for e in np.argsort(-placement.expert_load, kind="stable") if placement.replica_count[e] > 1]
    rows = []
    for expert in multi[:top]:
        share = placement.expert_load[expert] / kept if kept else 0.0
        where = ", ".join(str(rank) for rank in ranks[expert])
        rows.append(
            [str(int(expert)), f"{100 * share:.2f}%", str(int(placement.replica_count[expert])), where]
        )
    if rows:
        lines += ["", f"replicated experts (by load; {len(multi)} of {placement.num_experts}):"]
        lines.append(format_table(["expert", "load share", "replicas", "ranks"], rows, text_columns=(3,)))
        if len(multi) > top:
            lines.append(f"... {len(multi) - top} more (--json lists every expert)")
    per_rank = placement.slot_expert.reshape(placement.world_size, -1)
    replicated_experts = placement.replica_count > 1
    lines += ["", "placement (rank: expected load, its experts; * = an expert with replicas):"]
    for rank, experts in enumerate(per_rank):
        cells = " ".join(f"{int(e)}{'*' if replicated_experts[e] else ''}" for e in experts)
        lines.append(f"  rank {rank}: {expected[rank]:.0f}: {cells}")
    return "\n".join(lines)


def replicas_json(placement: Placement, without: Pattern, replicated: Pattern) -> dict[str, Any]:
    """The placement and the rank load before and after, JSON-ready (``pattern --replicas N --json``)."""
    return {
        "replicas": placement.replicas,
        "slots_per_rank": placement.slots_per_rank,
        "policy": "global",
        "replica_split": "global token index modulo the expert's replica count",
        "expert_ranks": placement.expert_ranks(),
        "rank_experts": placement.slot_expert.reshape(placement.world_size, -1).tolist(),
        "expected_rank_load": [float(x) for x in placement.expected_rank_load()],
        "rank_load_max_mean": {
            "without": _rank_load_ratio(without),
            "with": _rank_load_ratio(replicated),
        },
        "rank_tokens_max_mean": {"without": _token_ratio(without), "with": _token_ratio(replicated)},
    }


def replicas_summary(cfg: RoutingConfig, send_mode: str, replicated: Pattern) -> tuple[str, dict[str, Any]]:
    """(text, JSON) of ``commbench pattern --replicas N``: ``replicated`` is ``cfg``'s pattern; the pattern
    without replicas is built here from the same routing."""
    placement = replica_placement(cfg)
    without = build_pattern(replace(cfg, replicas=0), send_mode, replicated.nodes)
    return describe_replicas(placement, without, replicated), replicas_json(placement, without, replicated)
