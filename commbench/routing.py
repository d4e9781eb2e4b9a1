"""Top-k routing of one rank's tokens, deterministic from a seed and vectorized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commbench.models import ModelConfig
from commbench.skew import SkewSpec


@dataclass(frozen=True)
class RoutingConfig:
    """Everything that decides routing. Expert popularity is global (same hot experts for every rank)."""

    model: ModelConfig
    skew: SkewSpec
    world_size: int
    tokens_per_rank: int
    seed: int = 0
    mask_ratio: float = 0.0  # fraction of selections dropped (-1), as DeepEP's masked ratio
    capacity_factor: float | None = None  # per (source rank, expert) capacity; None = no dropping


@dataclass
class Routing:
    rank: int
    topk_ids: torch.Tensor  # int64 [tokens, topk]; -1 = dropped; the k ids of a token are distinct
    topk_weights: torch.Tensor  # float32 [tokens, topk]; 0 where dropped


def expert_rank(expert_ids: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """Rank holding each expert (contiguous placement); -1 stays -1."""
    raise NotImplementedError


def route_rank(cfg: RoutingConfig, rank: int) -> Routing:
    """Routing of ``rank``'s tokens without materializing any other rank's."""
    raise NotImplementedError
