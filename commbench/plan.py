"""RankPlan: one rank's send layout (what goes where, in which order) and receive offsets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from commbench.models import ModelConfig
from commbench.routing import Routing


@dataclass
class RankPlan:
    rank: int
    world_size: int
    send_mode: str  # "token" | "selection" | "balanced"
    num_tokens: int  # local token rows (for balanced: world_size rows, one per destination)
    send_token_index: torch.Tensor  # int64 [S]: local token of each send row, grouped by destination rank
    send_key: torch.Tensor  # int64 [S]: destination rank (token mode) or expert id (selection mode)
    send_counts: torch.Tensor  # int64 [world_size, slots]: rows to each destination, per slot
    combine_weight: torch.Tensor  # float32 [S]: weight applied to the combine row answering each send row
    dispatch_row_bytes: int
    combine_row_bytes: int  # 0 for balanced (no combine phase)
    static_recv_counts: torch.Tensor | None = None  # known without exchanging counts (balanced only)

    # slots = experts_per_rank in selection mode (per-expert counts, as per-expert dispatchers exchange),
    # 1 otherwise. send_splits = send_counts.sum(1).

    @property
    def send_splits(self) -> list[int]:
        return self.send_counts.sum(dim=1).tolist()


def plan_rank(routing: Routing, model: ModelConfig, world_size: int, send_mode: str = "token") -> RankPlan:
    raise NotImplementedError


def plan_balanced(rank: int, world_size: int, size_bytes: int) -> RankPlan:
    raise NotImplementedError


def receive_offsets(counts: np.ndarray) -> np.ndarray:
    """offsets[src, dst]: row where src's segment starts in dst's receive buffer (sources in rank order)."""
    raise NotImplementedError
