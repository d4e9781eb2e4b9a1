"""The comm/compute budget as a table: measured MoE cases (the report's section) or modelled sizes (simulate).

``budget_table`` formats budgets (``commbench.fabric.budget``) through the one table printer; ``moe_budget``
builds them from a results frame's MoE rows: per MoE layer (``run.case.Case.layer``), dispatch + combine
time p50 (the median over its repeats) and the busiest rank's (token, expert) selections from the rows'
``busiest_rank_selections`` column (``BUSIEST_COLUMN``). A selection-mode case without that column still
has it: its dispatch row's ``max_recv_bytes / row_bytes`` is that count (one row per selection, self
traffic included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import pandas as pd

from commbench.fabric.budget import RECORD_TFLOPS, Budget, budget_notes, check_tflops, make_budget
from commbench.inputs.models import ModelConfig
from commbench.inputs.specs import SystemSpec
from commbench.plain import is_missing
from commbench.report.frame import fabric_rows
from commbench.report.pages.render import Bullets, Section
from commbench.report.pages.tables import Table
from commbench.run.case import Case, group_by_case, model_digest

# The result-row column the harness adds to an MoE case's dispatch and combine rows: the most (token,
# expert) selections any rank's experts received in the layer (Pattern.dispatch_selections.sum(0).max()).
BUSIEST_COLUMN = "busiest_rank_selections"
HEADERS = (
    "busiest-rank selections",
    "expert GFLOP (fwd)",
    "throughput",
    "TFLOPs/GPU",
    "a2a (us)",
    "experts fwd (us)",
    "comm/compute fwd",
    "comm/compute train",
    "hides it? fwd / train",
)


BUDGET_TITLE = "Can the all-to-all hide behind the experts?"


def _yes(hides: bool) -> str:
    return "yes" if hides else "no"


def budget_table(labelled: Sequence[tuple[str, Budget]], label: str, not_judged: Iterable[str] = ()) -> Table:
    """One row per budget and throughput, after a ``label`` column (the world size, the case); a budget
    that was not computed gets one row saying why; the ``not_judged`` names (CPU times) show their ratios
    but "not judged" for whether it hides."""
    body = []
    unjudged = set(not_judged)
    for name, budget in labelled:
        if not budget.computed:
            body.append([name, "-", "-", budget.missing, "-", f"{budget.comm_us:.1f}", "-", "-", "-", "-"])
            continue
        forward_rows = [row for row in budget.rows if row.mode == "forward"]
        for index, forward in enumerate(forward_rows):
            training = budget.row("training", index)
            body.append(
                [
                    name,
                    str(budget.selections),
                    f"{budget.forward_flops / 1e9:.1f}",
                    forward.throughput.label,
                    f"{forward.throughput.tflops:g}",
                    f"{budget.comm_us:.1f}",
                    f"{forward.compute_us:.1f}",
                    f"{forward.ratio:.2f}",
                    f"{training.ratio:.2f}",
                    "not judged" if name in unjudged else f"{_yes(forward.hides)} / {_yes(training.hides)}",
                ]
            )
    return Table((label, *HEADERS), body, text_columns=(0, 3, 9), wide=True)


def modelled_budget_text(budgets: Sequence[tuple[int, Budget]]) -> str:
    """``commbench simulate``'s budget: a title, the table per world size, a verdict line per size, notes."""
    lines = [
        "Can the all-to-all hide behind the experts? (one MoE layer, busiest rank, modelled all-to-all)",
        budget_table([(str(world), budget) for world, budget in budgets], "ranks").text(),
        *(f"{world} ranks: {budget.verdict()}" for world, budget in budgets),
        *(f"note: {line}" for line in budget_notes([budget for _, budget in budgets])),
    ]
    return "\n".join(lines)


def budgets_json(budgets: Sequence[tuple[int, Budget]]) -> list[dict[str, Any]]:
    """The budgets as JSON-ready dicts (``simulate --json``): every field and the verdict, per world size."""
    return [{"ranks": world, **asdict(budget), "verdict": budget.verdict()} for world, budget in budgets]


def _busiest(dispatch: pd.DataFrame) -> int | None:
    """The case's busiest-rank selections: the rows' column, else (selection mode) received rows."""
    if BUSIEST_COLUMN in dispatch.columns:
        values = pd.to_numeric(dispatch[BUSIEST_COLUMN], errors="coerce").dropna()
        if not values.empty:
            return int(values.max())
    if "send_mode" not in dispatch.columns or not dispatch["send_mode"].astype(str).eq("selection").all():
        return None
    if {"max_recv_bytes", "row_bytes"} - set(dispatch.columns):
        return None
    received = pd.to_numeric(dispatch["max_recv_bytes"], errors="coerce")
    row_bytes = pd.to_numeric(dispatch["row_bytes"], errors="coerce")
    counts = (received / row_bytes).dropna()
    return int(counts.max()) if not counts.empty else None


def _model_for(layer: Case, models: Sequence[ModelConfig]) -> ModelConfig | None:
    """The model of an MoE layer: the one whose traffic digest the rows carry, else (rows written before
    they carried one) the one of the pattern's name."""
    if layer.model_digest is not None:
        return next((model for model in models if model_digest(model) == layer.model_digest), None)
    return next((model for model in models if model.name == layer.pattern), None)


def moe_budget(
    frame: pd.DataFrame,
    models: ModelConfig | Iterable[ModelConfig],
    tflops: float | None = RECORD_TFLOPS,
    spec: SystemSpec | None = None,
) -> Section | None:
    """The budget section of a run (``BUDGET_TITLE``): a table per MoE case of ``frame`` (results rows; a
    case's pattern names its model in ``models``), the hide / not-hide line of each case, and what the
    figures mean. None when the frame has no dispatch + combine case. ``tflops`` None: the record (an
    option left at its default)."""
    tflops = check_tflops(RECORD_TFLOPS if tflops is None else tflops)
    if frame.empty or "phase" not in frame.columns:
        return None
    moe = frame[frame["phase"].astype(str).isin(("dispatch", "combine"))]
    if moe.empty:
        return None
    chosen = [models] if isinstance(models, ModelConfig) else list(models)
    fabric = fabric_rows(moe)  # once: it looks up every registered backend's class
    labelled: list[tuple[str, Budget]] = []
    verdicts: list[str] = []
    cpu_labels: list[str] = []
    skipped: list[str] = []
    for layer, case in group_by_case(moe, layer=True):  # dispatch and combine of a layer, every repeat
        label = layer.label
        phases = {
            phase: pd.to_numeric(rows["time_us_p50"], errors="coerce").median()
            for phase, rows in case.groupby(case["phase"].astype(str))
        }
        model = _model_for(layer, chosen)
        selections = _busiest(case[case["phase"].astype(str) == "dispatch"])
        if len(phases) < 2 or any(is_missing(value) for value in phases.values()):
            skipped.append(f"{label}: not computed: needs both dispatch and combine times")
        elif model is None:
            skipped.append(f"{label}: not computed: model {layer.pattern} not given (or another of its name)")
        elif selections is None:
            skipped.append(f"{label}: not computed: the rows have no {BUSIEST_COLUMN} column")
        else:
            comm = float(phases["dispatch"] + phases["combine"])
            budget = make_budget(model, selections, comm, tflops, spec)
            labelled.append((label, budget))
            if fabric.loc[case.index].all():
                verdicts.append(budget.verdict())
            else:
                cpu_labels.append(
                    label
                )  # the figures are shown; a hide / not-hide line on a host's times would mislead
                backends = ", ".join(sorted(set(case["backend"].astype(str)))) if "backend" in case else "?"
                verdicts.append(
                    f"{label}: not judged: CPU all-to-all times ({backends}), not a GPU fabric's; the table "
                    "shows what this host's times would mean"
                )
    verdicts += skipped
    notes = budget_notes([budget for _, budget in labelled])
    if not fabric.all():
        notes.append("CPU or emulated rows: the all-to-all time is this host's, not a GPU fabric's")
    table = [budget_table(labelled, "case", cpu_labels)] if labelled else []
    return Section(BUDGET_TITLE, (*table, Bullets(verdicts + notes)))
