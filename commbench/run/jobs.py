"""What to run: one dataclass per job kind (an MoE layer, a balanced all-to-all) and the run's options.

Each job checks itself against the world size before any collective (``check``), so a bad job is a one-line
UsageError on every rank instead of a hang. A job may carry its own backend options (a knob setting of a
sweep, ``backend_options``), laid over ``RunOptions.backend_options`` (``job_backend_options``), and says how
its phases are timed (``timing``, one of JOB_TIMINGS): "window" for the balanced sweep, "iteration" for MoE
phases by default, "graph" with --cuda-graph (``graph_calls`` calls captured per CUDA graph, ``run.graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from commbench.errors import UsageError
from commbench.run.config import GRAPH_TIMING, JOB_TIMINGS, RunOptions
from commbench.traffic.nodes import node_phases
from commbench.traffic.pattern import SEND_MODES
from commbench.traffic.payload import HEADER_BYTES
from commbench.traffic.plan import balanced_row_bytes
from commbench.traffic.routing import RoutingConfig

# Window timing checks only the window's final output, byte for byte: the rows' check column says so.
CHECK_WINDOW_LAST = "window-last"


def _check_repeats(name: str, warmup: int, iters: int, timing: str, graph_calls: int = 0) -> None:
    if iters < 1 or warmup < 0:
        raise UsageError(f"job {name!r}: need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    if timing not in JOB_TIMINGS:
        raise UsageError(f"job {name!r}: unknown timing {timing!r}; choose {' or '.join(JOB_TIMINGS)}")
    if (timing == GRAPH_TIMING) != (graph_calls >= 1):
        raise UsageError(
            f"job {name!r}: timing {timing!r} with {graph_calls} calls per CUDA graph; graph timing needs "
            "--cuda-graph N (N >= 1), the other timings none"
        )


@dataclass
class MoeJob:
    """One MoE layer: every rank dispatches its routed tokens to the experts' ranks, then combines the
    answers (two phases, each a row)."""

    kind: ClassVar[str] = "moe"
    name: str
    routing: RoutingConfig
    # "token" (a row per (token, destination rank)), "selection" or "node" (traffic.nodes: two stages)
    send_mode: str = "token"
    warmup: int = 5
    iters: int = 20
    backend_options: dict[str, Any] | None = None  # this job's knob setting (over RunOptions')
    timing: str = "iteration"  # JOB_TIMINGS: per-iteration checks and percentiles
    repeat: int = 0  # which measurement of its case (suite --repeat, soak rounds): 0, 1, ...
    graph_calls: int = 0  # timing "graph": calls captured per CUDA graph (--cuda-graph N)
    decode: bool = False  # the decode case (--decode, the suite's): its rows say regime "decode"

    def check(self, world_size: int) -> None:
        """UsageError unless the job can run on ``world_size`` ranks."""
        _check_repeats(self.name, self.warmup, self.iters, self.timing, self.graph_calls)
        if self.routing.world_size != world_size:
            raise UsageError(
                f"job {self.name!r} is routed for {self.routing.world_size} ranks but {world_size} are "
                f"running; set the routing world size to {world_size}"
            )
        model = self.routing.model
        if model.dispatch_bytes_per_token < HEADER_BYTES:
            raise UsageError(
                f"job {self.name!r}: hidden size {model.hidden} is too small for the {HEADER_BYTES}-byte row "
                f"header; use hidden >= {HEADER_BYTES}"
            )
        if self.send_mode not in SEND_MODES:
            raise UsageError(
                f"job {self.name!r}: unknown send mode {self.send_mode!r}; choose {', '.join(SEND_MODES)}"
            )

    @property
    def phases(self) -> tuple[str, ...]:
        """The row phases the job writes, in order: dispatch and combine, and in node mode each one's two
        stages after it (``traffic.nodes.node_phases``)."""
        return node_phases() if self.send_mode == "node" else ("dispatch", "combine")


@dataclass
class BalancedJob:
    """nccl-tests alltoall: per size, every rank sends ``size // world`` bytes to each rank (one row each)."""

    kind: ClassVar[str] = "balanced"
    name: str
    sizes: list[int] = field(default_factory=list)  # bytes each rank sends in total
    warmup: int = 5
    iters: int = 20
    backend_options: dict[str, Any] | None = None  # this job's knob setting (over RunOptions')
    timing: str = "window"  # JOB_TIMINGS: nccl-tests' default
    repeat: int = 0  # which measurement of its case (suite --repeat, soak rounds): 0, 1, ...
    graph_calls: int = 0  # timing "graph": calls captured per CUDA graph (--cuda-graph N)

    def check(self, world_size: int) -> None:
        """UsageError unless every size can run on ``world_size`` ranks."""
        _check_repeats(self.name, self.warmup, self.iters, self.timing, self.graph_calls)
        if not self.sizes:
            raise UsageError(f"job {self.name!r}: a balanced all-to-all needs at least one size")
        for size in self.sizes:
            balanced_row_bytes(world_size, int(size))


# A MatrixJob call's rows carry their row number in an int32 header field (traffic.payload).
MAX_MATRIX_ROWS = (1 << 31) - 1


@dataclass(frozen=True)
class MatrixCall:
    """One all-to-all-v of a MatrixJob: the rows' phase name (e.g. "call 3 all_to_allv") and int64
    [src][dst] bytes."""

    name: str
    matrix: np.ndarray

    @property
    def row_bytes(self) -> int:
        """The rows the call is sent in: the gcd of its non-zero entries, so each (src, dst) is whole rows
        (8 for a call that moves nothing)."""
        moved = self.matrix[self.matrix > 0]
        return int(np.gcd.reduce(moved)) if moved.size else HEADER_BYTES


@dataclass
class MatrixJob:
    """Given [src][dst] byte matrices (a training trace's all-to-all calls, run.matrix): each call one
    all-to-all-v through the backend's dispatch path, timed and verified like a balanced size (a row each)."""

    kind: ClassVar[str] = "matrix"
    name: str  # the rows' pattern, e.g. "kineto"
    calls: list[MatrixCall] = field(default_factory=list)
    warmup: int = 5
    iters: int = 20
    backend_options: dict[str, Any] | None = None  # this job's knob setting (over RunOptions')
    timing: str = "window"  # JOB_TIMINGS: as the balanced sweep (nccl-tests' alltoallv_perf)
    repeat: int = 0  # which measurement of its case (suite --repeat, soak rounds): 0, 1, ...
    graph_calls: int = 0  # timing "graph": calls captured per CUDA graph (--cuda-graph N)

    def check(self, world_size: int) -> None:
        """UsageError unless every call is a [world][world] matrix of whole non-negative bytes."""
        _check_repeats(self.name, self.warmup, self.iters, self.timing, self.graph_calls)
        if not self.calls:
            raise UsageError(f"job {self.name!r}: no all-to-all call to run")
        for call in self.calls:
            matrix = np.asarray(call.matrix)
            if matrix.shape != (world_size, world_size):
                raise UsageError(
                    f"job {self.name!r} {call.name}: a matrix of {list(matrix.shape)} bytes for {world_size} "
                    f"ranks; run it with --world-size {matrix.shape[0] if matrix.ndim else 1}"
                )
            if matrix.dtype.kind not in "iu" or (matrix < 0).any():
                raise UsageError(f"job {self.name!r} {call.name}: bytes must be whole numbers >= 0")
            rows = int(matrix.sum(axis=1).max()) // call.row_bytes
            if rows > MAX_MATRIX_ROWS:
                raise UsageError(
                    f"job {self.name!r} {call.name}: {rows} rows of {call.row_bytes} B from one rank (the "
                    f"gcd of its entries) are more than {MAX_MATRIX_ROWS}"
                )


Job = MoeJob | BalancedJob | MatrixJob


def check_timing(job: Job, opts: RunOptions) -> None:
    """UsageError where the job's timing cannot give what the check mode verifies: --check every verifies
    each timed iteration's output, which window timing overwrites with the next one."""
    if opts.check == "every" and job.timing in ("window", GRAPH_TIMING):
        raise UsageError("--check every needs --timing iteration")


def job_backend_options(job: Job, opts: RunOptions) -> dict[str, Any]:
    """The options the job's backend is built with: the run's, overlaid with the job's own setting."""
    return {**opts.backend_options, **(job.backend_options or {})}
