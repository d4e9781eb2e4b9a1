"""Pattern: the traffic of one MoE layer (or one balanced all-to-all) as [src][dst] matrices.

Every count starts in ``rank_counts``: what one rank's routed tokens send to every rank (tokens and
selections) and how many selections each expert gets. ``pattern_from_counts`` turns every rank's counts into
a ``Pattern``; ``build_pattern`` (``commbench pattern``) routes every rank in this process for it, and a run
builds its Pattern from the same counts of the routings it executes, so the pattern printed is the pattern
run. A rank's plan (``traffic.plan``) takes its send counts from the same ``RankCounts``.

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
    node mode (``traffic.nodes``): nodes, ranks_per_node, scaleout_rows (stage-1 rows: tokens x other
    nodes they reach), rank_scaleout_rows (what token mode sends between nodes: tokens x other-node ranks)
Balanced patterns carry size_bytes (used), requested_size_bytes and bytes_per_peer instead.

In node mode ``dispatch_bytes`` / ``combine_bytes`` are both stages' bytes added up (every hop a byte makes,
counted where it makes it) and ``stages`` holds each stage's matrix; ``dispatch_tokens`` stays what each
source's tokens reach (once per destination rank), whoever hands them over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.plain import plain
from commbench.traffic.nodes import STAGE_ORDER, Nodes, node_stage_rows, node_token_counts
from commbench.traffic.routing import Routing, RoutingConfig, expert_popularity, experts_per_rank, route_rank

SEND_MODES = ("token", "selection", "node")


@dataclass
class Pattern:
    """The traffic of one MoE layer (or one balanced all-to-all): [src][dst] matrices, expert load, stats."""

    name: str  # model name or "balanced"
    world_size: int
    # "token" (a row per (token, destination rank)), "selection" (a row per (token, expert)), "node" (a
    # row per (token, other node) over scale-out, then per (token, destination rank) in the node), "balanced"
    send_mode: str
    dispatch_tokens: np.ndarray  # int64 [n, n] tokens src->dst, counted once per destination rank
    dispatch_selections: np.ndarray  # int64 [n, n] (token, expert) selections src->dst
    dispatch_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in dispatch (per send_mode)
    combine_bytes: np.ndarray  # int64 [n, n] bytes src sends dst in combine (expert side -> token owner)
    expert_load: np.ndarray  # int64 [num_experts] selections per expert, global
    stats: dict = field(default_factory=dict)  # imbalance statistics (see the module docstring)
    routing_cfg: RoutingConfig | None = None  # None for balanced patterns
    skew_text: str = ""
    # Node mode: {phase: {stage: int64 [n, n] bytes}}, stages in the order they run (traffic.nodes); else {}.
    stages: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    nodes: Nodes | None = None  # node mode: the nodes the stages are built on

    @property
    def dispatch_rows(self) -> np.ndarray:
        """int64 [n, n]: rows src sends dst in dispatch (selections in selection mode, both stages' rows in
        node mode, else tokens)."""
        if self.send_mode == "node":
            return self.dispatch_bytes // max(1, int(self.stats["dispatch_bytes_per_row"]))
        return self.dispatch_selections if self.send_mode == "selection" else self.dispatch_tokens


def destination_hits(topk_ids: np.ndarray, owner: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64 [tokens, num_ranks]: kept selections of each token on each rank, ``owner[e]`` being the rank
    of expert ``e`` (any placement); dropped ids (-1) count nowhere. Token t reaches rank r if hits[t, r]."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    tokens = ids.shape[0]
    kept = ids >= 0
    destination = np.asarray(owner, dtype=np.int64)[np.where(kept, ids, 0)]
    key = (np.arange(tokens, dtype=np.int64)[:, None] * num_ranks + destination)[kept]
    return np.bincount(key, minlength=tokens * num_ranks).reshape(tokens, num_ranks)


@dataclass(frozen=True)
class RankCounts:
    """What one rank's routed tokens send under contiguous expert (or replica slot) placement (int64)."""

    tokens: np.ndarray  # [world]: tokens to each rank, once per rank holding at least one of its experts
    selections: np.ndarray  # [world]: kept (token, expert) selections to each rank
    expert_load: np.ndarray  # [num_experts]: kept selections per expert (rank r's experts are contiguous)
    slot_load: np.ndarray | None = None  # [slots]: kept selections per replica slot (--replicas), else None
    node_tokens: np.ndarray | None = None  # [nodes]: tokens to each node (counted with nodes), else None

    def send_counts(self, send_mode: str) -> np.ndarray:
        """Rows to each destination per slot, [world, slots], as a plan lays them out: token mode one slot
        (tokens), selection mode one slot per local expert (the expert load, destination by destination).
        Node mode's two stages are laid out from token mode's rows (``traffic.node_plan``)."""
        check_send_mode(send_mode)
        if send_mode == "node":
            raise ValueError("node mode has one layout per stage (traffic.node_plan), not one send_counts")
        if send_mode == "token":
            return self.tokens.reshape(-1, 1)
        per_slot = self.expert_load if self.slot_load is None else self.slot_load
        return per_slot.reshape(self.tokens.size, -1)


def rank_counts(
    routing: Routing, num_experts: int, world_size: int, nodes: Nodes | None = None
) -> RankCounts:
    """``routing``'s rows to every rank and selections per expert (contiguous placement of the experts, or
    of the replica slots with --replicas: ``Routing.destination_slots``); with ``nodes``, also its tokens
    to every node (node mode)."""
    slots, num_slots = routing.destination_slots(num_experts)
    owner = np.arange(num_slots, dtype=np.int64) // experts_per_rank(num_slots, world_size)
    ids = routing.topk_ids.cpu().numpy()
    slot_ids = slots.cpu().numpy()
    hits = destination_hits(slot_ids, owner, world_size)
    slot_load = None
    if routing.slot_ids is not None:
        slot_load = np.bincount(slot_ids[slot_ids >= 0], minlength=num_slots).astype(np.int64)
    return RankCounts(
        tokens=(hits > 0).sum(axis=0, dtype=np.int64),
        selections=hits.sum(axis=0, dtype=np.int64),
        expert_load=np.bincount(ids[ids >= 0], minlength=num_experts).astype(np.int64),
        slot_load=slot_load,
        node_tokens=None if nodes is None else node_token_counts(hits, nodes.node_of_rank, nodes.num_nodes),
    )


def check_send_mode(send_mode: str) -> None:
    """UsageError unless ``send_mode`` is one of SEND_MODES."""
    if send_mode not in SEND_MODES:
        raise UsageError(f"send mode {send_mode!r} not known; use {', '.join(SEND_MODES[:-1])} or node")


def check_nodes(send_mode: str, nodes: Nodes | None, world_size: int) -> None:
    """UsageError unless node mode has nodes for ``world_size`` ranks (and other modes none)."""
    if send_mode != "node":
        return
    if nodes is None:
        raise UsageError(
            "--send-mode node needs the ranks' nodes (NVLink domains): give --ranks-per-domain N (ranks per "
            "node)"
        )
    if nodes.world_size != world_size:
        raise UsageError(f"the nodes cover {nodes.world_size} ranks but the pattern has {world_size}")


def build_pattern(cfg: RoutingConfig, send_mode: str = "token", nodes: Nodes | None = None) -> Pattern:
    """Route every rank of ``cfg`` (one rank at a time) and assemble the traffic matrices (node mode:
    on ``nodes``)."""
    check_send_mode(send_mode)
    check_nodes(send_mode, nodes, cfg.world_size)
    node_counts = nodes if send_mode == "node" else None
    counts = [
        rank_counts(route_rank(cfg, rank), cfg.model.num_experts, cfg.world_size, node_counts)
        for rank in range(cfg.world_size)
    ]
    return pattern_from_counts(cfg, send_mode, counts, node_counts)


def pattern_from_counts(
    cfg: RoutingConfig, send_mode: str, counts: Sequence[RankCounts], nodes: Nodes | None = None
) -> Pattern:
    """The Pattern of every rank's counts (``counts[src]``): byte matrices per send mode, combine as the
    transpose, statistics. Node mode (``nodes``, counts with ``node_tokens``): each stage's matrices too."""
    check_send_mode(send_mode)
    check_nodes(send_mode, nodes, cfg.world_size)
    if len(counts) != cfg.world_size:
        raise ValueError(f"got counts of {len(counts)} ranks for world size {cfg.world_size}")
    model = cfg.model
    tokens = np.stack([c.tokens for c in counts]).astype(np.int64)
    selections = np.stack([c.selections for c in counts]).astype(np.int64)
    expert_load = np.sum([c.expert_load for c in counts], axis=0, dtype=np.int64)
    stats = imbalance_stats(cfg, tokens, selections, expert_load)
    stages: dict[str, dict[str, np.ndarray]] = {}
    if send_mode == "node":
        assert nodes is not None
        stages, node_stats = _node_stages(model, tokens, counts, nodes)
        stats.update(node_stats)
        dispatch = sum(stages["dispatch"].values())
        combine = sum(stages["combine"].values())
    else:
        rows = tokens if send_mode == "token" else selections
        dispatch = rows * model.dispatch_bytes_per_token
        # The expert side answers every row it received, back to the row's owner.
        combine = np.ascontiguousarray(rows.T) * model.combine_bytes_per_token
    return Pattern(
        name=model.name,
        world_size=cfg.world_size,
        send_mode=send_mode,
        dispatch_tokens=tokens,
        dispatch_selections=selections,
        dispatch_bytes=np.asarray(dispatch, dtype=np.int64),
        combine_bytes=np.asarray(combine, dtype=np.int64),
        expert_load=expert_load,
        stats=stats,
        routing_cfg=cfg,
        skew_text=cfg.skew.text,
        stages=stages,
        nodes=nodes if send_mode == "node" else None,
    )


def _node_stages(
    model: ModelConfig, tokens: np.ndarray, counts: Sequence[RankCounts], nodes: Nodes
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """Each node-mode stage's byte matrix per phase (combine: the transposes) and the node statistics."""
    if any(c.node_tokens is None for c in counts):
        raise ValueError("node mode needs counts with node_tokens (rank_counts(..., nodes))")
    node_tokens = np.stack([c.node_tokens for c in counts]).astype(np.int64)  # type: ignore[misc]
    rows = dict(zip(("scaleout", "nvlink"), node_stage_rows(tokens, node_tokens, nodes), strict=True))
    dispatch, combine = int(model.dispatch_bytes_per_token), int(model.combine_bytes_per_token)
    stages = {
        "dispatch": {stage: rows[stage] * dispatch for stage in STAGE_ORDER["dispatch"]},
        "combine": {stage: np.ascontiguousarray(rows[stage].T) * combine for stage in STAGE_ORDER["combine"]},
    }
    other_node = nodes.node_of_rank[:, None] != nodes.node_of_rank[None, :]
    stats = {
        "nodes": nodes.num_nodes,
        "ranks_per_node": sorted({int(s) for s in nodes.sizes}),
        "scaleout_rows": int(rows["scaleout"].sum()),
        "rank_scaleout_rows": int(tokens[other_node].sum()),
    }
    return stages, stats


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
        **(
            {
                "node_of_rank": pattern.nodes.node_of_rank.tolist(),
                "stages": {
                    phase: {stage: matrix.tolist() for stage, matrix in stages.items()}
                    for phase, stages in pattern.stages.items()
                },
            }
            if pattern.nodes is not None
            else {}
        ),
        "expert_load": pattern.expert_load.tolist(),
        "stats": plain(pattern.stats),
    }
