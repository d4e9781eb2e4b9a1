"""What every rank of a ``run`` or ``suite`` launch does: the GPU preflight, the jobs, the slow-rank reruns,
the pairwise link test and the health counters after; rank 0 writes the report as phases finish, the
verdict, and prints the table.

Preflight (``hardware.health``, judged by ``report.preflight``): before anything is measured every rank
reads its GPU through NVML (links up, speeds, ECC, persistence, versions, fabric clique) and starts a watch
of its health counters (NVLink CRC/replay/recovery, ECC, Xid events, clock slowdowns); rank 0 prints the
findings at once, and after the last measurement every rank takes the counters again. Both go into the
verdict (groups preflight and health) and health.csv. A CPU rank has nothing to read: every check SKIPs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from commbench.cli.progress import Progress

if TYPE_CHECKING:
    from commbench.cli.linktest import LinkTestOutcome
    from commbench.cli.plan import LaunchPlan
    from commbench.inputs.layout import Layout
    from commbench.report import ReportWriter


class _Rank0:
    """What rank 0 holds as the launch goes on: what its end needs if it is stopped (``_finish_stopped``)."""

    def __init__(self) -> None:
        self.writer: ReportWriter | None = None
        self.names: dict[int, str] = {}
        self.extra: list[Any] = []  # verdict elements judged in the launch (preflight, pairwise, health)


def launch_worker(comm: Any, plan: LaunchPlan) -> None:
    """Every rank runs the jobs, reruns the cases with a slow rank (``cli.acceptance``) and runs the
    pairwise link test (``cli.linktest``); rank 0 writes the report as phases finish, the verdict, and
    prints the table. Rank 0 stopped (or failing) at any point finishes the folder (``cli.ending``)."""
    held = _Rank0()
    try:
        _work(comm, plan, held)
    except BaseException as stopped_by:
        if comm.rank == 0:
            _finish_stopped(plan, held, stopped_by)
        raise


def _work(comm: Any, plan: LaunchPlan, held: _Rank0) -> None:
    from commbench.backends import get_backend
    from commbench.cli.acceptance import confirm_slow_ranks, make_judge, rank_names
    from commbench.run.placement import gather_layout

    backend_class = get_backend(plan.options.backend)
    layout = gather_layout(comm, plan.options)  # collective: every rank's place
    health = _Health.start(comm, plan, layout)  # collective: before anything is measured
    if plan.resume:  # only rank 0 can read the folder (other hosts may not see it): it says what is left
        from commbench.cli.resume import read_interrupted, remaining_jobs

        left = remaining_jobs(plan.jobs, read_interrupted(plan.out_dir)[1])[0] if comm.rank == 0 else None
        plan = replace(plan, jobs=comm.all_gather_object(left)[0])
    if comm.rank != 0:
        jobs, _ = _run_cases(comm, plan, backend_class, layout, None, None)
        if plan.acceptance is not None:
            confirm_slow_ranks(comm, jobs, plan.options, backend_class, layout, [], plan.acceptance)
        _link_test(comm, plan, layout, None, [])
        health.finish(comm, None, [])
        return

    from commbench.hardware.environment import capture_environment
    from commbench.report import ReportWriter, results_table
    from commbench.report.judge.verdict import RunStatus
    from commbench.run.liveness import deferred_stop
    from commbench.run.nccl_env import applied

    env = capture_environment()
    env["argv"] = plan.meta.get("argv", env["argv"])
    env["command"] = plan.meta.get("command", env["command"])
    if (nccl_errors := applied()) is not None:  # the TORCH_NCCL_* error handling in effect, and who set it
        env["nccl_error_handling"] = nccl_errors.to_meta()
    meta = {**plan.meta, "env": env, "topology": layout.to_meta()}
    # Adds the spec to meta.json; a resumed run keeps the rows already in the folder.
    token = plan.out_claim.token if plan.out_claim is not None else None
    writer = held.writer = ReportWriter(plan.out_dir, meta, plan.spec, token, resume=plan.resume)
    click.echo(f"commbench: topology: {layout.describe()}", err=True)
    progress = Progress(plan.total_steps, plan.spec, plan.swept_keys)
    names = held.names = rank_names(layout)
    extra = held.extra = list(health.preflight)
    profiled = _ProfileSink(writer, plan.config.profiler.trace) if plan.options.profile else None

    def sink(rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]]) -> None:
        with deferred_stop():  # a stop signal waits until these rows are written whole
            progress(rows, writer.add(rows, rank_rows))

    jobs, rank_rows = _run_cases(comm, plan, backend_class, layout, sink, progress, profiled)
    outcomes = []
    if plan.acceptance is not None:
        outcomes = confirm_slow_ranks(
            comm, jobs, plan.options, backend_class, layout, rank_rows, plan.acceptance
        )
    _link_test(comm, plan, layout, writer, extra)
    health.finish(comm, writer, extra)
    if profiled is not None:
        profiled.finish(names)
    judge = None
    if plan.acceptance is not None:
        judge = make_judge(plan.acceptance, RunStatus(), outcomes, names, extra)
    # The run has finished once its report has: a stop while it is rendered ends it INCOMPLETE too.
    frame = writer.finalize(judge=judge)
    if frame is not None and not frame.empty:
        click.echo(results_table(frame, writer.meta))


def _finish_stopped(plan: LaunchPlan, held: _Rank0, stopped_by: BaseException) -> None:
    """Rank 0 after a stop or a failure: keep whatever finished readable (summary, html, verdict), saying
    INCOMPLETE and why, or leave no folder when a stop came before anything finished (``cli.ending``); a
    second stop signal meanwhile does not cut it short. A spawned rank 0 whose launcher is gone also prints
    the lines the launcher would have."""
    from commbench.cli.acceptance import make_judge
    from commbench.cli.ending import (
        NOTHING_KEPT,
        discard_claim,
        incomplete_reason,
        kept_line,
        orphan_last_lines,
    )
    from commbench.report import results_table
    from commbench.report.judge.verdict import run_status_from_error
    from commbench.run.liveness import current_monitor, deferred_stop

    with deferred_stop():
        kept = None
        discard = discard_claim(plan.out_claim, stopped_by, plan.resume)
        try:
            if held.writer is None:  # stopped before meta.json: the claim alone to undo
                if discard is not None and discard.release_if_unused():
                    kept = NOTHING_KEPT
            else:
                judge = None
                if plan.acceptance is not None:
                    status = run_status_from_error(stopped_by)
                    judge = make_judge(plan.acceptance, status, (), held.names, held.extra)
                reason = incomplete_reason(stopped_by)
                frame = held.writer.finalize(incomplete=reason, judge=judge, discard=discard)
                kept = NOTHING_KEPT if frame is None else kept_line(plan.out_dir)
                if frame is not None and not frame.empty:
                    click.echo(results_table(frame, held.writer.meta))
        except Exception as exc:  # never mask the original error
            click.echo(f"commbench: could not finalize the partial report: {exc}", err=True)
        monitor = current_monitor()
        if monitor is not None and monitor.launcher_gone():
            orphan_last_lines(plan.out_dir, stopped_by, kept)


def _run_cases(
    comm: Any, plan: LaunchPlan, backend_class: type, layout: Layout, sink: Any, progress: Progress | None,
    profiler: Any = None,
) -> tuple[list[Any], list[dict[str, Any]]]:  # fmt: skip
    """Collective: the plan's jobs once, or under --soak round after round (repeat 0, 1, ...) until the
    soak's time is up, rank 0 deciding for all (their clocks differ); every row of a soak gets ``soak_s``,
    the seconds since the soak started. Returns (the jobs as run, one per round and case, in order; rank 0's
    rank rows, whose ``job_index`` points into them)."""
    from commbench.run import torch_profiler

    # --torch-profiler: a Kineto trace per rank of the cases (measured calls marked), kineto/rank<R>.json.
    with torch_profiler.capture(plan.config.profiler.torch_profiler, plan.out_dir, comm.rank):
        return _run_rounds(comm, plan, backend_class, layout, sink, progress, profiler)


def _run_rounds(
    comm: Any, plan: LaunchPlan, backend_class: type, layout: Layout, sink: Any, progress: Progress | None,
    profiler: Any,
) -> tuple[list[Any], list[dict[str, Any]]]:  # fmt: skip
    from commbench.run.harness import run_jobs

    if plan.soak_s is None:
        return plan.jobs, run_jobs(comm, plan.jobs, plan.options, backend_class, sink, layout, profiler)[1]
    started = time.monotonic()

    def soak_sink(rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]]) -> None:
        from commbench.report.analysis.soak import SOAK_COLUMN  # the writer's (pandas): rank 0 only

        elapsed = round(time.monotonic() - started, 3)
        sink([{**row, SOAK_COLUMN: elapsed} for row in rows], rank_rows)

    ran: list[Any] = []
    rank_rows: list[dict[str, Any]] = []
    while True:
        jobs = [replace(job, repeat=len(ran) // max(len(plan.jobs), 1)) for job in plan.jobs]
        chosen_sink = soak_sink if sink else None
        _, rows = run_jobs(comm, jobs, plan.options, backend_class, chosen_sink, layout, profiler)
        rank_rows += [{**row, "job_index": int(row["job_index"]) + len(ran)} for row in rows]
        ran += jobs
        rounds = len(ran) // max(len(plan.jobs), 1)
        elapsed = time.monotonic() - started
        # Another round only if it fits in the soak time at the pace so far; at least 2 rounds to compare.
        more = rounds < 2 or elapsed + elapsed / rounds <= plan.soak_s
        if comm.rank == 0 and progress is not None:
            click.echo(
                f"commbench: soak round {rounds - 1} done, {elapsed:.0f} of {plan.soak_s:.0f} s", err=True
            )
            expected = max(rounds + int(more), int(plan.soak_s / (elapsed / rounds)))
            progress.total = plan.total_steps * expected
        if not comm.all_gather_object(more if comm.rank == 0 else None)[0]:
            return ran, rank_rows


def _link_test(
    comm: Any, plan: LaunchPlan, layout: Layout, writer: ReportWriter | None, elements: list[Any]
) -> None:
    """Collective: the pairwise link test when the plan has one; rank 0 writes pairs.csv and adds the
    verdict elements to ``elements``. Wrong bytes then end the run with VerificationError on every rank."""
    if plan.pairwise is None:
        return
    from commbench.cli.linktest import run_link_test
    from commbench.errors import VerificationError
    from commbench.report.judge.pairs import PAIRS_FILE
    from commbench.run.liveness import deferred_stop

    def write_pairs(rows: list[dict[str, Any]]) -> None:
        if writer is not None and rows:
            with deferred_stop():  # a stop signal waits until the file is whole
                writer.set_table(PAIRS_FILE, rows)

    limits = plan.acceptance.limits if comm.rank == 0 and plan.acceptance is not None else None
    outcome: LinkTestOutcome = run_link_test(
        comm, plan.pairwise, plan.options, layout, limits, plan.spec, write_pairs
    )
    write_pairs(outcome.rows)  # every pair, in pairs.csv's order (the rounds done so far were kept as it ran)
    elements.extend(outcome.elements)
    wrong = comm.all_gather_object(outcome.wrong if comm.rank == 0 else 0)[0]
    if wrong:
        raise VerificationError(f"pairwise link test: {wrong} wrong byte(s) received; see pairs.csv")


class _Health:
    """This rank's GPU health read before the jobs and its counter watch; on rank 0 the preflight
    elements and everyone's readings."""

    def __init__(
        self, watch: Any, healths: list[Any], before: list[Any], preflight: list[Any], names: Any,
        tolerance: int = 0,
    ) -> None:  # fmt: skip
        self.watch = watch
        self.healths = healths
        self.before = before
        self.preflight = preflight
        self.names = names
        self.tolerance = tolerance  # health.max_counter_increase

    @classmethod
    def start(cls, comm: Any, plan: LaunchPlan, layout: Layout) -> _Health:
        """Collective: read and gather every rank's GPU health and counters; rank 0 judges the preflight
        and prints its findings before anything is measured."""
        from commbench.hardware.health import read_health, watch_counters

        device = getattr(comm, "device", None)
        index = device.index if device is not None and device.type == "cuda" else None
        watch = watch_counters(index)
        gathered = comm.all_gather_object((read_health(index), watch.before))
        if comm.rank != 0:
            return cls(watch, [], [], [], None)
        from commbench.cli.acceptance import rank_names
        from commbench.report.judge.preflight import preflight_elements

        acceptance = plan.acceptance
        spec = acceptance.spec if acceptance is not None else None
        limits = acceptance.limits if acceptance is not None else None
        tolerance = int(limits.value("health.max_counter_increase") or 0) if limits is not None else 0
        names = rank_names(layout)
        healths = [item[0] for item in gathered]
        elements = preflight_elements(healths, spec, names)
        findings = [e for e in elements if e.status in ("FAIL", "WARN")]
        judged = sum(e.status != "SKIP" for e in elements)
        click.echo(
            f"commbench: preflight: {judged} GPU check(s) judged, {len(findings)} finding(s)"
            + ("" if judged else f" ({elements[0].message})" if elements else ""),
            err=True,
        )
        for element in findings:
            click.echo(f"commbench: preflight {element.status}: {element.message}", err=True)
        return cls(watch, healths, [item[1] for item in gathered], elements, names, tolerance)

    def finish(self, comm: Any, writer: ReportWriter | None, elements: list[Any]) -> None:
        """Collective: every rank's counters after the run; rank 0 adds the health elements and writes
        health.csv."""
        after = comm.all_gather_object(self.watch.finish())
        if comm.rank != 0 or writer is None:
            return
        from commbench.report.folder.reading import HEALTH_FILE
        from commbench.report.judge.counters import counter_elements, health_frame
        from commbench.run.liveness import deferred_stop

        found = counter_elements(self.before, after, self.names, max_increase=self.tolerance)
        elements.extend(found)
        for element in found:
            if element.status in ("FAIL", "WARN"):
                click.echo(f"commbench: health {element.status}: {element.message}", err=True)
        with deferred_stop():
            writer.set_table(HEALTH_FILE, health_frame(self.healths, self.before, after).to_dict("records"))


class _ProfileSink:
    """Rank 0's end of --profile: each phase's steps, arrivals and per-peer arrivals appended to
    profile.csv, arrivals.csv and peers.csv as it finishes; with --trace every span kept for trace.json."""

    def __init__(self, writer: ReportWriter, trace: bool) -> None:
        self.writer = writer
        self.trace = trace
        self.spans: list[dict[str, Any]] = []

    def __call__(self, profile: Any) -> None:
        from commbench.report.profiler.profile import ARRIVALS_FILE, PEERS_FILE, PROFILE_FILE
        from commbench.run.liveness import deferred_stop

        with deferred_stop():
            self.writer.append_table(PROFILE_FILE, profile.step_rows())
            self.writer.append_table(ARRIVALS_FILE, profile.arrival_rows())
            self.writer.append_table(PEERS_FILE, profile.peer_rows())
        if self.trace:
            self.spans += profile.trace_spans()

    def finish(self, names: dict[int, str]) -> None:
        """trace.json, when asked for."""
        if not self.trace:
            return
        from commbench.report.profiler.profile import TRACE_FILE, trace_text

        self.writer.write_file(TRACE_FILE, trace_text(self.spans, names))
        click.echo(
            f"commbench: trace of every rank in {self.writer.out_dir / TRACE_FILE} (ui.perfetto.dev)",
            err=True,
        )
