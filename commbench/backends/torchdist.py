"""torch.distributed ``all_to_all_single`` with uneven splits: the same code on NCCL (GPU) and gloo (CPU).

Dispatch packs the token rows of the plan (index_select into a preallocated send buffer; balanced rows go as
they are) and exchanges them; combine sends the expert outputs back with the reverse splits and reduces them
into token order with ``index_add_`` in float32. Buffers grow on the first (warm-up) call and are reused
after, so timed iterations do not allocate (a receive buffer whose size the plan states is made at
``setup``); the harness poisons both receive buffers before each timed iteration.
``NcclBackend`` and ``GlooBackend`` are this code on their process group, each describing itself. The balanced
sweep's in-place run (``dispatch_in_place``) is the same call with one tensor as input and output, as
nccl-tests' in-place alltoall passes one buffer to NCCL; torch.distributed passes it through to NCCL and gloo
unchanged (neither refuses it; neither orders a row's send before its overwrite, so the result is undefined).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from commbench.backends.base import CombineReduction, grown_buffer
from commbench.backends.options import DeclaredOptions, checked_options
from commbench.run.describe import COMMUNICATION, KernelPattern, kernel_names
from commbench.run.interface import Backend
from commbench.traffic.payload import poison_
from commbench.traffic.plan import RankPlan

# NCCL's kernels as CUPTI/Kineto name them (report.profiler.kernels): ncclDevKernel_<coll>... (2.19+:
# SendRecv, AllReduce_Sum_f32_RING_LL, Generic, ...), ncclKernel_... (before 2.19), ncclSymDevKernel_...
# (2.27 symmetric), ncclSymkDevKernel_...[_profile] (2.28+).
NCCL_KERNELS = (
    KernelPattern(
        "nccl",
        COMMUNICATION,
        kernel_names(r"nccl(?:Dev|SymDev|SymkDev)?Kernel_\w+"),
        "NVIDIA/nccl src/device/generate.py (ncclDevKernel_), src/device/symmetric/generate.py "
        "(ncclSymDevKernel_, ncclSymkDevKernel_); NCCL_KERN_NAME in src/collectives/device/common.h of NCCL "
        "before 2.19 (ncclKernel_)",
    ),
)


class TorchDistBackend(DeclaredOptions, Backend):
    """The all-to-all on the process group its ranks joined (the registered classes are below)."""

    name = "torchdist"  # an instance is named after the process group it runs on (NcclBackend: "nccl")
    in_place = True  # all_to_all_single(buffer, buffer): nccl-tests' in-place alltoall
    node_stages = True  # all_to_all_single on any group: --send-mode node's sub-groups too (run.nodes)

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        # nccl and gloo have no knobs: any option is a UsageError naming the process group.
        self.options = checked_options(comm.process_group, self.OPTIONS, self.options)
        self.name = comm.process_group  # type: ignore[misc] - the column shows which process group ran
        self._plan: RankPlan | None = None
        self._send_splits: list[int] = []
        self._send_buffer: torch.Tensor | None = None
        self._recv_buffer: torch.Tensor | None = None
        self._combine_buffer: torch.Tensor | None = None
        self._reduce = CombineReduction()
        self._static_recv_splits: list[int] | None = None
        self._cached_counts: torch.Tensor | None = None
        self._cached_recv_splits: list[int] = []
        self._in_flight: list[Any] = []  # the works of calls issued with blocking False, not yet waited for

    def setup(self, plan: RankPlan) -> None:
        device = self.comm.device
        self._plan = plan
        self._send_splits = plan.send_splits
        if plan.send_mode != "balanced":  # balanced rows are sent as they are: nothing to pack into
            self._send_buffer = torch.empty(
                (plan.num_send_rows, plan.dispatch_row_bytes), dtype=torch.uint8, device=device
            )
        static = plan.static_recv_counts
        self._static_recv_splits = None if static is None else static.sum(dim=1).tolist()
        self._cached_counts = None
        if self._static_recv_splits is not None:
            # Known now: the receive buffer is made here, so no timed call allocates (even with --warmup 0).
            self._recv_buffer = grown_buffer(
                self._recv_buffer, sum(self._static_recv_splits), (plan.dispatch_row_bytes,), torch.uint8,
                device,
            )  # fmt: skip

    def _recv_splits(self, recv_counts: torch.Tensor) -> list[int]:
        """Per-source row counts on the host (a device sync on GPU), reused while the counts are unchanged."""
        if self._static_recv_splits is not None:
            return self._static_recv_splits
        if recv_counts is not self._cached_counts:
            self._cached_recv_splits = recv_counts.sum(dim=1).tolist()
            self._cached_counts = recv_counts
        return self._cached_recv_splits

    def poison_receive_buffers(self) -> None:
        # What all_to_all_single writes into: dispatch rows, and the combine rows the reduction reads.
        for buffer in (self._recv_buffer, self._combine_buffer):
            if buffer is not None:
                poison_(buffer)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        # A fresh output each call: a caller may keep the previous counts.
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.comm.group)
        return recv_counts

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        recv_splits = self._recv_splits(recv_counts)
        rows = sum(recv_splits)
        self._recv_buffer = grown_buffer(
            self._recv_buffer, rows, (plan.dispatch_row_bytes,), torch.uint8, self.comm.device
        )
        received = self._recv_buffer[:rows]
        if plan.send_mode == "balanced":
            send = tokens.contiguous()  # row i already goes to rank i: nothing to pack (as nccl-tests)
        else:
            with self.steps("pack"):
                send = torch.index_select(tokens, 0, plan.send_token_index, out=self._send_buffer)
        with self.steps("payload transfer"):
            self._issued(
                dist.all_to_all_single(
                    received,
                    send,
                    output_split_sizes=recv_splits,
                    input_split_sizes=self._send_splits,
                    group=self.comm.group,
                    async_op=not self.blocking,
                )
            )
        # No unpack: all_to_all_single delivers the rows in source order, as the harness expects them.
        return received

    def dispatch_in_place(self, buffer: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        splits = self._send_splits  # balanced: as many rows from each source as to each destination
        with self.steps("payload transfer"):
            self._issued(
                dist.all_to_all_single(
                    buffer,
                    buffer,
                    output_split_sizes=splits,
                    input_split_sizes=splits,
                    group=self.comm.group,
                    async_op=not self.blocking,
                )
            )
        return buffer

    def _issued(self, work: Any) -> None:
        # An async call's work (blocking False), waited for by synchronize. Its calls in flight together
        # write the same bytes into one receive buffer and read one send buffer that a later pack rewrites
        # with the same bytes, so the window's last output is what one call alone delivers.
        if work is not None:
            self._in_flight.append(work)

    def synchronize(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        for work in in_flight:  # under the group's timeout, as a blocking call is
            work.wait()
        super().synchronize()

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        hidden = int(expert_out.shape[1])
        device = self.comm.device
        rows = plan.num_send_rows
        self._combine_buffer = grown_buffer(self._combine_buffer, rows, (hidden,), expert_out.dtype, device)
        returned = self._combine_buffer[:rows]
        # Reverse of dispatch: each expert side sends back, per source, the rows it received from it.
        with self.steps("send-back"):
            dist.all_to_all_single(
                returned,
                expert_out.contiguous(),
                output_split_sizes=self._send_splits,
                input_split_sizes=self._recv_splits(recv_counts),
                group=self.comm.group,
            )
        with self.steps("weighted reduce"):
            return self._reduce(returned, plan.send_token_index, plan.combine_weight, plan.num_tokens)


class NcclBackend(TorchDistBackend):
    """``all_to_all_single`` on NCCL, one GPU per rank: GPU fabric figures, judged against the spec."""

    name = "nccl"
    process_group = "nccl"
    gpu_fabric = True
    kernel_patterns = NCCL_KERNELS
    captures_graphs = True  # ProcessGroupNCCL's collectives on the current stream, captured by torch

    @classmethod
    def graph_refusal(cls, job_kind: str, options: Mapping[str, Any], calls: int) -> str:
        """The MoE phases cannot be captured: ``all_to_all_single`` takes its split sizes as host integers
        (ProcessGroupNCCL's alltoall_base: std::vector<int64_t>), so every call reads the exchanged counts on
        the host (``.tolist()``, a device-to-host sync, refused inside a capture). The balanced sweep and
        the kineto calls have their splits fixed at set-up: captured whole."""
        if job_kind == "moe":
            return (
                "the MoE phases read their exchanged counts on the host (all_to_all_single takes host split "
                "sizes), which a CUDA graph cannot capture; use --pattern balanced or kineto, or --backend "
                "nvshmem --backend-option counts=device"
            )
        return ""


class GlooBackend(TorchDistBackend):
    """``all_to_all_single`` on gloo between CPU processes: this host's figures, bandwidth not judged."""

    name = "gloo"
    process_group = "gloo"
