"""The NVSHMEM backend's reference variant (``variant=vdev2d``): torch's ``all_to_all_vdev_2d`` exchange.

Dispatch runs ``torch.ops.symm_mem.all_to_all_vdev_2d`` (expert-major output, ``major_align`` = one row) and
gathers its output back into source order inside the timed dispatch, so verification and the combine see the
same rows as the put variant; combine runs ``all_to_all_vdev_2d_offset``. Both pull with NVSHMEM gets on the
same symmetric memory as the put kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from commbench.backends.shmem import protocol as proto
from commbench.errors import UsageError
from commbench.traffic.plan import RankPlan

# torch's all_to_all_vdev_2d kernels keep per-expert and per-rank prefix sums in fixed tiles (512 threads,
# 32-wide warp scans): dispatch takes <= 16 experts per rank and <= 32 ranks, the combine (_offset) op
# <= 32 experts per rank and <= 16 ranks (TORCH_CHECKs in nvshmem_extension.cu).
VDEV2D_MAX_EXPERTS_PER_RANK = 16
VDEV2D_MAX_RANKS = 16

SymmetricFactory = Callable[..., torch.Tensor]  # (*shape, dtype=...) -> a rendezvoused symmetric tensor


def check_vdev2d(world_size: int, slots: int) -> None:
    """UsageError (one line) unless this torch has the ops and the run fits their fixed tiles."""
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
        raise UsageError(
            "variant=vdev2d needs torch.ops.symm_mem.all_to_all_vdev_2d (torch >= 2.9); use variant=put"
        )
    if slots > VDEV2D_MAX_EXPERTS_PER_RANK or world_size > VDEV2D_MAX_RANKS:
        raise UsageError(
            "variant=vdev2d: torch's all_to_all_vdev_2d kernels take at most "
            f"{VDEV2D_MAX_EXPERTS_PER_RANK} experts per rank and {VDEV2D_MAX_RANKS} ranks, this run has "
            f"{slots} and {world_size}; use more ranks, --send-mode token (one slot per rank) or variant=put"
        )


def vdev2d_buffers(
    capacity: proto.Capacity, slots: int, world_size: int, dispatch_row_bytes: int, combine_row_bytes: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The symmetric tensors of one setup, name -> (shape, dtype): what ``Vdev2dExchange`` allocates and
    the launch's memory estimate counts (``NvshmemBackend.symmetric_allocation_bytes``)."""
    splits = world_size * slots
    disp, comb = dispatch_row_bytes, max(1, combine_row_bytes)
    # Byte tensors: splits and offsets in bytes mean the same whether torch counts dim-0 rows or elements.
    return {
        "send": ((capacity.send_rows * disp,), torch.uint8),
        "out": (((capacity.recv_rows + slots) * disp,), torch.uint8),  # + one row of padding per expert
        "in_splits": ((splits,), torch.int64),
        "out_splits_offsets": ((2, splits), torch.int64),
        "combine_in": ((capacity.recv_rows * comb,), torch.uint8),
        "combine_out": ((capacity.send_rows * comb,), torch.uint8),
        "combine_in_splits_offsets": ((2, splits), torch.int64),
        "combine_out_splits_offsets": ((2, splits), torch.int64),
    }


def vdev2d_result_bytes(capacity: proto.Capacity, dispatch_row_bytes: int) -> int:
    """The one ordinary device buffer beside them: dispatch's rows gathered back into source order."""
    return capacity.recv_rows * dispatch_row_bytes


class Vdev2dExchange:
    """The symmetric buffers of one setup and the two torch ops over them."""

    def __init__(
        self,
        symmetric: SymmetricFactory,
        plan: RankPlan,
        capacity: proto.Capacity,
        world_size: int,
        device: torch.device,
        group_name: str,
    ) -> None:
        slots = int(plan.send_counts.shape[1])
        check_vdev2d(world_size, slots)
        self.device = device
        self.group_name = group_name
        self._order: tuple[torch.Tensor, torch.Tensor] | None = None
        shapes = vdev2d_buffers(capacity, slots, world_size, plan.dispatch_row_bytes, plan.combine_row_bytes)
        buffers = {name: symmetric(*shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        self.send = buffers["send"]
        self.out = buffers["out"]
        self.in_splits = buffers["in_splits"]
        self.out_splits_offsets = buffers["out_splits_offsets"]
        self.combine_in = buffers["combine_in"]
        self.combine_out = buffers["combine_out"]
        self.combine_in_splits_offsets = buffers["combine_in_splits_offsets"]
        self.combine_out_splits_offsets = buffers["combine_out_splits_offsets"]
        disp = plan.dispatch_row_bytes
        self.result = torch.empty((capacity.recv_rows, disp), dtype=torch.uint8, device=device)

    def receive_buffers(self) -> list[torch.Tensor]:
        """What verification poisons before an iteration: every output this variant writes."""
        return [self.out, self.result, self.combine_out]

    def forget_order(self) -> None:
        """The count matrix changed: the expert-major to source-order permutation is rebuilt on next use."""
        self._order = None

    def _source_order(self, received_counts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Per received row (source order): its (expert, source) block id and index in the block (cached)."""
        if self._order is None:
            block, within = proto.expert_major_blocks(received_counts)
            self._order = (torch.from_numpy(block).to(self.device), torch.from_numpy(within).to(self.device))
        return self._order

    def dispatch(
        self, tokens: torch.Tensor, plan: RankPlan, layout: proto.PhaseLayout, received_counts: np.ndarray
    ) -> torch.Tensor:
        """``received_counts``: [src, expert] rows this rank receives (the exchanged matrix's column)."""
        rows_out = self.send[: layout.send_rows * plan.dispatch_row_bytes].view(layout.send_rows, -1)
        if plan.send_mode == "balanced":
            rows_out.copy_(tokens)
        else:
            torch.index_select(tokens, 0, plan.send_token_index, out=rows_out)
        self.in_splits.copy_(plan.send_counts.reshape(-1) * plan.dispatch_row_bytes)
        torch.ops.symm_mem.all_to_all_vdev_2d(
            self.send,
            self.out,
            self.in_splits,
            self.out_splits_offsets,
            self.group_name,
            major_align=plan.dispatch_row_bytes,
        )
        block, within = self._source_order(received_counts)
        start_rows = self.out_splits_offsets[1] // plan.dispatch_row_bytes
        position = start_rows[block] + within
        expert_major = self.out.view(-1, plan.dispatch_row_bytes)
        return torch.index_select(expert_major, 0, position, out=self.result[: layout.recv_rows])

    def combine(
        self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor, layout: proto.PhaseLayout
    ) -> torch.Tensor:
        row_bytes = plan.combine_row_bytes
        rows = int(expert_out.shape[0])
        staged = self.combine_in[: rows * row_bytes].view(rows, row_bytes)
        staged.copy_(expert_out.contiguous().view(torch.uint8))
        counts = recv_counts.to(torch.int64)  # [src, expert], source-major blocks in expert_out
        starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
        # Input blocks listed expert-major (e, src), pointing into the source-order rows.
        self.combine_in_splits_offsets[0].copy_(counts.t().reshape(-1) * row_bytes)
        self.combine_in_splits_offsets[1].copy_(starts.view(counts.shape).t().reshape(-1) * row_bytes)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(
            self.combine_in,
            self.combine_out,
            self.combine_in_splits_offsets,
            self.combine_out_splits_offsets,
            self.group_name,
        )
        returned = self.combine_out[: layout.recv_rows * row_bytes].view(layout.recv_rows, row_bytes)
        return returned.view(expert_out.dtype)
