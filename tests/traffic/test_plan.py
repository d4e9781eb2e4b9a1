import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.traffic.plan import (
    balanced_pair_rows,
    plan_balanced,
    plan_balanced_moe,
    plan_rank,
    receive_offsets,
    row_matrix,
)
from commbench.traffic.routing import Routing

# 8 experts over 4 ranks: experts 2r and 2r+1 live on rank r.
TOY = ModelConfig(name="toy", hidden=16, num_experts=8, topk=3)
IDS = torch.tensor(
    [
        [0, 5, 1],  # rank 0 (experts 0, 1) and rank 2 (expert 5)
        [7, -1, 6],  # rank 3 only, one selection dropped
        [-1, -1, -1],  # everything dropped: no traffic
        [3, 2, 4],  # rank 1 (3, 2) and rank 2 (4)
        [5, 4, 0],  # rank 2 (5, 4) and rank 0 (0)
    ]
)
WEIGHTS = torch.tensor(
    [
        [0.5, 0.25, 0.125],
        [0.75, 0.0, 0.0625],
        [0.0, 0.0, 0.0],
        [0.375, 0.3125, 0.25],
        [0.1875, 0.5625, 0.03125],
    ]
)


def toy_routing(rank=1):
    return Routing(rank=rank, topk_ids=IDS.clone(), topk_weights=WEIGHTS.clone())


def test_token_mode_rows_grouped_by_destination_tokens_ascending():
    plan = plan_rank(toy_routing(), TOY, world_size=4, send_mode="token")
    assert plan.rank == 1 and plan.num_tokens == 5 and plan.send_mode == "token"
    assert plan.send_token_index.tolist() == [0, 4, 3, 0, 3, 4, 1]
    assert plan.send_key.tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert plan.send_counts.tolist() == [[2], [1], [3], [1]]
    assert plan.send_splits == [2, 1, 3, 1]
    # Weight of a (token, destination) row = sum of the token's weights on that destination's experts.
    expected = [0.5 + 0.125, 0.03125, 0.375 + 0.3125, 0.25, 0.25, 0.1875 + 0.5625, 0.75 + 0.0625]
    assert plan.combine_weight.tolist() == pytest.approx(expected)
    assert plan.combine_weight.dtype == torch.float32
    assert plan.dispatch_row_bytes == TOY.dispatch_bytes_per_token
    assert plan.combine_row_bytes == TOY.combine_bytes_per_token
    assert plan.static_recv_counts is None


def test_selection_mode_rows_ordered_by_expert_then_token():
    plan = plan_rank(toy_routing(), TOY, world_size=4, send_mode="selection")
    assert plan.send_key.tolist() == [0, 0, 1, 2, 3, 4, 4, 5, 5, 6, 7]
    assert plan.send_token_index.tolist() == [0, 4, 0, 3, 3, 3, 4, 0, 4, 1, 1]
    assert plan.send_counts.tolist() == [[2, 1], [1, 1], [2, 2], [1, 1]]  # per local expert
    assert plan.send_splits == [3, 2, 4, 2]
    expected = [0.5, 0.03125, 0.125, 0.3125, 0.375, 0.25, 0.5625, 0.25, 0.1875, 0.0625, 0.75]
    assert plan.combine_weight.tolist() == pytest.approx(expected)


def _reference_rows(ids, weights, per_rank, send_mode):
    """Python-loop reference of the layout: list of (destination, key, token, weight) in send order."""
    rows = {}
    for token in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            if expert < 0:
                continue
            dest = expert // per_rank
            key = (dest, dest, token) if send_mode == "token" else (dest, expert, token)
            rows[key] = rows.get(key, 0.0) + float(weights[token, slot])
    return [(d, k, t, w) for (d, k, t), w in sorted(rows.items())]


@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_plan_matches_loop_reference_on_random_routing(send_mode):
    generator = torch.Generator().manual_seed(7)
    model = ModelConfig(name="rand", hidden=8, num_experts=24, topk=4)
    world = 6
    ids = torch.stack([torch.randperm(24, generator=generator)[:4] for _ in range(50)])
    ids[torch.rand(ids.shape, generator=generator) < 0.2] = -1
    weights = torch.rand(ids.shape, generator=generator) * (ids >= 0)
    plan = plan_rank(Routing(rank=3, topk_ids=ids, topk_weights=weights), model, world, send_mode)
    reference = _reference_rows(ids, weights, 24 // world, send_mode)
    assert plan.send_token_index.tolist() == [t for _, _, t, _ in reference]
    assert plan.send_key.tolist() == [k for _, k, _, _ in reference]
    assert plan.combine_weight.tolist() == pytest.approx([w for _, _, _, w in reference], rel=1e-6)
    destinations = np.array([d for d, _, _, _ in reference])
    assert plan.send_splits == np.bincount(destinations, minlength=world).tolist()
    # Every kept weight ends on exactly one row.
    assert float(plan.combine_weight.sum()) == pytest.approx(float(weights.sum()), rel=1e-6)
    for dst in range(world):
        assert (plan.send_key[plan.segment(dst)] // (1 if send_mode == "token" else 4) == dst).all()


def test_plan_rejects_bad_input():
    with pytest.raises(UsageError, match="divide"):
        plan_rank(toy_routing(), TOY, world_size=3)
    with pytest.raises(UsageError, match="send mode"):
        plan_rank(toy_routing(), TOY, world_size=4, send_mode="tokens")


def test_plan_to_device_copies_every_tensor():
    plan = plan_rank(toy_routing(), TOY, world_size=4).to("cpu")
    assert plan.send_token_index.device.type == "cpu" and plan.send_counts.device.type == "cpu"
    balanced = plan_balanced(0, 4, 64).to("cpu")
    assert balanced.static_recv_counts.tolist() == [[1]] * 4


def test_plan_balanced_one_row_per_destination():
    plan = plan_balanced(rank=2, world_size=4, size_bytes=1002)
    assert plan.send_mode == "balanced" and plan.num_tokens == 4
    assert plan.send_token_index.tolist() == [0, 1, 2, 3]
    assert plan.send_counts.tolist() == [[1], [1], [1], [1]]
    assert plan.static_recv_counts.tolist() == [[1], [1], [1], [1]]
    assert plan.dispatch_row_bytes == 250  # rounded down, as nccl-tests
    assert plan.combine_row_bytes == 0
    with pytest.raises(UsageError, match="smaller than the world size"):
        plan_balanced(0, 8, 4)


def test_balanced_pair_rows_equal_splits_and_remainder_on_diagonals():
    assert balanced_pair_rows(4, 32).tolist() == [[2] * 4] * 4
    rows = balanced_pair_rows(3, 3 * 9 + 4)  # 3 per pair, 4 extra rows: shift 0 (the diagonal), then (0, 1)
    assert rows.tolist() == [[4, 4, 3], [3, 4, 3], [3, 3, 4]]
    for world, total in [(4, 0), (4, 5), (4, 1037), (8, 64 * 7 + 63), (1, 9)]:
        rows = balanced_pair_rows(world, total)
        assert rows.dtype == np.int64 and rows.sum() == total
        assert set(np.unique(rows)) <= {total // world**2, total // world**2 + 1}
        for sums in (rows.sum(axis=1), rows.sum(axis=0)):  # every rank sends / receives the same, +-1 row
            assert sums.max() - sums.min() <= 1


@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_plan_balanced_moe_has_the_skewed_total_spread_evenly_in_plan_layout(send_mode):
    world, tokens, per_rank = 4, 5, 2
    skewed = [plan_rank(toy_routing(rank), TOY, world, send_mode) for rank in range(world)]
    total = int(row_matrix(skewed).sum())  # 28 token rows / 44 selection rows: not a multiple of 16
    plans = [
        plan_balanced_moe(rank, world, total, tokens, 40, 32, send_mode, experts_per_rank=per_rank)
        for rank in range(world)
    ]
    assert row_matrix(plans).sum() == total
    assert (row_matrix(plans) == balanced_pair_rows(world, total)).all()
    for plan in plans:
        assert (plan.send_mode, plan.num_tokens, plan.dispatch_row_bytes, plan.combine_row_bytes) == (
            send_mode,
            tokens,
            40,
            32,
        )
        assert plan.static_recv_counts is None  # counts are exchanged, as in the skewed dispatch
        token, key = plan.send_token_index.tolist(), plan.send_key.tolist()
        if send_mode == "token":
            assert plan.send_counts.shape == (world, 1)
            dst = key
            pairs = list(zip(dst, token, strict=True))  # (destination, token) ascending and never repeated
        else:
            assert plan.send_counts.shape == (world, per_rank)
            # Per-expert counts of one destination differ by at most one row.
            spread = plan.send_counts.max(dim=1).values - plan.send_counts.min(dim=1).values
            assert spread.max() <= 1
            dst = [k // per_rank for k in key]
            pairs = list(zip(key, token, strict=True))  # (expert, token) ascending and never repeated
        assert pairs == sorted(set(pairs))
        assert [plan.segment(d) for d in range(world)] == [
            slice(dst.index(d), dst.index(d) + dst.count(d)) for d in range(world)
        ]
        # Tokens carry about the same number of rows; a token's weights sum to 1.
        rows_of_token = torch.bincount(plan.send_token_index, minlength=tokens)
        assert rows_of_token.max() - rows_of_token.min() <= 1
        weight_sum = torch.zeros(tokens).index_add_(0, plan.send_token_index, plan.combine_weight)
        assert torch.allclose(weight_sum[rows_of_token > 0], torch.ones(1))


def test_plan_balanced_moe_rejects_too_few_tokens_and_bad_mode():
    with pytest.raises(ValueError, match="tokens per rank"):
        plan_balanced_moe(0, 2, 4 * 6, 5, 8, 8)  # 6 rows per pair but 5 tokens: a token would repeat
    plan = plan_balanced_moe(0, 2, 4 * 6, 3, 8, 8, "selection", experts_per_rank=2)  # 2 experts x 3 tokens
    assert plan.send_counts.tolist() == [[3, 3], [3, 3]]
    with pytest.raises(UsageError, match="send mode"):
        plan_balanced_moe(0, 2, 8, 4, 8, 8, send_mode="tokens")


def test_receive_offsets_is_prefix_sum_over_sources():
    counts = np.array([[1, 2, 0], [3, 4, 5], [6, 0, 7]])
    offsets = receive_offsets(counts)
    assert offsets.tolist() == [[0, 0, 0], [1, 2, 0], [4, 6, 5]]
    assert offsets.dtype == np.int64
    with pytest.raises(ValueError):
        receive_offsets(np.zeros((2, 3)))


def test_row_matrix_stacks_send_splits():
    plans = [plan_rank(toy_routing(rank), TOY, 4) for rank in range(4)]
    assert row_matrix(plans).tolist() == [[2, 1, 3, 1]] * 4
