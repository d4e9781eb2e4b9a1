"""Pattern: the traffic of one MoE layer (or one balanced all-to-all) as [src][dst] matrices."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from commbench.routing import RoutingConfig


@dataclass
class Pattern:
    name: str  # model name or "balanced"
    world_size: int
    send_mode: str  # "token" (de-duplicated per destination rank) or "selection" (one row per (token, expert))
    dispatch_tokens: np.ndarray  # int64 [n, n] tokens src->dst, counted once per destination rank
    dispatch_selections: np.ndarray  # int64 [n, n] (token, expert) selections src->dst
    dispatch_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in dispatch (per send_mode)
    combine_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in combine (expert side -> token owner)
    expert_load: np.ndarray  # int64 [num_experts] selections per expert, global
    stats: dict = field(default_factory=dict)  # imbalance statistics (see imbalance_stats)
    routing_cfg: RoutingConfig | None = None  # None for balanced patterns
    skew_text: str = ""


def build_pattern(cfg: RoutingConfig, send_mode: str = "token") -> Pattern:
    raise NotImplementedError


def balanced_pattern(world_size: int, size_bytes: int) -> Pattern:
    """nccl-tests alltoall semantics: every rank sends size_bytes in total, size_bytes / n to each rank."""
    raise NotImplementedError
