"""Mock backend, for unit tests of the harness and report code only (no data movement).

``MockBackend`` moves no data: it returns what each rank must receive (built from every rank's plan, see
``Backend.setup_peers``) and a deterministic modelled time, ``latency + bottleneck link bytes / bandwidth``.
Its rows are labelled "mock (no data movement)" and emulated, and are not verified (#wrong n/a). With thread
ranks (``commbench.run.threads``) it exercises world sizes no machine has. It says nothing about real
communication: tests of data movement use gloo processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from commbench.backends.options import MAX_LATENCY_US, MAX_LINK_GBPS, BackendOption, DeclaredOptions
from commbench.run.interface import Backend
from commbench.traffic.payload import expected_rows, expert_outputs
from commbench.traffic.plan import RankPlan, row_matrix


class MockBackend(DeclaredOptions, Backend):
    name = "mock"
    emulated = True
    moves_data = False  # hands back the expected rows: nothing to verify

    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption(
            "link_GBps",
            float,
            100.0,
            "modelled link bandwidth, GB/s",
            minimum=0.0,
            exclusive_minimum=True,
            maximum=MAX_LINK_GBPS,
        ),
        BackendOption(
            "latency_us",
            float,
            10.0,
            "modelled latency per phase, microseconds",
            minimum=0.0,
            maximum=MAX_LATENCY_US,
        ),
    )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.options = self.check_options(self.options)
        self._peers: list[RankPlan] | None = None
        self._rows = np.zeros((0, 0), dtype=np.int64)
        self._recv_counts = torch.zeros(0, 1, dtype=torch.int64)
        self._expected = torch.zeros(0, 0, dtype=torch.uint8)
        self._last_seconds: float | None = None

    @property
    def label(self) -> str:
        return "mock (no data movement)"

    def knobs(self) -> dict[str, Any]:
        return {"mock_link_GBps": self.options["link_GBps"], "mock_latency_us": self.options["latency_us"]}

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:
        self._peers = list(plans)

    def setup(self, plan: RankPlan) -> None:
        if self._peers is None:
            raise RuntimeError("MockBackend.setup needs setup_peers(plans of every rank) first")
        me = self.comm.rank
        device = self.comm.device
        self._rows = row_matrix(self._peers)
        self._recv_counts = torch.stack([peer.send_counts[me].cpu() for peer in self._peers]).to(device)
        self._expected = expected_rows(self._peers, me, device)

    def _model(self, sent_rows: np.ndarray, recv_rows: np.ndarray, row_bytes: int) -> float:
        """Seconds for this rank: latency + max(link bytes sent, received) / bandwidth (self excluded)."""
        me = self.comm.rank
        sent = (int(sent_rows.sum()) - int(sent_rows[me])) * row_bytes
        received = (int(recv_rows.sum()) - int(recv_rows[me])) * row_bytes
        return self.options["latency_us"] * 1e-6 + max(sent, received) / (self.options["link_GBps"] * 1e9)

    def modelled_seconds(self) -> float | None:
        return self._last_seconds

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        return self._recv_counts.clone()

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        me = self.comm.rank
        self._last_seconds = self._model(self._rows[me], self._rows[:, me], plan.dispatch_row_bytes)
        return self._expected.clone()

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        me = self.comm.rank
        hidden = int(expert_out.shape[1])
        # Combine sends back what dispatch received: the transpose of the dispatch rows.
        self._last_seconds = self._model(self._rows[:, me], self._rows[me], plan.combine_row_bytes)
        returned = expert_outputs(me, plan.send_token_index, plan.send_key, hidden)
        combined = torch.zeros(plan.num_tokens, hidden, dtype=torch.float32, device=returned.device)
        combined.index_add_(0, plan.send_token_index, returned.float() * plan.combine_weight.unsqueeze(1))
        return combined
