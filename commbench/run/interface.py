"""The backend interface: the few functions a backend plugs into the harness (as nccl-tests' testEngine).

The harness owns timing, verification and result rows; a backend only moves data. ``run_jobs`` gets the
backend class and builds one instance per knob setting (``Backend(comm, options)``). Each of
``exchange_counts``, ``dispatch`` and ``combine`` is one phase, run many times inside the timed region, so it
must not allocate large buffers or loop over tokens in Python.

Verification covers every timed iteration: before each one (outside the timer, before the barrier that
starts it) the harness calls ``poison_receive_buffers``, so a call that silently moves nothing leaves a
sentinel (``traffic.payload.poison_``) rather than the previous iteration's correct bytes. A backend that
moves no data (``moves_data = False``: mock, sim) is not verified; its rows say #wrong n/a.

A backend also describes itself in class attributes (defaults below, the one place they are set): the
process group its ranks join, whether its figures are a GPU fabric's, whether it is one-sided, emulated or
moves data, its library's bandwidth vocabulary, its kernels' names, whether it models the report's layout.
The other stages read these from the class (``backends.get_backend``), never from a list of names, so a new
backend is its own file plus one registry line.

The balanced sweep also times an in-place all-to-all where the backend has one (``in_place``,
``dispatch_in_place``): nccl-tests' in-place columns, one buffer as the exchange's input and output.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from commbench.run.describe import KernelPattern, LibraryBandwidth
from commbench.run.steps import NO_STEPS
from commbench.traffic.plan import RankPlan


@dataclass(frozen=True)
class ExchangeShape:
    """One job's traffic as a backend sizes its own buffers from it, before a launch: every rank's rows to
    every rank and the row sizes (``Backend.symmetric_memory_bytes``)."""

    rows: np.ndarray  # int64 [src, dst]: dispatch rows (combine sends each one back: the transpose)
    dispatch_row_bytes: int
    combine_row_bytes: int
    slots: int = 1  # send-count columns per destination: local experts (selection mode), else 1

    @property
    def busiest_send_rows(self) -> int:
        return int(np.asarray(self.rows).sum(axis=1).max(initial=0))

    @property
    def busiest_recv_rows(self) -> int:
        return int(np.asarray(self.rows).sum(axis=0).max(initial=0))


class Backend(abc.ABC):
    name: ClassVar[str] = ""
    # The torch.distributed process group its ranks join (run.describe.PROCESS_GROUPS): "nccl" = one GPU per
    # rank (nccl, nvshmem, the dispatcher adapters; their buffers live on the GPUs), "gloo" = CPU processes.
    process_group: ClassVar[str] = "gloo"
    # True where its figures are a GPU fabric's (nccl, nvshmem, the adapters): the verdict judges their
    # bandwidth against the spec. False (gloo, mock, sim, shmem-emu): bandwidth is not judged.
    gpu_fabric: ClassVar[bool] = False
    # True for one-sided (put) backends: each receive buffer has a second side on a symmetric heap (double
    # buffering) plus a staging buffer, which the launch's memory estimate counts from the busiest rank
    # (``symmetric_memory_bytes``; nvshmem, shmem-emu).
    one_sided: ClassVar[bool] = False
    # True where timings are not measured on real hardware (mock, sim, shmem-emu): reports label them.
    emulated: ClassVar[bool] = False
    # False where nothing is transferred (mock, sim hand back the expected rows): no verification, #wrong n/a.
    moves_data: ClassVar[bool] = True
    # True where the backend models the report's system and layout (sim): the launch hands it --spec and the
    # layout overrides as its own options, unless they are given as --backend-option.
    models_report_layout: ClassVar[bool] = False
    # True where an instance can run on a sub-group of the ranks (its ``comm`` a ``run.nodes.GroupComm``),
    # so that ``--send-mode node`` runs its two stages on it (nccl, gloo: torch.distributed groups).
    node_stages: ClassVar[bool] = False
    # How its library defines the bandwidth it prints, for the report's "as the library prints it" figure
    # (report.interop.vocabulary); () = only commbench's algbw/busbw.
    bandwidth_vocabulary: ClassVar[tuple[LibraryBandwidth, ...]] = ()
    # True where ``dispatch_in_place`` runs the balanced all-to-all with one buffer as its input and output
    # (nccl-tests alltoall's in-place run: sendbuff == recvbuff); False: the in-place columns say N/A.
    in_place: ClassVar[bool] = False
    # The names of the GPU kernels it launches, communication or compute (report.profiler.kernels assembles
    # every registered backend's); () = none of its own.
    kernel_patterns: ClassVar[tuple[KernelPattern, ...]] = ()
    # True where its timed calls can be captured into a CUDA graph and replayed (--cuda-graph, run.graphs):
    # device work on the current stream with no host read of device values; which jobs and options hold
    # under capture is its ``graph_refusal``. False (gloo, mock, sim, shmem-emu, the adapters): refused.
    captures_graphs: ClassVar[bool] = False
    # The profiler's recorder (run.steps): a backend marks the parts of its calls with
    # ``with self.steps("pack"):``; the harness sets a StepRecorder under --profile, else it costs nothing.
    steps: Any = NO_STEPS
    # False inside a window timed with --blocking 0 (nccl-tests -z 0; the harness sets it): a dispatch may
    # return once its exchange is issued, ``synchronize`` waiting for what is still in flight
    # (torch.distributed's async_op). A backend whose calls are device-asynchronous anyway (NCCL on a
    # stream, NVSHMEM) or that cannot return early may ignore it; combine always reduces what arrived.
    blocking: bool = True

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        self.comm = comm  # commbench.run.dist.Comm
        self.options = dict(options or {})

    @property
    def label(self) -> str:
        """What the report's ``backend`` column shows (e.g. "nccl", "gloo", "shmem-emu (CPU emulator)")."""
        return self.name

    def knobs(self) -> dict[str, Any]:
        """Performance options that land in every result row (e.g. num_blocks, chunk_bytes)."""
        return {}

    @classmethod
    def graph_refusal(cls, job_kind: str, options: Mapping[str, Any], calls: int) -> str:
        """Why a job of ``job_kind`` ("moe", "balanced", "matrix") with these backend ``options`` cannot be
        captured ``calls`` calls to a CUDA graph ("" when it can); checked before launch. By default: every
        job where ``captures_graphs``, none elsewhere."""
        if cls.captures_graphs:
            return ""
        return (
            "its calls cannot be captured into a CUDA graph (not CUDA work on one stream, or a library's own "
            "calls); use --backend nccl or nvshmem, or leave out --cuda-graph"
        )

    @classmethod
    def symmetric_memory_bytes(cls, shape: ExchangeShape) -> int:
        """Device bytes per rank that a one-sided backend's own buffers take for a job of ``shape``, at most
        over its options, with what its library reserves for them (the launch's memory estimate,
        ``cli.resources``; a backend that sizes its heap itself overrides this with that same function). By
        default the one-sided layout of the busiest rank: a staging buffer and a double-buffered receive
        buffer per phase. 0 for a two-sided backend: the estimate counts its send and receive buffers."""
        if not cls.one_sided:
            return 0
        send, recv = shape.busiest_send_rows, shape.busiest_recv_rows
        dispatch, combine = shape.dispatch_row_bytes, shape.combine_row_bytes
        return (send + 2 * recv) * dispatch + (recv + 2 * send) * combine

    def setup(self, plan: RankPlan) -> None:  # noqa: B027 - optional hook
        """Allocate buffers for ``plan`` (untimed)."""

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:  # noqa: B027 - optional hook
        """Every rank's plan (``plans[src]``), given before ``setup`` (untimed). Only backends that model the
        traffic instead of moving it need it; the harness builds these plans anyway to verify."""

    def modelled_seconds(self) -> float | None:
        """Emulated timing: the modelled duration of the last exchange_counts + dispatch (or combine) calls.
        None (the default) = the harness measures the phase with its timer."""
        return None

    @abc.abstractmethod
    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """All-to-all of the [world, slots] count matrix; returns recv_counts [world, slots], row = source."""

    @abc.abstractmethod
    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        """Send ``tokens[plan.send_token_index]`` (grouped by destination) and return the received rows,
        uint8 [sum(recv_counts), plan.dispatch_row_bytes], in source-rank order, each source's rows in the
        order that source sent them."""

    @abc.abstractmethod
    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        """Send ``expert_out`` (one row per received dispatch row, same order) back to the token owners and
        reduce into token order: out[t] = sum over send rows r of token t of plan.combine_weight[r] * row(r).
        Returns float32 [plan.num_tokens, hidden]."""

    def dispatch_in_place(self, buffer: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        """The balanced all-to-all of ``plan`` (set up by ``setup``) with ``buffer`` as both its input and
        its output: uint8 [world, row bytes], row i for rank i. Only where ``in_place`` is True. An
        all-to-all whose send and receive buffers are one may overwrite a row before sending it (NCCL and gloo
        do not order them), so its result is undefined and the harness times it without checking it, as
        nccl-tests does ("We don't support in-place alltoall": its in-place #wrong is N/A)."""
        raise NotImplementedError(f"backend {self.name} has no in-place all-to-all (in_place is False)")

    def poison_receive_buffers(self) -> None:
        """Fill every buffer a later dispatch or combine reads received data from (receive buffers, both
        sides of double-buffered ones, unpack buffers) with ``traffic.payload.poison_`` (untimed; the
        harness synchronizes after it and then enters a barrier, so no peer writes into a buffer being
        poisoned). A backend that moves data must implement it, even as a no-op when each call returns a
        freshly written buffer; one that moves none (``moves_data = False``) need not."""
        if self.moves_data:
            raise NotImplementedError(
                f"backend {self.name} moves data but does not poison its receive buffers "
                "(poison_receive_buffers): a stale buffer would pass verification"
            )

    def synchronize(self) -> None:
        """Wait for outstanding device work and calls still in flight (``blocking`` False); the harness
        calls it before reading a host clock."""
        if torch.cuda.is_available() and self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and communicators."""
