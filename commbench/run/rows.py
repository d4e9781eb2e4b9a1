"""Result and rank rows of one phase, from its [src][dst] bytes and per-rank times only.

Rows hold bytes, times and what was run (job case, backend, knobs, layout); no bandwidth: the report derives
every GB/s and percentage from these columns. A phase's bytes are its Pattern matrix (self traffic in
``total_bytes`` and ``size_bytes``, not in link columns); link classes (``traffic.links``) split them by the
run's layout. Times: every rank's samples [ranks, samples], ``timing`` saying which ("iteration": one per
timed iteration; "window": one per rank, window / iters, as nccl-tests); a sample's time is the MAX over
ranks (the bottleneck rank: nccl-tests -a 3, where its default -a 1 averages the ranks); rows report the
min/p50/p99/mean of those, in microseconds (all four equal in window timing). ``wrong`` sums every rank's
checked outputs and ``check`` says how they were checked (``RunOptions.check``, or "window-last": the
window's final output, byte for byte); a backend that moves no data has wrong None (n/a) and check "n/a".
Knobs go in as data: one column per backend knob, and ``knobs``, a dict of the setting (the report writes
it as "k=v k=v" text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from commbench.inputs.layout import Layout
from commbench.run.case import CASE_FIELDS, model_digest
from commbench.run.interface import Backend
from commbench.run.jobs import Job, MoeJob
from commbench.traffic.links import link_class_byte_columns, per_rank_link_bytes

# The job-case columns of a result row (None for a balanced all-to-all); rank rows repeat every case field
# (``run.case.CASE_FIELDS``) so that a rank row and its result row are the same ``Case``.
CASE_KEYS = (
    "tokens_per_rank",
    "topk",
    "hidden",
    "skew",
    "send_mode",
    "dispatch_dtype",
    "seed",
    "model_digest",
)
# What a rank row repeats of its result row, beside its own pattern, phase, backend, size and repeat.
RANK_CASE_FIELDS = tuple(
    key for key in CASE_FIELDS if key not in ("pattern", "phase", "backend", "size_bytes", "repeat", "knobs")
)
# Without a uniform reference (nothing routed): the imbalance-cost columns of an MoE phase row.
NO_REFERENCE = {
    "uniform_ref_size_bytes": None,
    "uniform_ref_total_bytes": None,
    "uniform_ref_time_us_p50": float("nan"),
}


def byte_columns(matrix: np.ndarray) -> dict[str, int]:
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


def time_columns(seconds: np.ndarray) -> dict[str, float]:
    """seconds [ranks, samples] -> stats of the per-sample max over ranks, in microseconds."""
    bottleneck_us = seconds.max(axis=0) * 1e6
    return {
        "time_us_min": float(bottleneck_us.min()),
        "time_us_p50": float(np.percentile(bottleneck_us, 50)),
        "time_us_p99": float(np.percentile(bottleneck_us, 99)),
        "time_us_mean": float(bottleneck_us.mean()),
    }


def in_place_columns(seconds: np.ndarray | None) -> dict[str, float]:
    """A balanced row's in-place time (nccl-tests' in-place columns): the mean over the timed iterations of
    the max over ranks, in microseconds, as ``time_us_mean``; NaN where the backend has no in-place run."""
    if seconds is None:
        return {"in_place_time_us_mean": float("nan")}
    return {"in_place_time_us_mean": time_columns(seconds)["time_us_mean"]}


def imbalance_columns(expert_load: np.ndarray | None) -> dict[str, float | None]:
    """expert_max_mean = max / mean, maxvio = (max - mean) / mean, expert_cv = std / mean of expert loads
    (NaN when nothing was kept; None without experts, as in a balanced all-to-all)."""
    if expert_load is None:
        return {"expert_max_mean": None, "maxvio": None, "expert_cv": None}
    load = expert_load.astype(np.float64)
    mean = float(load.mean()) if load.size else 0.0
    if mean <= 0:
        return {"expert_max_mean": float("nan"), "maxvio": float("nan"), "expert_cv": float("nan")}
    return {
        "expert_max_mean": float(load.max() / mean),
        "maxvio": float((load.max() - mean) / mean),
        "expert_cv": float(load.std() / mean),
    }


def reference_columns(matrix: np.ndarray, seconds: np.ndarray) -> dict[str, Any]:
    """The uniform_ref_* columns an MoE phase row gets from its imbalance-cost reference: the same rows
    spread uniformly over the ranks (bytes, time). Not the balanced (nccl-tests) sweep."""
    return {
        "uniform_ref_size_bytes": byte_columns(matrix)["size_bytes"],
        "uniform_ref_total_bytes": int(matrix.sum()),
        "uniform_ref_time_us_p50": time_columns(seconds)["time_us_p50"],
    }


def row_knobs(backend: Backend, job: Job) -> dict[str, Any]:
    """The backend's knobs (``knobs()``, effective values), then any option of the job's own setting that
    the backend does not report (as itself or as "<backend>_<option>", as sim and mock do), so the rows of a
    sweep's settings always differ in the ``knobs`` column."""
    knobs = dict(backend.knobs())
    for key, value in (job.backend_options or {}).items():
        if f"{backend.name}_{key}" not in knobs:
            knobs.setdefault(key, value)
    if isinstance(job, MoeJob) and job.routing.replicas:  # run --replicas: the case with EPLB replicas
        knobs["replicas"] = job.routing.replicas
    return knobs


@dataclass(frozen=True)
class RowMaker:
    """What every row of one job shares (the job's case, the backend, the layout); ``rows`` adds one phase's
    bytes and times, and the backend's knobs as they are then (effective values may depend on the plan set
    up, as shmem-emu's chunk_rows does)."""

    job: Job
    backend: Backend
    layout: Layout
    check: str = "checksum"  # the rows' check column: a RunOptions.check, "window-last" or "n/a"

    def emulated(self) -> bool:
        """Whether the rows are not GPU fabric figures: an emulated backend, or ranks on CPU (gloo)."""
        device = getattr(getattr(self.backend, "comm", None), "device", None)
        return bool(self.backend.emulated) or getattr(device, "type", "cpu") == "cpu"

    def case(self) -> dict[str, Any]:
        job = self.job
        if not isinstance(job, MoeJob):
            return dict.fromkeys(CASE_KEYS)
        cfg = job.routing
        model = cfg.model
        values = (
            cfg.tokens_per_rank,
            model.topk,
            model.hidden,
            cfg.skew.text,
            job.send_mode,
            model.dispatch_dtype,
            cfg.seed,
            model_digest(model),
        )
        return dict(zip(CASE_KEYS, values, strict=True))

    def rows(
        self,
        phase: str,
        matrix: np.ndarray,
        row_bytes: int,
        seconds: np.ndarray,
        wrong: int | None,
        expert_load: np.ndarray | None = None,
        arrival: np.ndarray | None = None,
        wait: np.ndarray | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(result row, rank rows) of one phase: ``matrix`` its [src][dst] bytes, ``seconds`` [ranks,
        samples] every rank's timed iterations or window, ``wrong`` the sum over ranks (None: not checked),
        ``expert_load`` the job's (MoE), ``arrival`` / ``wait`` [ranks, calls] each timed call's arrival and
        time inside the call, in seconds (harness._TimedCalls)."""
        case = self.case()
        layout, backend = self.layout, self.backend
        knobs = row_knobs(backend, self.job)
        times = time_columns(seconds)
        row: dict[str, Any] = {
            "pattern": self.job.name,
            "phase": phase,
            "backend": backend.label,
            "backend_name": backend.name,
            "emulated": self.emulated(),
            "world_size": layout.world_size,
            **case,
            "warmup": self.job.warmup,
            "iters": self.job.iters,
            "timing": self.job.timing,
            # --cuda-graph N: calls captured per CUDA graph (timing "graph"); None for the other timings.
            "graph_calls": self.job.graph_calls or None,
            "repeat": self.job.repeat,
            "row_bytes": int(row_bytes),
            **byte_columns(matrix),
            "num_domains": layout.num_domains,
            "ranks_per_domain": int(layout.domain_sizes.max()),
            "layout_source": layout.method,
            **link_class_byte_columns(matrix, layout.domain_of_rank),
            **times,
            "wrong": None if wrong is None else int(wrong),
            "check": self.check,
            **imbalance_columns(expert_load),
            **backend.knobs(),
            "knobs": knobs,
        }
        per_rank = per_rank_link_bytes(matrix, layout.domain_of_rank)
        sent, received = per_rank["total_send_bytes"], per_rank["total_recv_bytes"]
        self_bytes = per_rank["self_bytes"]
        classes = {
            "link": (sent - self_bytes, received - self_bytes),
            "nvlink": (per_rank["nvlink_send_bytes"], per_rank["nvlink_recv_bytes"]),
            "scaleout": (per_rank["scaleout_send_bytes"], per_rank["scaleout_recv_bytes"]),
        }
        rank_rows = []
        for rank in range(layout.world_size):
            record: dict[str, Any] = {
                "pattern": self.job.name,
                "phase": phase,
                "backend": backend.label,
                **{key: row[key] for key in RANK_CASE_FIELDS},
                "size_bytes": None if isinstance(self.job, MoeJob) else row["size_bytes"],
                "repeat": self.job.repeat,
                "rank": rank,
                "domain": int(layout.domain_of_rank[rank]),
                "host": int(layout.host_of_rank[rank]),
                "sent_bytes": int(sent[rank]),
                "recv_bytes": int(received[rank]),
                "self_bytes": int(self_bytes[rank]),
                "knobs": dict(knobs),
            }
            for name, (out, into) in classes.items():
                record[f"{name}_sent_bytes"] = int(out[rank])
                record[f"{name}_recv_bytes"] = int(into[rank])
            record["time_us_p50"] = float(np.percentile(seconds[rank], 50) * 1e6)
            record["phase_time_us_p50"] = times["time_us_p50"]
            # The rank's lateness (harness.Measured.arrival): the p50 over its timed calls, so that one
            # descheduled call does not make a rank late.
            late = arrival[rank] if arrival is not None and arrival.size else None
            record["arrival_us_p50"] = float(np.percentile(late, 50) * 1e6) if late is not None else None
            inside = wait[rank] if wait is not None and wait.size else None
            # A late rank waits little, its peers wait for it: the other side of arrival.
            record["wait_us_p50"] = float(np.percentile(inside, 50) * 1e6) if inside is not None else None
            rank_rows.append(record)
        return row, rank_rows
