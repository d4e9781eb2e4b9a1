"""The comm/compute budget of one MoE layer: can the dispatch + combine all-to-all hide behind the experts?

A vendor's MoE throughput claim (the seed record: 1,648 TFLOPs per GPU training DeepSeek-V3 on GB300 NVL72,
>97% per-GPU efficiency from 256 to 1,024 GPUs) holds only when dispatch and combine overlap with expert
compute. This module puts the two side by side for one MoE layer on its busiest rank:

- expert FLOPs = 2 x 3 x hidden x moe_intermediate x selections: a SwiGLU expert does three matmuls (gate,
  up, down) of hidden x moe_intermediate multiply-adds per (token, expert) selection, 2 FLOPs each;
  ``selections`` = the (token, expert) selections the busiest rank's experts receive in the layer (in token
  send mode too: a token sent once to a rank is still computed once per selected expert there);
- compute time = FLOPs / per-GPU throughput: ``--tflops`` (default 1,648, the record's delivered training
  throughput per GPU, not a peak) and the spec's dense BF16 / FP8 peaks;
- comm time = the measured (or modelled) dispatch + combine time of the layer.

The criterion (``CRITERION``): DualPipe-style overlap runs one micro-batch's all-to-all while another
micro-batch of the same size computes its experts, so the all-to-all hides when comm <= the compute it
overlaps. ``forward`` compares one forward all-to-all with one forward's expert compute (inference, or a
two-micro-batch prefill); ``training`` pairs a forward chunk with a backward chunk as DualPipe does: 3 x the
forward FLOPs (the backward computes input and weight gradients, ~2 x forward) against 2 x the all-to-all
(the backward sends the same rows back through both all-to-alls). Only the routed experts count as compute:
attention and shared experts also overlap, so a "cannot hide" says the experts alone cannot hide it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.fabric.ep_groups import Simulation, grouped_pattern
from commbench.inputs.models import ModelConfig
from commbench.inputs.specs import SystemSpec, load_spec

# Delivered DeepSeek-V3 pre-training throughput per GPU on GB300 NVL72 (the seed record): what the whole
# model achieved, not a tensor-core peak. GB200 NVL72 delivered 606 in the same comparison.
RECORD_TFLOPS = 1648.0
RECORD_NOTE = (
    "--tflops default 1,648: delivered DeepSeek-V3 pre-training throughput per GPU on GB300 NVL72 (the "
    "record), the whole model's average, not a peak"
)
SWIGLU_MATMULS = 3  # gate and up projections (hidden -> moe_intermediate), down projection back
FLOPS_PER_MULTIPLY_ADD = 2
TRAINING_COMPUTE_FACTOR = 3  # forward + backward (input gradients + weight gradients, each ~ a forward)
TRAINING_COMM_FACTOR = 2  # the backward sends the same rows back through both all-to-alls
MODES = ("forward", "training")
MAX_TFLOPS = 1e6  # one GPU at 1 EFLOP/s: anything above is a typo (units)
CRITERION = (
    "DualPipe-style overlap runs one micro-batch's dispatch + combine while another micro-batch (the same "
    "size here) computes its experts: the all-to-all hides when comm <= the compute it overlaps "
    "(comm/compute <= 1). forward: one forward all-to-all vs one forward's expert compute; training: a "
    f"forward chunk paired with a backward chunk, {TRAINING_COMPUTE_FACTOR} x the forward FLOPs vs "
    f"{TRAINING_COMM_FACTOR} x the all-to-all. Compute = routed experts on the busiest rank only "
    "(attention and shared experts, which also overlap, are not counted)"
)
SLOWEST_NOTE = (
    "both sides are the slowest rank's: the busiest rank's experts, the all-to-all's max over ranks"
)
FORMULA = (
    "expert FLOPs (forward) = 2 x 3 x hidden x moe_intermediate x selections (SwiGLU: three matmuls, 2 FLOPs "
    "per multiply-add); selections = (token, expert) pairs the busiest rank's experts receive in one layer; "
    "compute time = FLOPs / (TFLOPs x 1e12)"
)


def _missing_intermediate(model: ModelConfig) -> str:
    return (
        f"not computed: no moe_intermediate in model {model.name} (add moe_intermediate: <one routed "
        "expert's FFN width>, Hugging Face moe_intermediate_size)"
    )


def check_tflops(tflops: float) -> float:
    """``tflops`` as a float when it is a finite per-GPU throughput in (0, MAX_TFLOPS]; UsageError if not."""
    value = float(tflops)
    if not math.isfinite(value) or not 0 < value <= MAX_TFLOPS:
        raise UsageError(f"--tflops must be a per-GPU TFLOP/s figure in (0, {MAX_TFLOPS:g}], got {tflops!r}")
    return value


def expert_flops(
    model: ModelConfig, selections_on_busiest_rank: int | np.ndarray, training: bool = False
) -> float | np.ndarray:
    """FLOPs of the routed experts for ``selections_on_busiest_rank`` (token, expert) selections (a number
    or an array of them): 2 x 3 x hidden x moe_intermediate per selection, x 3 for a training step
    (forward + backward). UsageError when the model has no ``moe_intermediate``."""
    if model.moe_intermediate is None:
        raise UsageError(_missing_intermediate(model))
    selections = np.asarray(selections_on_busiest_rank, dtype=np.float64)
    if np.any(selections < 0):
        raise UsageError(f"selections must be >= 0, got {selections_on_busiest_rank!r}")
    per_selection = FLOPS_PER_MULTIPLY_ADD * SWIGLU_MATMULS * model.hidden * model.moe_intermediate
    flops = per_selection * selections * (TRAINING_COMPUTE_FACTOR if training else 1)
    return float(flops) if flops.ndim == 0 else flops


def compute_time_us(flops: float | np.ndarray, tflops: float) -> float | np.ndarray:
    """Microseconds to do ``flops`` at ``tflops`` TFLOP/s per GPU: flops / (tflops x 1e12) x 1e6."""
    time_us = np.asarray(flops, dtype=np.float64) / (check_tflops(tflops) * 1e6)
    return float(time_us) if time_us.ndim == 0 else time_us


def busiest_rank_selections(dispatch_selections: np.ndarray) -> int:
    """The most (token, expert) selections any rank's experts receive: the max column sum of a [src][dst]
    selections matrix (``Pattern.dispatch_selections``), or of every group of a [group, src, dst] one
    (``GroupedPattern.dispatch_selections``). Self traffic counts: a rank computes its own tokens too."""
    matrix = np.asarray(dispatch_selections, dtype=np.int64)
    if matrix.ndim not in (2, 3) or matrix.shape[-1] != matrix.shape[-2] or matrix.size == 0:
        raise ValueError(f"expected a square [src][dst] (or [group, src, dst]) matrix, got {matrix.shape}")
    return int(matrix.sum(axis=-2).max())


@dataclass(frozen=True)
class Throughput:
    """A per-GPU throughput the budget is computed at, and what it is."""

    label: str
    tflops: float


def throughputs(tflops: float = RECORD_TFLOPS, spec: SystemSpec | None = None) -> tuple[Throughput, ...]:
    """``--tflops`` first, then the spec's dense BF16 and FP8 peaks where the catalogue states them."""
    given = check_tflops(tflops)
    label = "--tflops (record, delivered)" if given == RECORD_TFLOPS else "--tflops"
    found = [Throughput(label, given)]
    for precision in ("bf16", "fp8"):
        peak = getattr(spec, f"dense_tflops_{precision}", None) if spec is not None else None
        if peak is not None and math.isfinite(peak) and peak > 0:
            found.append(Throughput(f"{spec.name} dense {precision.upper()} peak", float(peak)))
    return tuple(found)


@dataclass(frozen=True)
class BudgetRow:
    """One throughput and mode: the compute it gives, the comm it must hide, their ratio and the verdict."""

    throughput: Throughput
    mode: str  # "forward" or "training" (see the module docstring)
    compute_us: float
    comm_us: float  # the all-to-all time this mode counts (training: TRAINING_COMM_FACTOR x the layer's)
    ratio: float  # comm / compute
    hides: bool  # ratio <= 1


@dataclass(frozen=True)
class Budget:
    """One MoE layer's budget on its busiest rank; ``missing`` says why it was not computed (then no rows)."""

    model: str
    selections: int  # (token, expert) selections the busiest rank's experts receive
    comm_us: float  # dispatch + combine of one layer, measured or modelled
    forward_flops: float
    rows: tuple[BudgetRow, ...]
    missing: str = ""

    @property
    def computed(self) -> bool:
        return not self.missing

    def row(self, mode: str, throughput: int = 0) -> BudgetRow:
        """The row of ``mode`` ("forward" / "training") at the ``throughput``-th throughput (0: --tflops)."""
        matches = [r for r in self.rows if r.mode == mode]
        return matches[throughput]

    def verdict(self) -> str:
        """The hide / not-hide line at --tflops, training and forward-only."""
        if not self.computed:
            return f"{self.model}: {self.missing}"
        training, forward = self.row("training"), self.row("forward")

        def said(row: BudgetRow) -> str:
            verb = "hides" if row.hides else "cannot hide"
            sign = "<=" if row.hides else ">"
            return (
                f"{row.mode} {verb} it ({row.comm_us:.1f} us of all-to-all vs {row.compute_us:.1f} us of "
                f"expert compute: comm/compute {row.ratio:.2f} {sign} 1)"
            )

        return (
            f"{self.model} at {training.throughput.tflops:g} TFLOPs/GPU, DualPipe-style overlap: "
            f"{said(training)}; {said(forward)}"
        )


def make_budget(
    model: ModelConfig,
    selections: int,
    comm_us: float,
    tflops: float = RECORD_TFLOPS,
    spec: SystemSpec | None = None,
) -> Budget:
    """The budget of one layer: ``selections`` on the busiest rank, ``comm_us`` = its dispatch + combine."""
    speeds = throughputs(tflops, spec)  # a bad --tflops is refused even when nothing else is computed
    if model.moe_intermediate is None:
        return Budget(model.name, int(selections), float(comm_us), math.nan, (), _missing_intermediate(model))
    forward_flops = float(expert_flops(model, selections))
    rows = []
    for speed in speeds:
        for mode in MODES:
            training = mode == "training"
            compute = float(compute_time_us(forward_flops, speed.tflops)) * (
                TRAINING_COMPUTE_FACTOR if training else 1
            )
            comm = float(comm_us) * (TRAINING_COMM_FACTOR if training else 1)
            ratio = comm / compute if compute > 0 else math.inf
            rows.append(BudgetRow(speed, mode, compute, comm, ratio, bool(ratio <= 1.0)))
    return Budget(model.name, int(selections), float(comm_us), forward_flops, tuple(rows))


# simulate's keyword inputs that decide the (token, expert) selections (grouped_pattern's arguments); the send
# mode only changes how they travel, not which ranks' experts receive them.
PATTERN_OPTIONS = ("tokens_per_rank", "skew", "ep_size", "seed", "sample_tokens", "exact")


def simulated_budgets(
    model: ModelConfig,
    simulation: Simulation,
    tflops: float = RECORD_TFLOPS,
    spec: SystemSpec | str | None = None,
    **simulate_inputs: Any,
) -> list[tuple[int, Budget]]:
    """(world size, budget) for every size of ``simulation``: its modelled dispatch + combine ("total" rows)
    against the busiest rank's selections of the same traffic. ``simulate_inputs`` are the keyword inputs
    ``simulate`` ran with; those in ``PATTERN_OPTIONS`` rebuild its pattern (deterministic in them, so it is
    the traffic the fabric model timed), the others are ignored."""
    check_tflops(tflops)
    system = load_spec(spec) if spec is not None else None
    options = {key: simulate_inputs[key] for key in PATTERN_OPTIONS if key in simulate_inputs}
    budgets = []
    for row in (row for row in simulation.rows if row["phase"] == "total"):
        world = int(row["ranks"])
        if model.moe_intermediate is None:  # no routing needed to say so
            selections = 0
        elif row.get("busiest_rank_selections") is not None:  # a simulation row that carries it
            selections = int(row["busiest_rank_selections"])
        elif world in simulation.busiest_selections:  # the simulation's own pattern: not routed again
            selections = simulation.busiest_selections[world]
        else:
            pattern = grouped_pattern(model, world, **options)
            selections = busiest_rank_selections(pattern.dispatch_selections)
        budgets.append((world, make_budget(model, selections, float(row["time_us"]), tflops, system)))
    return budgets


def budget_notes(budgets: Sequence[Budget]) -> list[str]:
    """The lines that say what a budget table means (formula, criterion, the record's figure)."""
    notes = [FORMULA, CRITERION, RECORD_NOTE]
    if any(b.computed for b in budgets):
        notes.append(SLOWEST_NOTE)
    return notes
