"""The pairwise link test inside a launch: run every pair (``run.pairwise``), judge the pairs on rank 0
(``report.pairs``), rerun the flagged ones to confirm them, and hand the rows and verdict elements back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from commbench.cli.acceptance import Acceptance
    from commbench.inputs.layout import Layout
    from commbench.inputs.limits import Limits
    from commbench.inputs.specs import SystemSpec
    from commbench.report.judge.verdict import Element
    from commbench.run.config import RunConfig, RunOptions
    from commbench.run.pairwise import PairwiseJob


@dataclass
class LinkTestOutcome:
    """Rank 0's result of the pairwise link test (other ranks: empty): pairs.csv rows, verdict elements,
    the bytes found wrong, how long it took."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    elements: list[Element] = field(default_factory=list)
    wrong: int = 0
    seconds: float = 0.0


def _progress_printer(started: float, layout: Layout, checkpoint: Any = None) -> Any:
    """Prints a line at about every tenth of the rounds (and the last): big racks have 71 rounds; each time
    the rows of the rounds done go to ``checkpoint`` too (pairs.csv, kept if the run is stopped later)."""
    from commbench.run.pairwise import pair_rows, row_order

    shown: set[int] = set()

    def show(done: int, total: int, samples: list[dict[str, Any]]) -> None:
        step = max(total // 10, 1)
        if done % step and done != total:
            return
        if done in shown:
            return
        shown.add(done)
        spent = time.monotonic() - started
        left = spent / done * (total - done)
        click.echo(f"commbench: pairwise round {done}/{total}, {spent:.1f} s, ~{left:.0f} s left", err=True)
        if checkpoint is not None and done < total:  # the last round's rows: the caller writes them all
            checkpoint(pair_rows(sorted(samples, key=row_order), layout))

    return show


def run_link_test(
    comm: Any, job: PairwiseJob, opts: RunOptions, layout: Layout, limits: Limits | None, spec: SystemSpec,
    checkpoint: Any = None,
) -> LinkTestOutcome:  # fmt: skip
    """Collective: the full schedule, then ``spread.confirm_reruns`` reruns of the flagged pairs; rank 0
    returns the rows and, judged by ``limits`` (rank 0 holds them; None elsewhere, or no verdict), the
    verdict elements. ``checkpoint(rows)`` (rank 0) gets the rows of the rounds done as the schedule goes
    on, with each progress line."""
    from commbench.report.frame import pair_frame
    from commbench.report.judge.pairs import (
        class_stats,
        confirm_pairs,
        find_slow_pairs,
        pair_elements,
        rerun_rounds,
    )
    from commbench.run.pairwise import pair_rows, round_robin_rounds, run_pairwise

    started = time.monotonic()
    rounds = round_robin_rounds(comm.world_size)
    if comm.rank == 0:
        pairs = sum(len(r) for r in rounds)
        click.echo(
            f"commbench: pairwise link test: {len(rounds)} rounds of up to {comm.world_size // 2} pairs "
            f"({pairs} pairs, both directions), {job.bandwidth_bytes} B and {job.latency_bytes} B messages",
            err=True,
        )
    samples = run_pairwise(comm, job, opts, rounds, _progress_printer(started, layout, checkpoint))
    plan: tuple[list[list[tuple[int, int]]], int] | None = None
    outcome = LinkTestOutcome()
    if comm.rank == 0:
        outcome.rows = pair_rows(samples, layout)
        outcome.wrong = int(sum(int(row.get("wrong") or 0) for row in outcome.rows))
    if comm.rank == 0 and limits is not None:
        rule = limits.pairwise
        frame = pair_frame(outcome.rows, spec)
        stats = class_stats(frame, rule)
        flags = find_slow_pairs(frame, stats, rule)
        again = rerun_rounds(flags)
        plan = (again, limits.spread.confirm_reruns if again else 0)
    again, reruns = comm.all_gather_object(plan)[0]
    rerun_frames = []
    for _ in range(reruns):
        rerun = run_pairwise(comm, job, opts, again)
        if comm.rank == 0:
            rerun_frames.append(pair_frame(pair_rows(rerun, layout), spec))
    if comm.rank == 0 and limits is not None:
        planted = {(delay.src, delay.dst) for delay in opts.inject_delay if delay.dst is not None}
        confirmed = confirm_pairs(
            flags, stats, rerun_frames, rule, limits.spread, cpu_run=limits.cpu_run, planted=planted
        )
        outcome.elements = pair_elements(frame, stats, confirmed, rule, limits.cpu_run)
        outcome.wrong += int(sum(frame_wrong(f) for f in rerun_frames))
        failed = sum(item.status == "FAIL" for item in confirmed)
        outcome.seconds = time.monotonic() - started
        click.echo(
            f"commbench: pairwise link test done in {outcome.seconds:.1f} s: {len(flags)} pair result(s) "
            f"flagged, {failed} confirmed by {reruns} rerun(s); {outcome.wrong} wrong byte(s)",
            err=True,
        )
    return outcome


def frame_wrong(frame: Any) -> int:
    """Wrong bytes in a pair frame."""
    if frame.empty or "wrong" not in frame.columns:
        return 0
    return int(frame["wrong"].fillna(0).sum())


def pairwise_job(config: RunConfig, acceptance: Acceptance, backend: str, alone: bool) -> PairwiseJob | None:
    """The pairwise link test: message sizes from the limits (``pairwise.*_bytes``, per spec) unless
    --pair-bytes says otherwise; the launch's warm-up and iterations. None (said on stderr) on a backend that
    moves no data (mock, sim): their ranks have no links to measure; UsageError when it was to run alone
    (``run --pattern pairwise``)."""
    from commbench.backends import get_backend
    from commbench.errors import UsageError
    from commbench.run.dist import is_rank0_process
    from commbench.run.pairwise import PairwiseJob

    if not get_backend(backend).moves_data:
        if alone:
            raise UsageError(
                f"the pairwise link test needs a backend that moves data; {backend} moves none: use "
                "--backend nccl or gloo"
            )
        if is_rank0_process():
            click.echo(f"commbench: pairwise link test skipped: backend {backend} moves no data", err=True)
        return None

    rule = acceptance.limits.pairwise
    pair_bytes = config.pairwise.pair_bytes
    job = PairwiseJob(
        bandwidth_bytes=pair_bytes if pair_bytes is not None else rule.bandwidth_bytes,
        latency_bytes=rule.latency_bytes,
        warmup=min(int(config.timing.warmup or 0), 5),
        iters=int(config.timing.iters or 1),
    )
    job.check(config.world_size)
    return job
