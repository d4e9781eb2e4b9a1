"""EPLB replicas: the placement (replicate the hottest, pack balanced), each selection's replica, and the
traffic every stage derives from them (counts, plans) with --replicas."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.pattern import Pattern, build_pattern, rank_counts
from commbench.traffic.plan import plan_rank
from commbench.traffic.replicas import check_replicas, place_replicas, replicate
from commbench.traffic.routing import RoutingConfig, replica_placement, route_rank

DEEPSEEK = load_model("deepseek-v3")


def config(skew: str, world: int, replicas: int, tokens: int = 512) -> RoutingConfig:
    return RoutingConfig(DEEPSEEK, parse_skew(skew), world, tokens, seed=3, replicas=replicas)


def rank_load_ratio(pattern: Pattern) -> float:
    """max / mean of the selections each rank receives: the load EPLB balances."""
    received = pattern.dispatch_selections.sum(axis=0)
    return float(received.max() / received.mean())


# ---------------------------------------------------------------------------------------------------------
# The placement


def test_the_hottest_expert_per_replica_gets_each_new_replica() -> None:
    load = np.array([1, 1, 1, 10, 1, 1, 1, 6])
    slot_expert, count = replicate(load, 3)
    # 10 > 6 > 10/2 = 5: expert 3, then 7, then 3 again; the experts keep their own slot first.
    assert slot_expert.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3, 7, 3]
    assert count.tolist() == [1, 1, 1, 3, 1, 1, 1, 2]


def test_every_expert_has_a_replica_and_every_rank_the_same_slots() -> None:
    load = np.random.default_rng(0).integers(0, 1000, size=64)
    placement = place_replicas(load, 16, 8)
    assert placement.num_slots == 80 and placement.slots_per_rank == 10
    assert (placement.replica_count >= 1).all() and placement.replica_count.sum() == 80
    # Each physical slot holds the expert the table says, and rank r holds slots r*10 .. r*10+9.
    assert np.bincount(placement.slot_expert, minlength=64).tolist() == placement.replica_count.tolist()
    for expert, ranks in enumerate(placement.expert_ranks()):
        slots = placement.replica_slots[expert, : placement.replica_count[expert]]
        assert (placement.slot_expert[slots] == expert).all()
        assert ranks == sorted(ranks) and ranks == (slots // 10).tolist()


def test_a_hot_experts_replicas_sit_on_different_ranks() -> None:
    load = np.full(16, 30, dtype=np.int64)
    load[[2, 9]] = 100  # two hot experts: 3 replicas each (25 per replica < 30), then 2 for the cold ones
    placement = place_replicas(load, 8, 4)
    assert placement.replica_count[[0, 1, 2, 9]].tolist() == [2, 2, 4, 4]
    # EPLB's packing alone would put slots of equal weight round-robin and pair a hot expert's replicas up.
    assert placement.expert_ranks()[2] == [0, 1, 2, 3]
    assert placement.expert_ranks()[9] == [0, 1, 2, 3]
    assert placement.expected_rank_load().tolist() == [155.0] * 4  # 620 selections, perfectly balanced


def test_bad_replica_counts_are_one_line_usage_errors() -> None:
    with pytest.raises(UsageError, match=r"--replicas 5: 256 experts \+ 5 replicas = 261 slots .* 8, 16, 24"):
        check_replicas(256, 8, 5)
    with pytest.raises(UsageError, match="at most 256 on 2 ranks"):
        check_replicas(256, 2, 258)
    with pytest.raises(UsageError, match="integer >= 0"):
        check_replicas(256, 8, -8)
    with pytest.raises(UsageError, match="261 slots"):
        config("uniform", 8, 5)
    assert check_replicas(256, 8, 8) == 33


# ---------------------------------------------------------------------------------------------------------
# What replicas buy, on the routing commbench generates


@pytest.mark.parametrize("world", [8, 16])
@pytest.mark.parametrize("skew", ["hot:8:0.3", "zipf:1.2"])
def test_replicas_lower_the_rank_load_imbalance(skew: str, world: int) -> None:
    without = rank_load_ratio(build_pattern(config(skew, world, 0)))
    assert without > 1.2  # the skew does make one rank busier
    for replicas in (world, 2 * world):
        cfg = config(skew, world, replicas)
        with_replicas = rank_load_ratio(build_pattern(cfg))
        assert with_replicas < without, (replicas, with_replicas, without)
        # Measured within a few percent of what the placement expects.
        expected = replica_placement(cfg).expected_rank_load()
        assert with_replicas == pytest.approx(expected.max() / expected.mean(), rel=0.06)
    assert with_replicas < 1.1  # 2 x world replicas: nearly balanced


def test_the_hot_experts_are_replicated_first() -> None:
    cfg = config("hot:8:0.3", 8, 8)
    placement = replica_placement(cfg)
    hot = set(build_pattern(cfg).stats["hot_experts"])
    assert {int(e) for e in np.flatnonzero(placement.replica_count > 1)} == hot


def test_placement_and_replica_choice_are_deterministic() -> None:
    cfg = config("zipf:1.2", 8, 16)
    first = replica_placement(cfg)
    replica_placement.cache_clear()
    second = replica_placement(cfg)
    assert first is not second
    for name in ("slot_expert", "replica_count", "replica_slots", "expert_load"):
        assert np.array_equal(getattr(first, name), getattr(second, name))
    assert torch.equal(route_rank(cfg, 5).slot_ids, route_rank(cfg, 5).slot_ids)


def test_tokens_of_an_expert_split_evenly_over_its_replicas() -> None:
    load = np.ones(8, dtype=np.int64)
    load[5] = 50
    placement = place_replicas(load, 2, 2)  # expert 5 gets 3 replicas
    assert placement.replica_count[5] == 3
    ids = torch.full((301, 2), 5, dtype=torch.int64)
    ids[:, 1] = -1  # dropped selections stay dropped
    slots = placement.slots_of(ids, first_token=1000)
    assert (slots[:, 1] == -1).all()
    counts = torch.bincount(slots[:, 0], minlength=placement.num_slots)
    mine = placement.replica_slots[5, :3]
    assert counts[mine].tolist() in ([101, 100, 100], [100, 101, 100], [100, 100, 101])
    assert int(counts.sum()) == 301


def test_no_replicas_is_the_contiguous_placement() -> None:
    routing = route_rank(config("hot:8:0.3", 8, 0), 2)
    assert routing.slot_ids is None
    slots, num_slots = routing.destination_slots(256)
    assert slots is routing.topk_ids and num_slots == 256


# ---------------------------------------------------------------------------------------------------------
# Every stage sees the same destinations


@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_plans_and_counts_send_each_selection_to_a_replica_of_its_expert(send_mode: str) -> None:
    cfg = config("zipf:1.2", 4, 8, tokens=300)
    placement = replica_placement(cfg)
    routing = route_rank(cfg, 1)
    kept = routing.topk_ids >= 0
    # Each selection's slot holds its expert.
    slot_expert = torch.from_numpy(placement.slot_expert)
    assert torch.equal(slot_expert[routing.slot_ids[kept]], routing.topk_ids[kept])
    counts = rank_counts(routing, 256, 4)
    plan = plan_rank(routing, DEEPSEEK, 4, send_mode)
    assert np.array_equal(plan.send_counts.numpy(), counts.send_counts(send_mode))
    destination = routing.slot_ids // placement.slots_per_rank
    if send_mode == "selection":
        assert plan.send_counts.shape == (4, 66)  # (256 + 8) / 4 slots per rank
        assert int(plan.send_counts.sum()) == int(kept.sum())
        assert set(plan.send_key.tolist()) <= set(routing.slot_ids[kept].tolist())
    else:
        # A token goes once to each rank holding one of its chosen replicas.
        reached = torch.zeros(routing.topk_ids.shape[0], 4, dtype=torch.bool)
        rows = torch.arange(routing.topk_ids.shape[0]).unsqueeze(1).expand_as(destination)
        reached[rows[kept], destination[kept]] = True
        assert plan.send_counts[:, 0].tolist() == reached.sum(0).tolist()
    # The pattern is the sum of every rank's counts, its expert load the logical experts'.
    pattern = build_pattern(cfg, send_mode)
    assert pattern.dispatch_selections[1].tolist() == counts.selections.tolist()
    assert pattern.expert_load.size == 256
    assert np.array_equal(pattern.expert_load, placement.expert_load)  # the load it was placed from


def test_replicas_change_destinations_not_the_routing() -> None:
    plain, replicated = config("hot:8:0.3", 8, 0), config("hot:8:0.3", 8, 16)
    assert torch.equal(route_rank(plain, 3).topk_ids, route_rank(replicated, 3).topk_ids)
    assert replace(replicated, replicas=0) == plain
    before, after = build_pattern(plain), build_pattern(replicated)
    assert before.dispatch_selections.sum() == after.dispatch_selections.sum()
    assert not np.array_equal(before.dispatch_selections, after.dispatch_selections)
