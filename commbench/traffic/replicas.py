"""EPLB replicas: redundant expert slots placed from a measured expert load, and each selection's replica.

The algorithm follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``rebalance_experts``), written anew:

1. Replicate: ``num_experts + replicas`` physical slots; every expert has one, and each redundant slot goes,
   one at a time, to the expert with the largest load per replica (``load / replica count``; ties: the lowest
   expert id). Hot experts are replicated first.
2. Pack: the slots, heaviest first (a slot weighs its expert's load / its replica count; ties by slot), each
   go to the least-loaded rank that still has a free slot (``(num_experts + replicas) / world`` slots per
   rank; ties: the lowest rank). Unlike EPLB's packing, a rank that already holds a replica of the same
   expert is skipped while another rank has room, so that a hot expert's replicas sit on different ranks
   (two replicas on one rank would not move any load off it).
3. Lay out: the slots of rank r are the physical ids ``r * slots_per_rank ...``, by expert id inside a rank,
   so that the physical ids are contiguous per rank exactly as the experts are without replicas.

EPLB has two policies: hierarchical (expert groups packed onto nodes first, replicas kept inside a node) and
global (one pool). This is the global one: a routing config knows nothing of nodes (the layout is found when
the ranks start). The load is the one MoE layer commbench models, so EPLB's per-layer and global balance
are the same thing here.

At run time each selection goes to one replica of its expert: replica ``g % count`` of the expert's slots
(ascending), ``g`` being the token's index in the global batch (``rank * tokens_per_rank + token``). vLLM's
EPLB router picks by the selection's flat position modulo the count; the token index is used here instead
because a position inside the top-k list is correlated with the expert (top-8 with 2 replicas would make
the position's parity pick the replica). The split is deterministic and even to within one token per source
rank, and ignores locality (a replica on the source rank is not preferred).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from commbench.errors import UsageError


def check_replicas(num_experts: int, world_size: int, replicas: int) -> int:
    """Slots per rank for ``replicas`` redundant experts; UsageError (one line) unless ``num_experts +
    replicas`` slots split evenly over ``world_size`` ranks and each expert fits on distinct ranks."""
    if isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral) or replicas < 0:
        raise UsageError(f"--replicas must be an integer >= 0, got {replicas!r}")
    slots = num_experts + int(replicas)
    if slots % world_size:
        first = (-num_experts) % world_size or world_size
        hint = ", ".join(str(first + i * world_size) for i in range(3))
        raise UsageError(
            f"--replicas {replicas}: {num_experts} experts + {replicas} replicas = {slots} slots do not "
            f"split evenly over {world_size} ranks; use one of {hint}, ..."
        )
    most = num_experts * (world_size - 1)  # every expert on every rank: more replicas cannot spread load
    if replicas > most:
        raise UsageError(
            f"--replicas {replicas}: at most {most} on {world_size} ranks ({num_experts} experts, each on "
            "every rank)"
        )
    return slots // world_size


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every expert's replicas are: physical slot s lives on rank ``s // slots_per_rank``."""

    world_size: int
    expert_load: np.ndarray  # int64 [num_experts]: the measured selections per expert it was placed from
    slot_expert: np.ndarray  # int64 [num_slots]: the logical expert held by each physical slot
    replica_count: np.ndarray  # int64 [num_experts]: replicas of each expert (>= 1)
    replica_slots: np.ndarray  # int64 [num_experts, max count]: each expert's slots ascending, -1 padded

    @property
    def num_experts(self) -> int:
        return int(self.expert_load.size)

    @property
    def num_slots(self) -> int:
        return int(self.slot_expert.size)

    @property
    def replicas(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.world_size

    def expert_ranks(self) -> list[list[int]]:
        """Per expert, the ranks holding its replicas (ascending; a rank twice if it holds two)."""
        return [
            [int(slot) // self.slots_per_rank for slot in row[:count]]
            for row, count in zip(self.replica_slots, self.replica_count, strict=True)
        ]

    def expected_rank_load(self) -> np.ndarray:
        """float64 [world]: selections each rank is expected to get, every expert's load split evenly over
        its replicas."""
        per_slot = self.expert_load[self.slot_expert] / self.replica_count[self.slot_expert]
        return per_slot.reshape(self.world_size, -1).sum(axis=1)

    def slots_of(self, topk_ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """int64 [tokens, topk]: the physical slot of each selection (-1 stays -1), token ``t`` of the batch
        being token ``first_token + t`` of the global batch (see the module docstring)."""
        ids = topk_ids.to(device="cpu", dtype=torch.int64)
        safe = ids.clamp(min=0)
        count = torch.from_numpy(self.replica_count)[safe]
        token = torch.arange(first_token, first_token + ids.shape[0], dtype=torch.int64).unsqueeze(1)
        slots = torch.from_numpy(self.replica_slots)[safe, token % count]
        return torch.where(ids < 0, torch.full_like(slots, -1), slots)


def replicate(expert_load: np.ndarray, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_expert [experts + replicas] before packing: the experts, then each redundant slot's expert;
    replica_count [experts]). Each redundant slot goes to the expert with the largest load per replica."""
    load = np.asarray(expert_load, dtype=np.float64)
    count = np.ones(load.size, dtype=np.int64)
    extra = np.empty(replicas, dtype=np.int64)
    for i in range(replicas):  # one step per replica (hundreds), never per token
        expert = int(np.argmax(load / count))
        extra[i] = expert
        count[expert] += 1
    return np.concatenate([np.arange(load.size, dtype=np.int64), extra]), count


def pack(slot_weight: np.ndarray, slot_expert: np.ndarray, world_size: int) -> np.ndarray:
    """int64 [slots]: the rank of each slot; heaviest first into the least-loaded rank with room, a rank
    that holds the same expert already skipped while another has room (module docstring, step 2)."""
    slots = slot_weight.size
    per_rank = slots // world_size
    rank_load = np.zeros(world_size, dtype=np.float64)
    rank_fill = np.zeros(world_size, dtype=np.int64)
    holds = np.zeros((world_size, int(slot_expert.max()) + 1), dtype=bool)
    slot_rank = np.empty(slots, dtype=np.int64)
    for slot in np.argsort(-slot_weight, kind="stable"):  # one step per slot, never per token
        expert = slot_expert[slot]
        room = rank_fill < per_rank
        fresh = room & ~holds[:, expert]
        rank = int(np.argmin(np.where(fresh if fresh.any() else room, rank_load, np.inf)))
        slot_rank[slot] = rank
        rank_load[rank] += slot_weight[slot]
        rank_fill[rank] += 1
        holds[rank, expert] = True
    return slot_rank


def place_replicas(expert_load: np.ndarray, replicas: int, world_size: int) -> Placement:
    """EPLB's global policy over one layer's measured ``expert_load`` (int [num_experts], selections per
    expert): ``replicas`` redundant slots replicated, packed and laid out (module docstring)."""
    load = np.array(expert_load, dtype=np.int64).reshape(-1)  # a copy: the placement keeps it
    if load.size < 1 or (load < 0).any():
        raise ValueError("expert load must be one non-negative count per expert")
    check_replicas(load.size, world_size, replicas)
    slot_expert, count = replicate(load, int(replicas))
    slot_rank = pack(load[slot_expert] / count[slot_expert], slot_expert, world_size)
    # Physical ids: by rank, then by expert inside a rank (every rank has exactly slots_per_rank slots).
    physical = slot_expert[np.lexsort((slot_expert, slot_rank))]
    by_expert = np.argsort(physical, kind="stable")  # physical slots grouped by expert, ascending
    starts = np.cumsum(count) - count
    column = np.arange(physical.size) - np.repeat(starts, count)
    table = np.full((load.size, int(count.max())), -1, dtype=np.int64)
    table[physical[by_expert], column] = by_expert
    return Placement(
        world_size=world_size,
        expert_load=load,
        slot_expert=physical,
        replica_count=count,
        replica_slots=table,
    )
