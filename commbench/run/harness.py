"""The shared harness: timing loops, verification and result rows (one backend-independent driver).

Per phase (dispatch, combine, or the balanced "alltoall") every rank runs ``warmup + iters`` iterations of
``barrier -> start timer -> [exchange counts] -> backend call -> synchronize -> stop timer``. Per-iteration
times are gathered; an iteration's time is the MAX over ranks (the bottleneck rank), and rows report the
min/p50/p99/mean of those, in microseconds. After timing, every rank checks what it received against rows it
regenerates from every source's plan (``traffic.payload``); ``wrong`` is the sum over ranks. A job with
wrong > 0 still writes its rows, then every rank raises VerificationError.

Byte columns come from the rows the ranks actually sent (each rank's send counts, gathered) times the phase's
row size, as a [src][dst] matrix: self traffic is in ``total_bytes`` and ``size_bytes``, not in link columns.
Link classes (``traffic.links``): every byte is ``self`` (stays on the GPU), ``nvlink`` (same NVLink domain)
or ``scaleout`` (another domain), by the run's layout (``gather_topology``: each rank's ``local_place``
gathered, or the ``ranks_per_domain`` / ``ranks_per_host`` overrides). Rows store bytes only; the report
derives the per-class bandwidths against a spec.

Knob sweeps: a job may carry its own backend options (``Job.backend_options``, over
``RunOptions.backend_options``); consecutive jobs with the same effective options share one backend, and the
previous one is closed before the next setting's backend is built. Every result and rank row carries the
backend's ``knobs()`` as columns and as one ``knobs`` text cell ("chunk_rows=4 signal=chunk ...").

Imbalance cost (``RunOptions.imbalance_cost``): after an MoE job's two phases, the same launch runs
both phases again through the same code path (counts exchange + ``backend.dispatch``, then
``backend.combine`` with its weighted reduction, both verified the same way) on a balanced layout
(``plan.plan_balanced_moe``): the same total rows, row sizes, tokens per rank and send mode, every (src,
dst) pair (self included) ``total / world^2`` rows (the remainder one row per pair, so totals match
exactly), so every rank sends and receives the same rows. Each phase's row gets ``balanced_time_us_p50``,
``skew_cost`` (= time / balanced time) and ``skew_bw_loss_pct``: what the skew alone costs, not the packing
or reduction work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from commbench.backends import get_backend
from commbench.backends.base import Backend
from commbench.errors import UsageError, VerificationError
from commbench.hardware.probes import RankPlace, local_place
from commbench.inputs.layout import Layout, build_layout
from commbench.traffic.links import link_class_byte_columns, per_rank_link_bytes
from commbench.traffic.payload import (
    HEADER_BYTES,
    count_wrong_combine,
    count_wrong_rows,
    decode_header,
    encode_rows,
    expected_combine,
    expected_rows,
    expert_outputs,
    received_keys,
)
from commbench.traffic.plan import RankPlan, balanced_row_bytes, plan_balanced, plan_balanced_moe, plan_rank
from commbench.traffic.routing import Routing, RoutingConfig, experts_per_rank, route_rank

JOB_KINDS = ("moe", "balanced")
CORRUPT_PHASES = ("dispatch", "combine")

Sink = Callable[[list[dict], list[dict]], None]


@dataclass
class Job:
    name: str
    kind: str  # "moe" | "balanced"
    routing: RoutingConfig | None = None
    send_mode: str = "token"
    sizes: list[int] = field(default_factory=list)  # balanced: bytes each rank sends in total
    warmup: int = 5
    iters: int = 20
    # This job's backend options (a knob setting of a sweep), laid over RunOptions.backend_options; jobs
    # with the same effective options share one backend instance, built when the setting changes.
    backend_options: dict[str, Any] | None = None


@dataclass
class RunOptions:
    backend: str
    backend_options: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    # Test hook: "dispatch" flips one received byte (dispatch and balanced all-to-all), "combine" changes one
    # combined element, on rank 0 after timing and before verification.
    corrupt: str | None = None
    # Layout overrides (CPU runs, what-ifs): contiguous ranks per NVLink domain / per host; None = discover.
    ranks_per_domain: int | None = None
    ranks_per_host: int | None = None
    # Time a balanced all-to-all of the same total bytes after each MoE job (skew_cost columns).
    imbalance_cost: bool = False


LAYOUT_METHODS = ("override", "nvml-clique", "host")


@dataclass(frozen=True)
class Topology:
    """The run's layout and how it was found: ``method`` is "override" (--ranks-per-domain/--ranks-per-host),
    "nvml-clique" (NVML GPU fabric cluster + clique ids) or "host" (no fabric clique: a domain per host)."""

    layout: Layout
    method: str
    places: tuple[RankPlace, ...] = ()

    @property
    def domain_of_rank(self) -> np.ndarray:
        return self.layout.domain_of_rank

    @property
    def host_of_rank(self) -> np.ndarray:
        return self.layout.host_of_rank

    def describe(self) -> str:
        base = self.layout.describe().rsplit(" (", 1)[0]  # drop topology's own "(source)" tag
        how = {
            "override": "override (--ranks-per-domain / --ranks-per-host)",
            "nvml-clique": "NVML GPU fabric clique",
            "host": "host (no NVLink fabric clique reported: one domain per host)",
        }[self.method]
        return f"{base}; found by {how}"

    def to_meta(self) -> dict[str, Any]:
        """What the report's meta.json records."""
        sizes = np.bincount(self.layout.domain_of_rank)
        return {
            "method": self.method,
            "description": self.describe(),
            "num_domains": self.layout.num_domains,
            "ranks_per_domain": sorted({int(v) for v in sizes}),
            "num_hosts": int(self.layout.host_of_rank.max()) + 1,
            "domain_of_rank": self.layout.domain_of_rank.tolist(),
            "host_of_rank": self.layout.host_of_rank.tolist(),
            "places": [p.to_dict() for p in self.places],
        }


def gather_topology(comm: Any, opts: RunOptions) -> Topology:
    """Collective: every rank all-gathers its ``local_place`` and builds the same layout (overrides win)."""
    device = getattr(comm, "device", None)
    index = device.index if device is not None and device.type == "cuda" else None
    places = tuple(comm.all_gather_object(local_place(index)))
    layout = build_layout(
        comm.world_size, opts.ranks_per_domain, opts.ranks_per_host, discovered=list(places)
    )
    if layout.source == "override":
        method = "override"
    elif any(p.fabric_cluster_uuid for p in places):
        method = "nvml-clique"
    else:
        method = "host"
    return Topology(layout, method, places)


@dataclass
class _PhaseResult:
    """One rank's outcome of one phase; gathered to every rank."""

    seconds: list[float]
    wrong: int
    send_rows: list[int]  # rows this rank sent to each destination in dispatch (its plan's splits)
    expert_load: list[int] | None = None  # selections per expert of this rank's tokens (MoE only)


def _check(comm: Any, jobs: list[Job], opts: RunOptions) -> None:
    if opts.corrupt is not None and opts.corrupt not in CORRUPT_PHASES:
        raise UsageError(f"unknown corrupt phase {opts.corrupt!r}; choose dispatch or combine")
    get_backend(opts.backend)  # unknown name: UsageError before any collective
    build_layout(comm.world_size, opts.ranks_per_domain, opts.ranks_per_host)  # bad overrides
    for job in jobs:
        if job.kind not in JOB_KINDS:
            raise UsageError(f"job {job.name!r}: unknown kind {job.kind!r}; choose moe or balanced")
        if job.iters < 1 or job.warmup < 0:
            raise UsageError(
                f"job {job.name!r}: need iters >= 1 and warmup >= 0, got {job.iters} and {job.warmup}"
            )
        if job.kind == "balanced":
            if not job.sizes:
                raise UsageError(f"job {job.name!r}: a balanced all-to-all needs at least one size")
            for size in job.sizes:
                balanced_row_bytes(comm.world_size, int(size))
            continue
        if job.routing is None:
            raise UsageError(f"job {job.name!r}: an MoE job needs a routing config")
        if job.routing.world_size != comm.world_size:
            raise UsageError(
                f"job {job.name!r} is routed for {job.routing.world_size} ranks but {comm.world_size} are "
                f"running; set the routing world size to {comm.world_size}"
            )
        model = job.routing.model
        if model.dispatch_bytes_per_token < HEADER_BYTES:
            raise UsageError(
                f"job {job.name!r}: hidden size {model.hidden} is too small for the {HEADER_BYTES}-byte row "
                f"header; use hidden >= {HEADER_BYTES}"
            )
        if job.send_mode not in ("token", "selection"):
            raise UsageError(
                f"job {job.name!r}: unknown send mode {job.send_mode!r}; choose token or selection"
            )


def run_jobs(
    comm: Any,
    jobs: list[Job],
    opts: RunOptions,
    sink: Sink | None = None,
    topology: Topology | None = None,
) -> tuple[list[dict], list[dict]]:
    """Run every job; returns (result rows, rank rows) on rank 0, empty lists elsewhere.

    ``sink(new_rows, new_rank_rows)`` is called on rank 0 with the rows of each (job, size, phase) as soon as
    it finishes. Raises VerificationError on every rank after the first job with wrong > 0. ``topology``
    (from ``gather_topology``, a collective) is gathered here when not given.
    """
    _check(comm, jobs, opts)
    if topology is None:
        topology = gather_topology(comm, opts)
    backend_class = get_backend(opts.backend)
    backend: Backend | None = None
    backend_key: tuple[tuple[str, str], ...] | None = None
    rows: list[dict] = []
    rank_rows: list[dict] = []

    def emit(new_rows: list[dict], new_rank_rows: list[dict]) -> None:
        if comm.rank != 0:
            return
        rows.extend(new_rows)
        rank_rows.extend(new_rank_rows)
        if sink is not None:
            sink(new_rows, new_rank_rows)

    try:
        for job in jobs:
            options = job_backend_options(job, opts)
            key = _options_key(options)
            if backend is None or key != backend_key:
                # One live backend at a time: a knob setting's buffers go before the next one's are made.
                if backend is not None:
                    closing, backend = backend, None
                    closing.close()
                backend = backend_class(comm, options)
                backend_key = key
            run = _run_moe if job.kind == "moe" else _run_balanced
            failures = run(comm, backend, job, opts, topology, emit)
            if failures:
                setting = f" ({knobs_text(job.backend_options)})" if job.backend_options else ""
                raise VerificationError(
                    f"job {job.name!r}{setting}: data verification failed: {'; '.join(failures)}"
                )
    finally:
        if backend is not None:
            backend.close()
        _cached_plan.cache_clear()
        _cached_routing.cache_clear()
    return rows, rank_rows


def job_backend_options(job: Job, opts: RunOptions) -> dict[str, Any]:
    """The options the job's backend is built with: the run's, overlaid with the job's own setting."""
    return {**opts.backend_options, **(job.backend_options or {})}


def _options_key(options: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), repr(v)) for k, v in options.items()))


def knobs_text(knobs: dict[str, Any]) -> str:
    """A knob setting as one text cell (the ``knobs`` column), e.g. "num_blocks=32 chunk_bytes=262144"."""
    return " ".join(f"{key}={value}" for key, value in knobs.items())


def row_knobs(backend: Backend, job: Job) -> dict[str, Any]:
    """The backend's knobs (``knobs()``, effective values), then any option of the job's own setting that
    the backend does not report (as itself or as "<backend>_<option>", as sim and mock do), so the rows of a
    sweep's settings always differ in the ``knobs`` column."""
    knobs = dict(backend.knobs())
    for key, value in (job.backend_options or {}).items():
        if f"{backend.name}_{key}" not in knobs:
            knobs.setdefault(key, value)
    return knobs


def _timed_phase(
    comm: Any, backend: Backend, job: Job, body: Callable[[], torch.Tensor]
) -> tuple[list[float], Any]:
    """Run ``body`` warmup + iters times between barriers; returns (seconds per timed iteration, output)."""
    timers = [comm.timer() for _ in range(job.iters)]
    modelled: list[float | None] = []
    output = None
    for iteration in range(job.warmup + job.iters):
        timer = timers[iteration - job.warmup] if iteration >= job.warmup else None
        comm.barrier()
        if timer is not None:
            timer.start()
        output = body()
        backend.synchronize()
        if timer is not None:
            timer.stop()
            modelled.append(backend.modelled_seconds())
    seconds = [m if m is not None else timer.seconds() for m, timer in zip(modelled, timers, strict=True)]
    return seconds, output


def _byte_columns(matrix: np.ndarray) -> dict[str, int]:
    """Byte columns of a [src][dst] byte matrix (nccl-tests alltoallv convention for size_bytes)."""
    sent = matrix.sum(axis=1)
    received = matrix.sum(axis=0)
    diagonal = np.diag(matrix)
    total = int(matrix.sum())
    self_bytes = int(diagonal.sum())
    return {
        "size_bytes": int(max(sent.max(), received.max())),
        "total_bytes": total,
        "self_bytes": self_bytes,
        "link_bytes": total - self_bytes,
        "max_send_bytes": int(sent.max()),
        "max_recv_bytes": int(received.max()),
        "max_send_link_bytes": int((sent - diagonal).max()),
        "max_recv_link_bytes": int((received - diagonal).max()),
    }


def _time_columns(seconds: np.ndarray) -> dict[str, float]:
    """seconds [ranks, iters] -> stats of the per-iteration max over ranks, in microseconds."""
    bottleneck_us = seconds.max(axis=0) * 1e6
    return {
        "time_us_min": float(bottleneck_us.min()),
        "time_us_p50": float(np.percentile(bottleneck_us, 50)),
        "time_us_p99": float(np.percentile(bottleneck_us, 99)),
        "time_us_mean": float(bottleneck_us.mean()),
    }


def imbalance_columns(expert_load: np.ndarray) -> dict[str, float]:
    """expert_max_mean = max / mean, maxvio = (max - mean) / mean, expert_cv = std / mean of expert loads."""
    load = expert_load.astype(np.float64)
    mean = float(load.mean()) if load.size else 0.0
    if mean <= 0:
        return {"expert_max_mean": float("nan"), "maxvio": float("nan"), "expert_cv": float("nan")}
    return {
        "expert_max_mean": float(load.max() / mean),
        "maxvio": float((load.max() - mean) / mean),
        "expert_cv": float(load.std() / mean),
    }


def _phase_matrix(results: list[_PhaseResult], phase: str, row_bytes: int) -> np.ndarray:
    """The phase's [src][dst] bytes from every rank's dispatch send rows."""
    dispatch_rows = np.array([r.send_rows for r in results], dtype=np.int64)  # [src][dst]
    # Combine answers each dispatch row: the expert side (dst) sends back to the token owner (src).
    rows_matrix = dispatch_rows.T if phase == "combine" else dispatch_rows
    return rows_matrix * row_bytes


def _layout_columns(topology: Topology) -> dict[str, Any]:
    sizes = np.bincount(topology.domain_of_rank)
    return {
        "num_domains": topology.layout.num_domains,
        "ranks_per_domain": int(sizes.max()),
        "layout_source": topology.method,
    }


def _phase_rows(
    comm: Any,
    backend: Backend,
    job: Job,
    phase: str,
    results: list[_PhaseResult],
    row_bytes: int,
    case: dict[str, Any],
    imbalance: dict[str, float | None],
    topology: Topology,
) -> tuple[dict, list[dict]]:
    """The result row and the rank rows of one phase, from every rank's gathered outcome."""
    matrix = _phase_matrix(results, phase, row_bytes)
    domains = topology.domain_of_rank
    seconds = np.array([r.seconds for r in results], dtype=np.float64)
    times = _time_columns(seconds)
    row = {
        "pattern": job.name,
        "phase": phase,
        "backend": backend.label,
        "backend_name": backend.name,
        "emulated": bool(backend.emulated),
        "world_size": comm.world_size,
        **case,
        "warmup": job.warmup,
        "iters": job.iters,
        "row_bytes": row_bytes,
        **_byte_columns(matrix),
        **_layout_columns(topology),
        **link_class_byte_columns(matrix, domains),
        **times,
        "wrong": int(sum(r.wrong for r in results)),
        **imbalance,
        **backend.knobs(),
        "knobs": knobs_text(row_knobs(backend, job)),
    }
    rank_case = {k: case[k] for k in ("skew", "send_mode", "tokens_per_rank")}
    per_rank = per_rank_link_bytes(matrix, domains)
    sent = per_rank["total_send_bytes"]
    received = per_rank["total_recv_bytes"]
    classes = {
        "link": (sent - per_rank["self_bytes"], received - per_rank["self_bytes"]),
        "nvlink": (per_rank["nvlink_send_bytes"], per_rank["nvlink_recv_bytes"]),
        "scaleout": (per_rank["scaleout_send_bytes"], per_rank["scaleout_recv_bytes"]),
    }
    # Per-rank bandwidth: the rank's bytes over the phase time (p50 of the per-iteration max over ranks),
    # one direction, GB = 1e9 B.
    phase_time_s = times["time_us_p50"] * 1e-6
    scale = 1.0 / phase_time_s / 1e9 if phase_time_s > 0 else float("nan")
    rank_rows = []
    for rank in range(comm.world_size):
        record: dict[str, Any] = {
            "pattern": job.name,
            "phase": phase,
            "backend": backend.label,
            **rank_case,
            "size_bytes": row["size_bytes"] if job.kind == "balanced" else None,
            "rank": rank,
            "domain": int(domains[rank]),
            "host": int(topology.host_of_rank[rank]),
            "sent_bytes": int(sent[rank]),
            "recv_bytes": int(received[rank]),
            "self_bytes": int(per_rank["self_bytes"][rank]),
            "knobs": row["knobs"],
        }
        for name, (out, into) in classes.items():
            record[f"{name}_sent_bytes"] = int(out[rank])
            record[f"{name}_recv_bytes"] = int(into[rank])
        for name, (out, into) in classes.items():
            record[f"{name}_send_GBps"] = float(out[rank]) * scale
            record[f"{name}_recv_GBps"] = float(into[rank]) * scale
        record["time_us_p50"] = float(np.percentile(seconds[rank], 50) * 1e6)
        record["phase_time_us_p50"] = times["time_us_p50"]
        rank_rows.append(record)
    return row, rank_rows


def _gather_phase(comm: Any, job: Job, mine: _PhaseResult) -> tuple[list[_PhaseResult], dict[str, Any]]:
    """Every rank's outcome of one phase (on every rank) and the job's expert-load imbalance columns."""
    results = comm.all_gather_object(mine)
    imbalance: dict[str, float | None]
    if job.kind == "moe":
        loads = np.array([r.expert_load for r in results], dtype=np.int64).sum(axis=0)
        imbalance = imbalance_columns(loads)
    else:
        imbalance = {"expert_max_mean": None, "maxvio": None, "expert_cv": None}
    return results, imbalance


def _finish_phase(
    comm: Any,
    backend: Backend,
    job: Job,
    phase: str,
    mine: _PhaseResult,
    row_bytes: int,
    case: dict[str, Any],
    topology: Topology,
    emit: Callable[[list[dict], list[dict]], None],
) -> int:
    """Gather one phase's outcome to every rank, emit its rows on rank 0; returns wrong over all ranks."""
    results, imbalance = _gather_phase(comm, job, mine)
    if comm.rank == 0:
        row, rank_rows = _phase_rows(comm, backend, job, phase, results, row_bytes, case, imbalance, topology)
        emit([row], rank_rows)
    return int(sum(r.wrong for r in results))


def skew_cost_columns(
    time_us_p50: float, total_bytes: int, balanced_time_us_p50: float, balanced_total_bytes: int
) -> dict[str, float]:
    """skew_cost = time / balanced time; skew_bw_loss_pct = bandwidth lost against the balanced pattern, in
    % of the balanced pattern's total bytes / time (both carry the same bytes up to rounding)."""
    if not (time_us_p50 > 0 and balanced_time_us_p50 > 0 and balanced_total_bytes > 0):
        return {"skew_cost": float("nan"), "skew_bw_loss_pct": float("nan")}
    skewed_bw = total_bytes / time_us_p50
    balanced_bw = balanced_total_bytes / balanced_time_us_p50
    return {
        "skew_cost": time_us_p50 / balanced_time_us_p50,
        "skew_bw_loss_pct": 100.0 * (1.0 - skewed_bw / balanced_bw),
    }


def _balanced_reference(
    comm: Any,
    backend: Backend,
    job: Job,
    num_tokens: int,
    dispatch_results: list[_PhaseResult],
    dispatch_row_bytes: int,
    combine_row_bytes: int,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Time dispatch and combine again, same backend calls and verification, on a skew-free MoE plan with the
    skewed job's total rows, row sizes, tokens per rank and send mode (``plan_balanced_moe``: every (src, dst)
    pair gets total / world^2 rows, remainder spread one row per pair). Returns ({phase: the phase row's
    balanced_* columns}, failure messages)."""
    world = comm.world_size
    me = comm.rank
    device = comm.device
    total_rows = int(sum(sum(r.send_rows) for r in dispatch_results))
    if total_rows == 0:  # nothing to balance (fully masked patterns)
        empty = {
            "balanced_size_bytes": None,
            "balanced_total_bytes": None,
            "balanced_time_us_p50": float("nan"),
        }
        return {"dispatch": dict(empty), "combine": dict(empty)}, []
    model = job.routing.model
    per_rank = experts_per_rank(model.num_experts, world)
    plans = [
        plan_balanced_moe(
            src, world, total_rows, num_tokens, dispatch_row_bytes, combine_row_bytes, job.send_mode, per_rank
        )
        for src in range(world)
    ]
    plan = plans[me].to(device)
    tokens = encode_rows(me, torch.arange(plan.num_tokens, device=device), plan.dispatch_row_bytes)
    backend.setup_peers(plans)
    backend.setup(plan)
    state: dict[str, torch.Tensor] = {}

    def dispatch() -> torch.Tensor:  # as the skewed dispatch: counts exchange + rows
        state["recv_counts"] = counts = backend.exchange_counts(plan.send_counts)
        return backend.dispatch(tokens, plan, counts)

    with comm.guard(f"job {job.name!r} imbalance-cost balanced dispatch"):
        dispatch_seconds, received = _timed_phase(comm, backend, job, dispatch)
    dispatch_wrong = count_wrong_rows(received, expected_rows(plans, me, device))
    comm.heartbeat()
    recv_counts = state["recv_counts"]
    src, token = decode_header(received)
    expert_out = expert_outputs(src, token, received_keys(recv_counts, me, job.send_mode), model.hidden)
    reference, tolerance = expected_combine(plan, model.hidden)
    with comm.guard(f"job {job.name!r} imbalance-cost balanced combine"):
        combine_seconds, combined = _timed_phase(
            comm, backend, job, lambda: backend.combine(expert_out, plan, recv_counts)
        )
    combine_wrong = count_wrong_combine(combined, reference, tolerance)
    comm.heartbeat()
    mine = (dispatch_seconds, dispatch_wrong, combine_seconds, combine_wrong, plan.send_splits)
    gathered = comm.all_gather_object(mine)
    columns: dict[str, dict[str, Any]] = {}
    failures = []
    for phase, row_bytes, seconds_at, wrong_at, unit in (
        ("dispatch", dispatch_row_bytes, 0, 1, "bytes"),
        ("combine", combine_row_bytes, 2, 3, "elements"),
    ):
        results = [_PhaseResult(g[seconds_at], g[wrong_at], g[4]) for g in gathered]
        matrix = _phase_matrix(results, phase, row_bytes)
        times = _time_columns(np.array([r.seconds for r in results], dtype=np.float64))
        columns[phase] = {
            "balanced_size_bytes": _byte_columns(matrix)["size_bytes"],
            "balanced_total_bytes": int(matrix.sum()),
            "balanced_time_us_p50": times["time_us_p50"],
        }
        wrong = int(sum(r.wrong for r in results))
        if wrong:
            failures.append(f"{phase} imbalance-cost balanced reference #wrong={wrong} {unit}")
    return columns, failures


def _corrupt_received(received: torch.Tensor) -> None:
    if received.numel():
        received[0, -1:].bitwise_xor_(0xFF)


def _corrupt_combined(combined: torch.Tensor) -> None:
    if combined.numel():
        combined.view(-1)[:1].add_(1.0)


@functools.lru_cache(maxsize=128)
def _cached_routing(cfg: RoutingConfig, rank: int) -> Routing:
    return route_rank(cfg, rank)


@functools.lru_cache(maxsize=128)
def _cached_plan(cfg: RoutingConfig, send_mode: str, rank: int) -> RankPlan:
    """Routings and plans are read-only and deterministic: thread ranks (mock runs) share them."""
    return plan_rank(_cached_routing(cfg, rank), cfg.model, cfg.world_size, send_mode)


def _source_plans(comm: Any, job: Job) -> list[RankPlan]:
    """Every rank's plan: routing is deterministic per rank, so each receiver rebuilds its sources' plans."""
    plans = []
    for src in range(comm.world_size):
        plans.append(_cached_plan(job.routing, job.send_mode, src))
        comm.heartbeat()
    return plans


def _run_moe(
    comm: Any,
    backend: Backend,
    job: Job,
    opts: RunOptions,
    topology: Topology,
    emit: Callable[[list[dict], list[dict]], None],
) -> list[str]:
    cfg = job.routing
    model = cfg.model
    me = comm.rank
    device = comm.device
    routing = _cached_routing(cfg, me)
    kept = routing.topk_ids[routing.topk_ids >= 0]
    expert_load = torch.bincount(kept.cpu(), minlength=model.num_experts).tolist()
    plans = _source_plans(comm, job)
    plan = plans[me].to(device)
    case = {
        "tokens_per_rank": cfg.tokens_per_rank,
        "topk": model.topk,
        "hidden": model.hidden,
        "skew": cfg.skew.text,
        "send_mode": job.send_mode,
        "dispatch_dtype": model.dispatch_dtype,
        "seed": cfg.seed,
    }
    tokens = encode_rows(me, torch.arange(plan.num_tokens, device=device), plan.dispatch_row_bytes)
    backend.setup_peers(plans)
    backend.setup(plan)
    failures = []
    # (phase, gathered outcomes, imbalance columns, row bytes); rows are emitted at once without the
    # imbalance cost, else after the balanced references (their columns go into these rows).
    finished: list[tuple[str, list[_PhaseResult], dict[str, Any], int]] = []

    def finish(phase: str, mine: _PhaseResult, row_bytes: int) -> int:
        results, imbalance = _gather_phase(comm, job, mine)
        if opts.imbalance_cost:
            finished.append((phase, results, imbalance, row_bytes))
        elif me == 0:
            row, rank_rows = _phase_rows(
                comm, backend, job, phase, results, row_bytes, case, imbalance, topology
            )
            emit([row], rank_rows)
        return int(sum(r.wrong for r in results))

    # Dispatch: counts exchange (unless static) + rows, timed together as a dispatcher does both.
    state: dict[str, torch.Tensor] = {}

    def dispatch() -> torch.Tensor:
        counts = plan.static_recv_counts
        if counts is None:
            counts = backend.exchange_counts(plan.send_counts)
        state["recv_counts"] = counts
        return backend.dispatch(tokens, plan, counts)

    with comm.guard(f"job {job.name!r} dispatch"):
        seconds, received = _timed_phase(comm, backend, job, dispatch)
    if opts.corrupt == "dispatch" and me == 0:
        _corrupt_received(received)
    wrong = count_wrong_rows(received, expected_rows(plans, me, device))
    comm.heartbeat()
    mine = _PhaseResult(seconds, wrong, plan.send_splits, expert_load)
    total_wrong = finish("dispatch", mine, plan.dispatch_row_bytes)
    if total_wrong:
        failures.append(f"dispatch #wrong={total_wrong} bytes")

    # Combine: expert outputs derive from what actually arrived (decoded headers) and the row's key.
    recv_counts = state["recv_counts"]
    src, token = decode_header(received)
    keys = received_keys(recv_counts, me, job.send_mode)
    expert_out = expert_outputs(src, token, keys, model.hidden)
    reference, tolerance = expected_combine(plan, model.hidden)
    comm.heartbeat()
    with comm.guard(f"job {job.name!r} combine"):
        seconds, combined = _timed_phase(
            comm, backend, job, lambda: backend.combine(expert_out, plan, recv_counts)
        )
    if opts.corrupt == "combine" and me == 0:
        _corrupt_combined(combined)
    wrong = count_wrong_combine(combined, reference, tolerance)
    comm.heartbeat()
    mine = _PhaseResult(seconds, wrong, plan.send_splits, expert_load)
    total_wrong = finish("combine", mine, plan.combine_row_bytes)
    if total_wrong:
        failures.append(f"combine #wrong={total_wrong} elements")

    # Imbalance cost: both phases again on a skew-free plan of the same rows, timed in this launch.
    if finished:
        references, ref_failures = _balanced_reference(
            comm,
            backend,
            job,
            plan.num_tokens,
            finished[0][1],
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
        )
        failures += ref_failures
    for phase, results, imbalance, row_bytes in finished:
        if me == 0:
            columns = references[phase]
            row, rank_rows = _phase_rows(
                comm, backend, job, phase, results, row_bytes, case, imbalance, topology
            )
            row.update(columns)
            row.update(
                skew_cost_columns(
                    row["time_us_p50"],
                    row["total_bytes"],
                    columns["balanced_time_us_p50"],
                    columns["balanced_total_bytes"] or 0,
                )
            )
            emit([row], rank_rows)
    return failures


def _run_balanced(
    comm: Any,
    backend: Backend,
    job: Job,
    opts: RunOptions,
    topology: Topology,
    emit: Callable[[list[dict], list[dict]], None],
) -> list[str]:
    me = comm.rank
    device = comm.device
    case = {
        "tokens_per_rank": None,
        "topk": None,
        "hidden": None,
        "skew": None,
        "send_mode": None,
        "dispatch_dtype": None,
        "seed": None,
    }
    failures = []
    for size in job.sizes:
        plans = [plan_balanced(src, comm.world_size, int(size)) for src in range(comm.world_size)]
        plan = plans[me].to(device)
        tokens = encode_rows(me, torch.arange(plan.num_tokens, device=device), plan.dispatch_row_bytes)
        backend.setup_peers(plans)
        backend.setup(plan)
        with comm.guard(f"job {job.name!r} alltoall {size} B"):
            seconds, received = _timed_phase(
                comm, backend, job, lambda p=plan, t=tokens: backend.dispatch(t, p, p.static_recv_counts)
            )
        if opts.corrupt == "dispatch" and me == 0:
            _corrupt_received(received)
        wrong = count_wrong_rows(received, expected_rows(plans, me, device))
        mine = _PhaseResult(seconds, wrong, plan.send_splits)
        total_wrong = _finish_phase(
            comm, backend, job, "alltoall", mine, plan.dispatch_row_bytes, case, topology, emit
        )
        if total_wrong:
            failures.append(f"alltoall {size} B #wrong={total_wrong} bytes")
    return failures
