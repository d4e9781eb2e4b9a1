"""torch.distributed ``all_to_all_single`` with uneven splits: the same code on NCCL (GPU) and gloo (CPU).

Dispatch packs the token rows of the plan (index_select into a preallocated send buffer) and exchanges them;
combine sends the expert outputs back with the reverse splits and reduces them into token order with
``index_add_`` in float32. Buffers grow on the first (warm-up) call and are reused after, so timed
iterations do not allocate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from commbench.backends.base import Backend, CombineReduction, grown_buffer
from commbench.errors import UsageError
from commbench.traffic.plan import RankPlan


class TorchDistBackend(Backend):
    name = "torchdist"  # replaced by the process group's backend ("nccl" or "gloo") per instance

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """nccl and gloo take no options (UsageError otherwise); the CLI calls it before launching."""
        if options:
            raise UsageError(
                f"backends nccl and gloo take no options, got {', '.join(sorted(options))}; remove them"
            )
        return {}

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        if self.options:
            raise UsageError(
                f"backend {comm.backend} takes no options, got {', '.join(sorted(self.options))}; remove them"
            )
        self.name = comm.backend  # type: ignore[misc] - the column shows which process group ran
        self._plan: RankPlan | None = None
        self._send_splits: list[int] = []
        self._send_buffer: torch.Tensor | None = None
        self._recv_buffer: torch.Tensor | None = None
        self._combine_buffer: torch.Tensor | None = None
        self._reduce = CombineReduction()
        self._static_recv_splits: list[int] | None = None
        self._cached_counts: torch.Tensor | None = None
        self._cached_recv_splits: list[int] = []

    def setup(self, plan: RankPlan) -> None:
        device = self.comm.device
        self._plan = plan
        self._send_splits = plan.send_splits
        self._send_buffer = torch.empty(
            (plan.num_send_rows, plan.dispatch_row_bytes), dtype=torch.uint8, device=device
        )
        static = plan.static_recv_counts
        self._static_recv_splits = None if static is None else static.sum(dim=1).tolist()
        self._cached_counts = None

    def _recv_splits(self, recv_counts: torch.Tensor) -> list[int]:
        """Per-source row counts on the host (a device sync on GPU), reused while the counts are unchanged."""
        if self._static_recv_splits is not None:
            return self._static_recv_splits
        if recv_counts is not self._cached_counts:
            self._cached_recv_splits = recv_counts.sum(dim=1).tolist()
            self._cached_counts = recv_counts
        return self._cached_recv_splits

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
            send = torch.index_select(tokens, 0, plan.send_token_index, out=self._send_buffer)
        dist.all_to_all_single(
            received,
            send,
            output_split_sizes=recv_splits,
            input_split_sizes=self._send_splits,
            group=self.comm.group,
        )
        return received

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        hidden = int(expert_out.shape[1])
        device = self.comm.device
        rows = plan.num_send_rows
        self._combine_buffer = grown_buffer(self._combine_buffer, rows, (hidden,), expert_out.dtype, device)
        returned = self._combine_buffer[:rows]
        # Reverse of dispatch: each expert side sends back, per source, the rows it received from it.
        dist.all_to_all_single(
            returned,
            expert_out.contiguous(),
            output_split_sizes=self._send_splits,
            input_split_sizes=self._recv_splits(recv_counts),
            group=self.comm.group,
        )
        return self._reduce(returned, plan.send_token_index, plan.combine_weight, plan.num_tokens)
