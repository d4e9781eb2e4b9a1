"""Pattern: the traffic of one MoE layer (or one balanced all-to-all) as [src][dst] matrices.

``build_pattern`` routes every rank in this process. A distributed run can instead route its own rank,
take ``rank_traffic`` (its matrix rows) and ``rank_expert_load``, all-gather them and call
``pattern_from_traffic``: the result is identical.

``Pattern.stats`` keys (all plain Python numbers, lists or None):
    tokens_per_rank, topk, mask_ratio, capacity (per source rank and expert, or None)
    selections_routed, selections_kept, dropped_fraction   (dropped = masked or over capacity)
    expert_load_max, expert_load_mean, expert_maxvio ((max - mean) / mean), expert_cv (std / mean)
    rank_recv_selections_max/_mean, rank_recv_tokens_max/_mean, rank_maxvio (received selections)
    hot_experts (hot:N:F and rank-imbalance: the hot set; zipf and trace: the top-k most loaded)
    hot_share (measured share of kept selections on hot_experts), hot_share_target (hot, rank-imbalance)
    hot_rank, hot_rank_ratio (its received selections / mean of the others), hot_rank_ratio_target
    log_weight_offset (calibrated log(w_hot / w_cold) for hot and rank-imbalance)
    dispatch_bytes_per_row, combine_bytes_per_row
Balanced patterns carry size_bytes (used), requested_size_bytes and bytes_per_peer instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.traffic.routing import Routing, RoutingConfig, expert_popularity, expert_rank, route_rank

SEND_MODES = ("token", "selection")


@dataclass
class Pattern:
    name: str  # model name or "balanced"
    world_size: int
    send_mode: (
        str  # "token" (de-duplicated per destination rank) or "selection" (one row per (token, expert))
    )
    dispatch_tokens: np.ndarray  # int64 [n, n] tokens src->dst, counted once per destination rank
    dispatch_selections: np.ndarray  # int64 [n, n] (token, expert) selections src->dst
    dispatch_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in dispatch (per send_mode)
    combine_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in combine (expert side -> token owner)
    expert_load: np.ndarray  # int64 [num_experts] selections per expert, global
    stats: dict = field(default_factory=dict)  # imbalance statistics (see the module docstring)
    routing_cfg: RoutingConfig | None = None  # None for balanced patterns
    skew_text: str = ""


def rank_traffic(routing: Routing, model: ModelConfig, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_row, selections_row), int64 [world_size] each: what ``routing.rank`` sends every rank.

    A token counts once per destination rank holding at least one of its kept experts."""
    destination = expert_rank(routing.topk_ids, model.num_experts, world_size)
    kept = destination >= 0
    selections = torch.bincount(destination[kept], minlength=world_size)
    ordered = destination.sort(dim=1).values
    first = torch.ones_like(kept)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    tokens = torch.bincount(ordered[first & (ordered >= 0)], minlength=world_size)
    return tokens.numpy().astype(np.int64), selections.numpy().astype(np.int64)


def rank_expert_load(routing: Routing, num_experts: int) -> np.ndarray:
    """Kept selections per expert from one rank's tokens, int64 [num_experts]."""
    ids = routing.topk_ids[routing.topk_ids >= 0]
    return torch.bincount(ids, minlength=num_experts).numpy().astype(np.int64)


def _check_send_mode(send_mode: str) -> None:
    if send_mode not in SEND_MODES:
        raise UsageError(f"send mode {send_mode!r} not known; use {' or '.join(SEND_MODES)}")


def build_pattern(cfg: RoutingConfig, send_mode: str = "token") -> Pattern:
    """Route every rank of ``cfg`` (one rank at a time) and assemble the traffic matrices."""
    _check_send_mode(send_mode)
    n = cfg.world_size
    tokens = np.zeros((n, n), dtype=np.int64)
    selections = np.zeros((n, n), dtype=np.int64)
    expert_load = np.zeros(cfg.model.num_experts, dtype=np.int64)
    for rank in range(n):
        routing = route_rank(cfg, rank)
        tokens[rank], selections[rank] = rank_traffic(routing, cfg.model, n)
        expert_load += rank_expert_load(routing, cfg.model.num_experts)
    return pattern_from_traffic(cfg, send_mode, tokens, selections, expert_load)


def pattern_from_traffic(
    cfg: RoutingConfig,
    send_mode: str,
    dispatch_tokens: np.ndarray,
    dispatch_selections: np.ndarray,
    expert_load: np.ndarray,
) -> Pattern:
    """Pattern from gathered rows: byte matrices per send mode, combine as the transpose, statistics."""
    _check_send_mode(send_mode)
    model = cfg.model
    dispatch_tokens = np.asarray(dispatch_tokens, dtype=np.int64)
    dispatch_selections = np.asarray(dispatch_selections, dtype=np.int64)
    rows = dispatch_tokens if send_mode == "token" else dispatch_selections
    return Pattern(
        name=model.name,
        world_size=cfg.world_size,
        send_mode=send_mode,
        dispatch_tokens=dispatch_tokens,
        dispatch_selections=dispatch_selections,
        dispatch_bytes=rows * model.dispatch_bytes_per_token,
        # The expert side answers every row it received, back to the row's owner.
        combine_bytes=np.ascontiguousarray(rows.T) * model.combine_bytes_per_token,
        expert_load=np.asarray(expert_load, dtype=np.int64),
        stats=imbalance_stats(cfg, dispatch_tokens, dispatch_selections, expert_load),
        routing_cfg=cfg,
        skew_text=cfg.skew.text,
    )


def _max_mean(values: np.ndarray) -> tuple[int, float]:
    return int(values.max()), float(values.mean())


def imbalance_stats(
    cfg: RoutingConfig, dispatch_tokens: np.ndarray, dispatch_selections: np.ndarray, expert_load: np.ndarray
) -> dict[str, Any]:
    model, n = cfg.model, cfg.world_size
    routed = n * cfg.tokens_per_rank * model.topk
    kept = int(expert_load.sum())
    load_max, load_mean = _max_mean(expert_load)
    recv_selections = dispatch_selections.sum(0)
    recv_tokens = dispatch_tokens.sum(0)
    recv_max, recv_mean = _max_mean(recv_selections)
    stats: dict[str, Any] = {
        "tokens_per_rank": cfg.tokens_per_rank,
        "topk": model.topk,
        "mask_ratio": cfg.mask_ratio,
        "capacity": cfg.capacity,
        "selections_routed": routed,
        "selections_kept": kept,
        "dropped_fraction": (routed - kept) / routed,
        "expert_load_max": load_max,
        "expert_load_mean": load_mean,
        "expert_maxvio": (load_max - load_mean) / load_mean if load_mean else 0.0,
        "expert_cv": float(expert_load.std() / load_mean) if load_mean else 0.0,
        "rank_recv_selections_max": recv_max,
        "rank_recv_selections_mean": recv_mean,
        "rank_recv_tokens_max": int(recv_tokens.max()),
        "rank_recv_tokens_mean": float(recv_tokens.mean()),
        "rank_maxvio": (recv_max - recv_mean) / recv_mean if recv_mean else 0.0,
        "dispatch_bytes_per_row": model.dispatch_bytes_per_token,
        "combine_bytes_per_row": model.combine_bytes_per_token,
    }
    popularity = expert_popularity(cfg)
    hot = list(popularity.hot_experts)
    if not hot and cfg.skew.kind == "trace":
        hot = sorted(int(e) for e in np.argsort(-expert_load, kind="stable")[: model.topk])
    if hot:
        stats["hot_experts"] = hot
        stats["hot_share"] = float(expert_load[hot].sum() / kept) if kept else 0.0
    if popularity.target_hot_share is not None:
        stats["hot_share_target"] = popularity.target_hot_share
        stats["log_weight_offset"] = popularity.log_weight_offset
    if popularity.hot_rank is not None:
        others = np.delete(recv_selections, popularity.hot_rank)
        stats["hot_rank"] = popularity.hot_rank
        stats["hot_rank_ratio"] = (
            float(recv_selections[popularity.hot_rank] / others.mean()) if others.sum() else None
        )
        stats["hot_rank_ratio_target"] = cfg.skew.imbalance_ratio
    return stats


def balanced_pattern(world_size: int, size_bytes: int) -> Pattern:
    """nccl-tests alltoall semantics: every rank sends size_bytes in total, size_bytes / n to each rank.

    The size is rounded down to a multiple of world_size (stats["size_bytes"] is the size used)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world size must be a positive integer, got {world_size!r}")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, np.integer)) or size_bytes < 0:
        raise UsageError(f"message size must be a whole number of bytes >= 0, got {size_bytes!r}")
    per_peer = int(size_bytes) // world_size
    shape = (world_size, world_size)
    return Pattern(
        name="balanced",
        world_size=world_size,
        send_mode="balanced",
        dispatch_tokens=np.ones(shape, dtype=np.int64),  # one row of per_peer bytes to every peer
        dispatch_selections=np.ones(shape, dtype=np.int64),
        dispatch_bytes=np.full(shape, per_peer, dtype=np.int64),
        combine_bytes=np.zeros(shape, dtype=np.int64),
        expert_load=np.zeros(0, dtype=np.int64),
        stats={
            "size_bytes": per_peer * world_size,
            "requested_size_bytes": int(size_bytes),
            "bytes_per_peer": per_peer,
        },
    )


def _plain(value: Any) -> Any:
    """JSON-ready copy: numpy scalars and arrays become Python numbers and lists."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def pattern_to_json(pattern: Pattern) -> dict[str, Any]:
    """The pattern as a JSON-ready dict: [src][dst] matrices as lists of ints, stats, run parameters."""
    cfg = pattern.routing_cfg
    return {
        "model": pattern.name,
        "world": pattern.world_size,
        "tokens": cfg.tokens_per_rank if cfg else None,
        "skew": pattern.skew_text,
        "seed": cfg.seed if cfg else None,
        "send_mode": pattern.send_mode,
        "mask_ratio": cfg.mask_ratio if cfg else None,
        "capacity_factor": cfg.capacity_factor if cfg else None,
        "dispatch_tokens": pattern.dispatch_tokens.tolist(),
        "dispatch_selections": pattern.dispatch_selections.tolist(),
        "dispatch_bytes": pattern.dispatch_bytes.tolist(),
        "combine_bytes": pattern.combine_bytes.tolist(),
        "expert_load": pattern.expert_load.tolist(),
        "stats": _plain(pattern.stats),
    }
