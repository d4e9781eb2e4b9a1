"""A third-party dispatcher package as a test installs it: ``FakeBackend`` registered under the entry point
group ``commbench.backends`` (name ``fakeep``), moving rows with torch.distributed's all_to_all_single (gloo
on CPU: a real path), with one knob of its own. ``NOT_A_BACKEND`` is registered too, to be refused."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commbench.backends.options import BackendOption, DeclaredOptions
from commbench.run.interface import Backend
from commbench.traffic.payload import poison_
from commbench.traffic.plan import RankPlan

VERSION = "0.1"


class FakeBackend(DeclaredOptions, Backend):
    name = "fakeep"
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption("fake_sms", int, 8, "SMs the fake dispatcher would use", minimum=1, maximum=256),
    )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.settings = self.check_options(self.options)
        self.received: torch.Tensor | None = None
        self.returned: torch.Tensor | None = None

    def knobs(self) -> dict[str, Any]:
        return {"fake_sms": self.settings["fake_sms"], "fake_dispatcher_version": VERSION}

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.comm.group)
        return recv_counts

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        splits = recv_counts.sum(dim=1).tolist()
        if self.received is None or self.received.shape != (sum(splits), plan.dispatch_row_bytes):
            self.received = torch.empty((sum(splits), plan.dispatch_row_bytes), dtype=torch.uint8)
        send = tokens.index_select(0, plan.send_token_index)
        dist.all_to_all_single(self.received, send, splits, plan.send_splits, group=self.comm.group)
        return self.received

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        if self.returned is None or self.returned.shape != (plan.num_send_rows, expert_out.shape[1]):
            self.returned = torch.empty((plan.num_send_rows, expert_out.shape[1]), dtype=expert_out.dtype)
        splits = recv_counts.sum(dim=1).tolist()
        dist.all_to_all_single(
            self.returned, expert_out.contiguous(), plan.send_splits, splits, group=self.comm.group
        )
        out = torch.zeros((plan.num_tokens, expert_out.shape[1]), dtype=torch.float32)
        out.index_add_(
            0, plan.send_token_index, self.returned.to(torch.float32) * plan.combine_weight.unsqueeze(1)
        )
        return out

    def poison_receive_buffers(self) -> None:
        for buffer in (self.received, self.returned):
            if buffer is not None:
                poison_(buffer)


def NOT_A_BACKEND() -> None:  # noqa: N802 - registered as if it were a class
    """Not a class at all."""
