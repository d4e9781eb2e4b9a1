"""RankPlan: one rank's send layout (what goes where, in which order) and receive offsets.

Layout conventions (binding, see docs/architecture.md):

- ``token`` mode: one send row per (token, destination rank holding at least one of the token's kept experts);
  rows are grouped by destination rank, tokens ascending inside a group. ``send_key`` is the destination rank
  and ``combine_weight`` the sum of the token's weights on that rank's experts.
- ``selection`` mode: one send row per kept (token, expert) selection, grouped by destination rank and ordered
  by (expert, token) inside. ``send_key`` is the expert id (its replica slot with --replicas,
  ``traffic.replicas``) and ``combine_weight`` the selection's weight.
  ``send_counts`` is per local expert ([world, experts_per_rank]), as per-expert dispatchers exchange it.
- ``balanced`` (nccl-tests alltoall): ``world_size`` rows of ``size // world_size`` bytes, row i to rank i.
- ``plan_balanced_moe`` (the imbalance-cost reference): a token- or selection-mode plan, laid out exactly as
  above, whose [src][dst] row counts are as even as integers allow (``balanced_pair_rows``), so the same
  dispatch/combine code (packing, counts exchange, weighted reduction) runs on a layout without skew.

A receiver gets each source's rows in the order that source sent them, sources in rank order: the same order
as ``all_to_all_single``'s output, whose segment starts are ``receive_offsets``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.traffic.pattern import check_send_mode, rank_counts
from commbench.traffic.routing import Routing, experts_per_rank


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

    @property
    def num_send_rows(self) -> int:
        return int(self.send_token_index.numel())

    def segment(self, dst: int) -> slice:
        """Slice of the send rows that go to rank ``dst``."""
        splits = self.send_counts.sum(dim=1)
        start = int(splits[:dst].sum())
        return slice(start, start + int(splits[dst]))

    def to(self, device: torch.device | str) -> RankPlan:
        """Copy with every tensor on ``device`` (counts included: backends exchange them on the device)."""
        static = self.static_recv_counts
        return replace(
            self,
            send_token_index=self.send_token_index.to(device),
            send_key=self.send_key.to(device),
            send_counts=self.send_counts.to(device),
            combine_weight=self.combine_weight.to(device),
            static_recv_counts=None if static is None else static.to(device),
        )


def plan_rank(routing: Routing, model: ModelConfig, world_size: int, send_mode: str = "token") -> RankPlan:
    """Send layout of one rank's routed tokens (see the module docstring for the order of rows)."""
    check_send_mode(send_mode)
    slots, num_slots = routing.destination_slots(model.num_experts)  # replica slots with --replicas
    per_rank = experts_per_rank(num_slots, world_size)
    topk_ids = routing.topk_ids.to(device="cpu", dtype=torch.int64)
    topk_weights = routing.topk_weights.to(device="cpu", dtype=torch.float32)
    num_tokens, topk = topk_ids.shape
    kept = topk_ids >= 0
    token_of_selection = (
        torch.arange(num_tokens, dtype=torch.int64).unsqueeze(1).expand(num_tokens, topk)[kept]
    )
    expert_of_selection = slots.to(device="cpu", dtype=torch.int64)[kept]  # the expert's slot
    weight_of_selection = topk_weights[kept]

    if send_mode == "token":
        # One row per distinct (destination, token): sorting by dest * T + token groups rows by destination
        # with tokens ascending; the inverse map sums the weights of a token's experts on one destination.
        pair = (expert_of_selection // per_rank) * num_tokens + token_of_selection
        rows, row_of_selection = torch.unique(pair, sorted=True, return_inverse=True)
        send_token_index = rows % num_tokens
        send_key = rows // num_tokens
        combine_weight = torch.zeros(rows.numel(), dtype=torch.float32)
        combine_weight.index_add_(0, row_of_selection, weight_of_selection)
    else:
        # Expert ids are contiguous per rank, so (expert, token) order is also grouped by destination.
        order = torch.argsort(expert_of_selection * num_tokens + token_of_selection)
        send_token_index = token_of_selection[order]
        send_key = expert_of_selection[order]
        combine_weight = weight_of_selection[order]
    # The rows per destination (and local expert) are the Pattern's counts of this routing.
    send_counts = torch.from_numpy(rank_counts(routing, model.num_experts, world_size).send_counts(send_mode))

    return RankPlan(
        rank=routing.rank,
        world_size=world_size,
        send_mode=send_mode,
        num_tokens=num_tokens,
        send_token_index=send_token_index.contiguous(),
        send_key=send_key.contiguous(),
        send_counts=send_counts.contiguous(),
        combine_weight=combine_weight.contiguous(),
        dispatch_row_bytes=int(model.dispatch_bytes_per_token),
        combine_row_bytes=int(model.combine_bytes_per_token),
    )


def balanced_row_bytes(world_size: int, size_bytes: int) -> int:
    """Bytes to each destination in a balanced all-to-all of ``size_bytes`` per rank (nccl-tests rounding)."""
    if size_bytes < world_size:
        raise UsageError(
            f"all-to-all size {size_bytes} B is smaller than the world size {world_size}; "
            f"use sizes of at least {world_size} bytes"
        )
    return size_bytes // world_size


def plan_balanced(rank: int, world_size: int, size_bytes: int) -> RankPlan:
    """nccl-tests alltoall: ``world_size`` rows of ``size_bytes // world_size`` bytes, row i to rank i."""
    row_bytes = balanced_row_bytes(world_size, size_bytes)
    ones = torch.ones(world_size, 1, dtype=torch.int64)
    return RankPlan(
        rank=rank,
        world_size=world_size,
        send_mode="balanced",
        num_tokens=world_size,
        send_token_index=torch.arange(world_size, dtype=torch.int64),
        send_key=torch.arange(world_size, dtype=torch.int64),
        send_counts=ones,
        combine_weight=torch.zeros(world_size, dtype=torch.float32),
        dispatch_row_bytes=row_bytes,
        combine_row_bytes=0,
        static_recv_counts=ones.clone(),
    )


def balanced_pair_rows(world_size: int, total_rows: int) -> np.ndarray:
    """rows[src, dst] summing to ``total_rows``: every pair (self included) ``total_rows // world^2``, or
    one more.

    The remainder goes to pairs in diagonal order, (src, (src + shift) % world) for shift = 0, 1, ... and src
    ascending inside a shift, so every rank's send and receive totals also differ by at most one row.
    """
    if world_size < 1 or total_rows < 0:
        raise ValueError(f"need world_size >= 1 and total_rows >= 0, got {world_size} and {total_rows}")
    pairs = world_size * world_size
    extra = np.zeros(pairs, dtype=np.int64)
    extra[: total_rows % pairs] = 1  # flat index shift * world + src
    src = np.tile(np.arange(world_size), world_size)
    dst = (src + np.repeat(np.arange(world_size), world_size)) % world_size
    rows = np.full((world_size, world_size), total_rows // pairs, dtype=np.int64)
    rows[src, dst] += extra
    return rows


def plan_balanced_moe(
    rank: int,
    world_size: int,
    total_rows: int,
    num_tokens: int,
    dispatch_row_bytes: int,
    combine_row_bytes: int,
    send_mode: str = "token",
    experts_per_rank: int = 1,
) -> RankPlan:
    """An MoE-shaped plan of ``rank`` with no skew: ``balanced_pair_rows(world_size, total_rows)[rank]`` rows
    to each destination, out of ``num_tokens`` local tokens (the skewed job's, so packing gathers and combine
    reduces the same amounts).

    Selection mode splits each destination's rows over its ``experts_per_rank`` local experts as evenly as
    integers allow (the extra rows start at expert ``rank % experts_per_rank``, so no expert collects every
    source's remainder); token mode has one slot per destination. Send rows, numbered k over the slots in
    expert order, carry token ``k % num_tokens``: every token gets the same number of rows (+-1) and a
    (token, destination) or (token, expert) pair never repeats. A token's rows weigh 1 / its row count
    (weights sum to 1 as normalised top-k gates do), so the combine reference is well defined.
    """
    check_send_mode(send_mode)
    per_rank = experts_per_rank if send_mode == "selection" else 1
    rows_to = torch.from_numpy(balanced_pair_rows(world_size, total_rows)[rank])
    extra_from = (torch.arange(per_rank, dtype=torch.int64) - rank) % per_rank  # rotated slot order
    slot_rows = (rows_to // per_rank).unsqueeze(1) + (extra_from < (rows_to % per_rank).unsqueeze(1))
    if num_tokens < 1 or int(slot_rows.max()) > num_tokens:
        raise ValueError(
            f"{total_rows} rows over {world_size}^2 pairs need at least {int(slot_rows.max())} tokens per "
            f"rank with {per_rank} experts per rank, got {num_tokens}"
        )
    num_rows = int(rows_to.sum())
    expert = torch.repeat_interleave(
        torch.arange(world_size * per_rank, dtype=torch.int64), slot_rows.reshape(-1), output_size=num_rows
    )
    token = torch.arange(num_rows, dtype=torch.int64) % num_tokens  # a slot's <= num_tokens rows: distinct
    # Layout order: by destination, then (expert, token) in selection mode / token in token mode.
    order = torch.argsort(expert * num_tokens + token)
    token, expert = token[order], expert[order]
    rows_of_token = torch.bincount(token, minlength=num_tokens)
    combine_weight = 1.0 / rows_of_token[token].to(torch.float32)
    return RankPlan(
        rank=rank,
        world_size=world_size,
        send_mode=send_mode,
        num_tokens=num_tokens,
        send_token_index=token.contiguous(),
        send_key=(expert if send_mode == "selection" else expert // per_rank).contiguous(),
        send_counts=slot_rows.to(torch.int64).contiguous(),
        combine_weight=combine_weight.contiguous(),
        dispatch_row_bytes=int(dispatch_row_bytes),
        combine_row_bytes=int(combine_row_bytes),
    )


def receive_offsets(counts: np.ndarray) -> np.ndarray:
    """offsets[src, dst]: row where src's segment starts in dst's receive buffer (sources in rank order)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be a square [src, dst] matrix, got shape {counts.shape}")
    offsets = np.zeros_like(counts)
    np.cumsum(counts[:-1], axis=0, out=offsets[1:])
    return offsets


def row_matrix(plans: list[RankPlan]) -> np.ndarray:
    """rows[src, dst] sent in dispatch, from every rank's plan (plans[src])."""
    return np.stack([plan.send_counts.sum(dim=1).cpu().numpy() for plan in plans]).astype(np.int64)
