"""The timing loop: every job's phases warmed up, timed, verified and emitted as rows (nccl-tests' BenchTime).

Per phase (dispatch, combine, or the balanced "alltoall") every rank runs ``warmup`` untimed iterations of
``barrier -> phase call -> synchronize``, then times ``iters`` calls the job's way (``job.timing``):

* "window" (the balanced sweep's default, nccl-tests' way): poison receive buffers -> synchronize ->
  barrier -> [start timer] -> ``iters`` back-to-back calls -> [stop timer] -> synchronize (-> barrier when
  checked); each rank's seconds per iteration = window / iters, one sample per rank. The calls overwrite the
  same receive buffers (as in nccl-tests): only the final output is verified, in full ("window-last").
  ``--blocking 0`` (nccl-tests' -z 0, the default): the host issues the calls without waiting for each one
  (``Backend.blocking`` False for the window; the stop's synchronize waits for them); ``--blocking 1``: it
  synchronizes after each call.
* "iteration" (the MoE phases' default): per iteration poison receive buffers -> synchronize -> barrier ->
  [start timer] -> phase call -> [stop timer] -> synchronize -> barrier -> check this iteration's output;
  one sample per iteration.
* "graph" (``--cuda-graph N``): N calls in one CUDA graph, replayed in one window (``run.graphs``).

The timer's end is taken by ``Timer.stop(backend.synchronize)``: a CUDA timer records its end event on the
stream before the host waits, a host clock reads after the wait. An emulated backend's modelled time
replaces the timer's (a window: the sum of its calls' modelled times / iters). Verification in iteration
timing covers every timed iteration (``RunOptions.check``): the backend fills its receive buffers with a
sentinel before each one (``Backend.poison_receive_buffers``), so a call that moves nothing cannot pass on
the previous iteration's bytes; then ``checksum`` (default) compares a checksum of each iteration's output
with the expected one and verifies the last iteration in full, ``every`` verifies every iteration in full
(``Phase.check``; refused with window timing). Nothing of this runs inside the timed region, and no thread
of ours wakes there (``comm.quiet()``: ``RankMonitor.quiet``) and Python's garbage collector is paused (as
``timeit`` does); a call's only extra work in a window is two clock reads and one progress store for the
launcher's hang watchdog.
``wrong`` sums every rank's checked outputs; a backend that moves no data (mock, sim) is not checked and its
rows say #wrong None (n/a). A job with wrong > 0 still writes its rows, then every rank raises
VerificationError. A phase's rows (``run.rows``) take their bytes from the job's Pattern (the pattern
``commbench pattern`` prints) and their times from every rank's samples.

The balanced sweep times each size out-of-place (checked as above), then where the backend has one
(``Backend.in_place``) in place, nccl-tests' in-place alltoall (one buffer in and out), timed the same way and
never checked (undefined output): the row's ``in_place_time_us_mean`` (``run.rows.in_place_columns``). Its
warm-up is one untimed call (``IN_PLACE_WARMUP``, nccl-tests' untimed call before each window; none with
``--warmup 0``): the same exchange at the same size has just run ``warmup + iters`` times out of place.

Every timed call also records the rank's arrival: host time from the call's common start (the barrier,
or the previous call's return in a window) until it entered the call; ranks.csv carries its p50 per rank
(``arrival_us_p50``), which the verdict's slow-rank rule judges. ``--inject-delay`` (a test hook) sleeps
before each timed call of one rank, inside the timer.

Knob sweeps: consecutive jobs of one effective knob setting share a backend, the previous one closed first.

Imbalance cost (``RunOptions.imbalance_cost``): after an MoE job's two phases the same launch runs both phases
again through the same runner (``phases.MoeLayer``, same backend calls, same checks) on a balanced layout of
the same rows (``phases.reference_traffic``); each phase's row gets the reference's bytes and time (the
uniform_ref_* columns: the same rows spread uniformly, not the balanced sweep), from which the report
derives what the skew alone costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from commbench.errors import UsageError, VerificationError
from commbench.inputs.layout import Layout
from commbench.plain import knobs_text
from commbench.run import graphs
from commbench.run.case import CASE_FIELDS
from commbench.run.clocks import estimate_offsets
from commbench.run.config import CHECK_MODES, GRAPH_TIMING, RunOptions
from commbench.run.interface import Backend
from commbench.run.jobs import (
    CHECK_WINDOW_LAST,
    BalancedJob,
    MatrixJob,
    MoeJob,
    check_timing,
    job_backend_options,
)
from commbench.run.matrix import matrix_pattern, matrix_phase
from commbench.run.nodes import (
    NodeGroups,
    NodeLayer,
    StagePair,
    make_node_groups,
    node_backend_refusal,
    phase_matrix,
)
from commbench.run.phases import (
    MoeLayer,
    Phase,
    alltoall_phases,
    clear_traffic_cache,
    moe_traffic,
    node_traffic,
    reference_traffic,
)
from commbench.run.placement import gather_layout
from commbench.run.profile import PhaseProfile, RankProfile, gathered_profile
from commbench.run.rows import NO_REFERENCE, RowMaker, in_place_columns, reference_columns
from commbench.run.steps import NO_STEPS, StepRecorder
from commbench.run.timed_calls import TimedCalls, collector_paused
from commbench.traffic.nodes import Nodes
from commbench.traffic.pattern import Pattern, balanced_pattern
from commbench.traffic.plan import RankPlan

Sink = Callable[[list[dict], list[dict]], None]
Emit = Callable[..., None]  # (row, rank rows, the Measured it came from)
Profiler = Callable[[PhaseProfile], None]
# Untimed calls before the in-place window: nccl-tests' BenchTime makes one ("Sync") before each window.
IN_PLACE_WARMUP = 1
UNCHECKED = "n/a"  # the check of what is not verified: a backend that moves no data, the in-place all-to-all
PROFILE_CASE_KEYS = CASE_FIELDS  # the results-row keys naming a profiled phase (profile.csv, trace.json, ...)


@dataclass(frozen=True)
class Measured:
    """One phase as every rank timed and checked it (gathered, the same on every rank)."""

    seconds: np.ndarray  # float64 [ranks, samples]: one per timed iteration, or one per window
    wrong: int | None  # summed over ranks and checked outputs; None = not checked
    wrong_iters: int = 0  # checked outputs (iterations, the window's last) with something wrong on any rank
    # float64 [ranks, calls]: host seconds from each timed call's start (its barrier, or the previous call's
    # return inside a window) until the rank entered the call: what differs between ranks when one is late.
    arrival: np.ndarray | None = None
    wait: np.ndarray | None = None  # float64 [ranks, calls]: host seconds inside each call (TimedCalls)
    profile: list[RankProfile] | None = None  # --profile: every rank's timed calls and steps


def check_label(backend: Backend, opts: RunOptions, timing: str = "iteration") -> str:
    """The rows' ``check`` column: the check mode, "window-last" where window timing verifies the window's
    final output, or "n/a" for a backend that moves no data."""
    if not backend.moves_data:
        return UNCHECKED
    if timing != "iteration" and opts.check in CHECK_MODES:  # window and graph: one checked output
        return CHECK_WINDOW_LAST
    return opts.check


def run_jobs(
    comm: Any,
    jobs: Sequence[MoeJob | BalancedJob],
    opts: RunOptions,
    backend_class: type[Backend],
    sink: Sink | None = None,
    layout: Layout | None = None,
    profiler: Profiler | None = None,
) -> tuple[list[dict], list[dict]]:
    """Run every job on ``backend_class``; returns (result rows, rank rows) on rank 0, empty lists elsewhere.

    ``sink(new_rows, new_rank_rows)`` is called on rank 0 with the rows of each (job, size, phase) as soon as
    they are final; rank rows carry ``job_index``, the position of their job in ``jobs``. Raises
    VerificationError on every rank after the first job with wrong > 0. ``layout`` (from ``gather_layout``,
    a collective) is gathered here when not given. With ``opts.profile``, ``profiler(PhaseProfile)`` is called
    on rank 0 with every phase's profile (every rank's calls and steps on rank 0's clock: the clock offsets
    are estimated once here, a collective).
    """
    opts.check_world(comm.world_size)
    refusal = node_backend_refusal(backend_class, [job.send_mode for job in jobs if isinstance(job, MoeJob)])
    if refusal:
        raise UsageError(refusal)
    for job in jobs:
        job.check(comm.world_size)
        if backend_class.moves_data:  # nothing is verified otherwise, so any check mode fits any timing
            check_timing(job, opts)
    if layout is None:
        layout = gather_layout(comm, opts)
    rows: list[dict] = []
    rank_rows: list[dict] = []
    current = {"job_index": 0}
    offsets = estimate_offsets(comm) if opts.profile else None

    def emit(row: dict, new_rank_rows: list[dict], measured: Measured | None = None) -> None:
        profiled = measured.profile if measured is not None else None
        if comm.rank == 0 and profiler is not None and offsets is not None and profiled is not None:
            case = {key: row.get(key) for key in PROFILE_CASE_KEYS}
            sent = [int(r.get("sent_bytes") or 0) for r in new_rank_rows]
            profiler(PhaseProfile(case, profiled, offsets, sent))
        if comm.rank == 0:
            # Which job of ``jobs`` a rank row came from: a flagged case is rerun from it (cli.acceptance).
            new_rank_rows = [{**rank_row, **current} for rank_row in new_rank_rows]
            rows.append(row)
            rank_rows.extend(new_rank_rows)
            if sink is not None:
                sink([row], new_rank_rows)

    backends = _BackendPerSetting(comm, backend_class)
    groups: list[NodeGroups] = []  # --send-mode node's sub-groups, made (a collective) at its first job
    try:
        for index, job in enumerate(jobs):
            current["job_index"] = index
            options = job_backend_options(job, opts)
            backend = backends.get(options)
            run = {MoeJob: _run_moe, MatrixJob: _run_matrix}.get(type(job), _run_balanced)
            maker = RowMaker(job, backend, layout, check_label(backend, opts, job.timing))
            if isinstance(job, MoeJob) and job.send_mode == "node":
                groups = groups or [make_node_groups(comm, Nodes.of(layout.domain_of_rank))]
                failures = _run_node(comm, backend, job, opts, maker, emit, groups[0], options)
            else:
                failures = run(comm, backend, job, opts, maker, emit)
            if failures:
                setting = f" ({knobs_text(job.backend_options)})" if job.backend_options else ""
                raise VerificationError(
                    f"job {job.name!r}{setting}: data verification failed: {'; '.join(failures)}"
                )
    finally:
        backends.close()
        clear_traffic_cache()
    return rows, rank_rows


class _BackendPerSetting:
    """One live backend, built for a knob setting (effective options) when the setting changes; the previous
    one is closed first, so one setting's buffers go before the next one's are made."""

    def __init__(self, comm: Any, backend_class: type[Backend]) -> None:
        self.comm = comm
        self.backend_class = backend_class
        self.backend: Backend | None = None
        self.key: tuple[tuple[str, str], ...] | None = None

    def get(self, options: dict[str, Any]) -> Backend:
        key = tuple(sorted((str(k), repr(v)) for k, v in options.items()))
        if self.backend is None or key != self.key:
            self.close()
            self.backend = self.backend_class(self.comm, options)
            self.key = key
        return self.backend

    def close(self) -> None:
        closing, self.backend = self.backend, None
        if closing is not None:
            closing.close()


def bench(
    comm: Any,
    backend: Backend | StagePair,
    job: MoeJob | BalancedJob,
    phase: Phase,
    opts: RunOptions,
    warmup: int | None = None,
) -> Measured:
    """Warm up (``warmup`` calls, default ``job.warmup``), time ``job.iters`` calls the job's way and check
    them (see the module docstring); every rank's times, arrivals and #wrong, gathered. ``opts.corrupt``
    (the test hook) changes the last output on rank 0 before its full check; ``opts.inject_delay`` (the
    other test hook) delays a rank's timed calls. A phase without a check (in-place all-to-all: undefined
    output) is timed alone: no poison, #wrong None."""
    mode = check_label(backend, opts, job.timing) if phase.check is not None else UNCHECKED
    checking = mode in (*CHECK_MODES, CHECK_WINDOW_LAST)
    wrong: list[int] = []  # this rank's count per checked output
    calls = TimedCalls(phase, opts.delay_s(comm.rank))
    recorder = StepRecorder(comm.device) if opts.profile else None
    backend.steps = recorder if recorder is not None else NO_STEPS
    calls.recorder = recorder
    comm.heartbeat()
    with comm.guard(f"job {job.name!r} {phase.label}"):
        for _ in range(job.warmup if warmup is None else warmup):  # warm-up
            comm.barrier()
            phase.call()
            backend.synchronize()
        with comm.quiet(), collector_paused():  # the timed loop: our threads asleep, no GC pass
            if job.timing == GRAPH_TIMING:  # captured calls, replayed (run.graphs)
                seconds, output = graphs.timed_graph(comm, backend, phase.call, job, checking)
            elif job.timing == "window":
                seconds, output = _timed_window(comm, backend, calls, job.iters, checking, opts.blocking)
            else:
                seconds, output = _timed_iterations(comm, backend, calls, job.iters, mode, wrong)
    if checking:
        if opts.corrupt == phase.corrupted_by and comm.rank == 0:
            phase.corrupt(output)
        wrong.append(phase.check.full(output))  # the last timed iteration, byte for byte
    comm.heartbeat()
    backend.steps = NO_STEPS
    mine = None
    if recorder is not None:
        mine = RankProfile(calls.entered_at, calls.left_at, list(seconds), recorder.take())
    gathered = comm.all_gather_object((seconds, wrong, calls.arrivals, calls.waits, mine))
    times = np.array([g[0] for g in gathered], dtype=np.float64)
    arrival = np.array([g[2] for g in gathered], dtype=np.float64)
    wait = np.array([g[3] for g in gathered], dtype=np.float64)
    profile = gathered_profile([g[4] for g in gathered]) if recorder is not None else None
    if not checking:
        return Measured(times, None, arrival=arrival, wait=wait, profile=profile)
    per_output = np.array([g[1] for g in gathered], dtype=np.int64).sum(axis=0)
    wrong_total, wrong_iters = int(per_output.sum()), int(np.count_nonzero(per_output))
    return Measured(times, wrong_total, wrong_iters, arrival, wait, profile)


def _timed_iterations(
    comm: Any, backend: Backend | StagePair, calls: TimedCalls, iters: int, mode: str, wrong: list[int]
) -> tuple[list[float], Any]:
    """``iters`` timed calls, each after its own poison and barrier: (seconds of each, the last output).
    Appends this rank's #wrong of every iteration but the last (the caller verifies that one in full) to
    ``wrong``. Modelled times replace the timer's."""
    checking = mode in CHECK_MODES
    phase = calls.phase
    timers = [comm.timer() for _ in range(iters)]
    modelled: list[float | None] = []
    output = None
    for index, timer in enumerate(timers):
        if checking:  # before the barrier: no peer writes into a buffer while it is being poisoned
            backend.poison_receive_buffers()
            backend.synchronize()
        comm.barrier()
        timer.start()
        calls.mark()
        output = calls()
        timer.stop(backend.synchronize)
        calls.left()
        modelled.append(backend.modelled_seconds())
        if checking:
            # Checks start once every rank has stopped its timer: on a shared CPU host a fast rank's
            # check would otherwise take cycles from a peer still inside its timed call.
            comm.barrier()
            if index < iters - 1:
                check = phase.check.full if mode == "every" else phase.check.checksum
                wrong.append(check(output))
                comm.heartbeat()
    seconds = [m if m is not None else timer.seconds() for m, timer in zip(modelled, timers, strict=True)]
    return seconds, output


def _timed_window(
    comm: Any, backend: Backend | StagePair, calls: TimedCalls, iters: int, checking: bool, blocking: int
) -> tuple[list[float], Any]:
    """One timer around ``iters`` back-to-back calls (nccl-tests' timed loop): ([window / iters], the last
    output). ``blocking`` 1: the host waits for each call (nccl-tests -z 1); 0: the calls are issued without
    waiting and the timer's stop waits for them all. An emulated backend's modelled times are summed over
    the window's calls."""
    if checking:  # the calls overwrite one output: poisoned first, the last call must deliver all of it
        backend.poison_receive_buffers()
        backend.synchronize()
    comm.barrier()
    timer = comm.timer()
    modelled: list[float | None] = []
    output = None
    backend.blocking = bool(blocking)
    try:
        timer.start()
        for _ in range(iters):
            calls.mark()
            output = calls()
            if blocking:
                backend.synchronize()
            calls.left()
            if backend.emulated:  # a class attribute: real backends read no modelled time inside the window
                modelled.append(backend.modelled_seconds())
            comm.heartbeat()  # a long window outlasts the hang bound (2 x timeout + 5 s): one ~0.1 us store
        timer.stop(backend.synchronize)
    finally:
        backend.blocking = True  # warm-ups and iteration timing wait for every call
    if checking:  # as in iteration timing: no rank's check takes a core from a peer still in its window
        comm.barrier()
    known = [m for m in modelled if m is not None]
    if modelled and len(known) == len(modelled):
        return [sum(known) / iters], output
    return [timer.seconds() / iters], output


def _failures(phase: Phase, measured: Measured, job: MoeJob | BalancedJob) -> list[str]:
    if not measured.wrong:
        return []
    where = graphs.wrong_where(job, measured.wrong_iters)
    return [f"{phase.label} #wrong={measured.wrong} {phase.unit} {where}"]


def _run_balanced(
    comm: Any, backend: Backend, job: BalancedJob, opts: RunOptions, maker: RowMaker, emit: Emit
) -> list[str]:
    failures = []
    for size in job.sizes:
        pattern = balanced_pattern(comm.world_size, int(size))  # init data
        phase, in_place = alltoall_phases(comm, backend, int(size))
        measured = bench(comm, backend, job, phase, opts)  # warm-up, timed loop, verify
        # Then in place, as nccl-tests times each size out-of-place and then in-place (timed, not checked),
        # after one untimed call as nccl-tests' BenchTime makes: the same exchange has just been warmed up.
        warmup = min(job.warmup, IN_PLACE_WARMUP)  # --warmup 0 stays 0
        in_place_seconds = bench(comm, backend, job, in_place, opts, warmup).seconds if in_place else None
        row_bytes = pattern.stats["bytes_per_peer"]
        row, rank_rows = maker.rows(
            "alltoall", pattern.dispatch_bytes, row_bytes, measured.seconds, measured.wrong,
            arrival=measured.arrival, wait=measured.wait,
        )  # fmt: skip
        emit({**row, **in_place_columns(in_place_seconds)}, rank_rows, measured)
        failures += _failures(phase, measured, job)
    return failures


def _run_matrix(
    comm: Any, backend: Backend, job: MatrixJob, opts: RunOptions, maker: RowMaker, emit: Emit
) -> list[str]:
    """Each given [src][dst] matrix (run.matrix) as one all-to-all-v, run like a balanced size: a row each."""
    failures = []
    for call in job.calls:
        pattern = matrix_pattern(job.name, call)
        phase = matrix_phase(comm, backend, call)
        measured = bench(comm, backend, job, phase, opts)
        emit(
            *maker.rows(
                call.name, pattern.dispatch_bytes, call.row_bytes, measured.seconds, measured.wrong,
                arrival=measured.arrival, wait=measured.wait,
            ),
            measured,
        )  # fmt: skip
        failures += _failures(phase, measured, job)
    return failures


def _moe_phases(
    comm: Any, backend: Backend, job: MoeJob, plans: list[RankPlan], opts: RunOptions, label: str = ""
) -> Iterator[tuple[Phase, Measured]]:
    """Dispatch, then combine (its input is what dispatch delivered), each benched as it comes."""
    layer = MoeLayer(comm, backend, plans, job.routing.model.hidden, job.send_mode, label)
    dispatch = layer.dispatch()
    yield dispatch, bench(comm, backend, job, dispatch, opts)
    combine = layer.combine()
    yield combine, bench(comm, backend, job, combine, opts)


def _run_moe(
    comm: Any, backend: Backend, job: MoeJob, opts: RunOptions, maker: RowMaker, emit: Emit
) -> list[str]:
    pattern, plans = moe_traffic(comm, job)  # init data: what every rank sends, and the Pattern of it
    matrices = {"dispatch": pattern.dispatch_bytes, "combine": pattern.combine_bytes}
    row_bytes = {"dispatch": plans[0].dispatch_row_bytes, "combine": plans[0].combine_row_bytes}
    failures: list[str] = []
    held = []  # with the imbalance cost, rows wait for the reference's columns
    for phase, measured in _moe_phases(comm, backend, job, plans, opts):
        made = maker.rows(
            phase.name,
            matrices[phase.name],
            row_bytes[phase.name],
            measured.seconds,
            measured.wrong,
            pattern.expert_load,
            arrival=measured.arrival,
            wait=measured.wait,
        )
        # The comm/compute budget's input (report.budget): (token, expert) selections the busiest rank's
        # experts receive, which set its expert FLOPs.
        made[0]["busiest_rank_selections"] = int(pattern.stats["rank_recv_selections_max"])
        if opts.imbalance_cost:
            held.append((*made, measured))
        else:
            emit(*made, measured)
        failures += _failures(phase, measured, job)
    if opts.imbalance_cost:
        references, reference_failures = _imbalance_reference(comm, backend, job, opts, pattern, plans)
        for row, rank_rows, measured in held:
            emit({**row, **references[row["phase"]]}, rank_rows, measured)
        failures += reference_failures
    return failures


def _run_node(
    comm: Any,
    backend: Backend,
    job: MoeJob,
    opts: RunOptions,
    maker: RowMaker,
    emit: Emit,
    groups: NodeGroups,
    options: dict[str, Any],
) -> list[str]:
    """--send-mode node: the six phases of ``run.nodes.NodeLayer`` (each phase, then its stages), each
    benched and verified like any phase, a row each with its own [src][dst] bytes."""
    pattern, plans = node_traffic(comm, job, groups.nodes)
    layer = NodeLayer(comm, groups, backend, options, plans, job.routing.model.hidden)
    failures: list[str] = []
    try:
        for phase in layer.phases():
            measured = bench(comm, layer.pair, job, phase, opts)
            token = plans[0].token
            dispatching = phase.name.startswith("dispatch")
            row_bytes = token.dispatch_row_bytes if dispatching else token.combine_row_bytes
            made = maker.rows(
                phase.name, phase_matrix(pattern, phase.name), row_bytes, measured.seconds, measured.wrong,
                pattern.expert_load, arrival=measured.arrival, wait=measured.wait,
            )  # fmt: skip
            # The comm/compute budget's input, on every MoE row as _run_moe's.
            made[0]["busiest_rank_selections"] = int(pattern.stats["rank_recv_selections_max"])
            emit(*made, measured)
            failures += _failures(phase, measured, job)
    finally:
        layer.close()
    return failures


def _imbalance_reference(
    comm: Any, backend: Backend, job: MoeJob, opts: RunOptions, pattern: Pattern, plans: list[RankPlan]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Both phases again on the balanced layout of the job's rows, checked like the job's own (the corrupt
    hook aside): ({phase: uniform_ref_* columns}, failures)."""
    total_rows = int(pattern.dispatch_rows.sum())
    if total_rows == 0:  # nothing to balance (fully masked patterns)
        return {"dispatch": dict(NO_REFERENCE), "combine": dict(NO_REFERENCE)}, []
    matrices, balanced = reference_traffic(job, plans[comm.rank], total_rows)
    columns, failures = {}, []
    reference_opts = replace(opts, corrupt=None)
    for phase, measured in _moe_phases(
        comm, backend, job, balanced, reference_opts, " imbalance-cost uniform reference"
    ):
        columns[phase.name] = reference_columns(matrices[phase.name], measured.seconds)
        failures += _failures(phase, measured, job)
    return columns, failures
