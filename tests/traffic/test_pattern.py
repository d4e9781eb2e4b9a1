import json

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.pattern import (
    balanced_pattern,
    build_pattern,
    destination_hits,
    pattern_to_json,
    rank_counts,
)
from commbench.traffic.routing import Routing, RoutingConfig, expert_rank, route_rank

DEEPSEEK = load_model("deepseek-v3")
QWEN = load_model("qwen3-30b-a3b")


def config(model=DEEPSEEK, skew="zipf:1.2", world=8, tokens=1024, **options) -> RoutingConfig:
    return RoutingConfig(
        model=model, skew=parse_skew(skew), world_size=world, tokens_per_rank=tokens, **options
    )


@pytest.fixture(scope="module")
def masked_cfg():
    return config(mask_ratio=0.1, capacity_factor=1.5)


@pytest.fixture(scope="module")
def token_pattern(masked_cfg):
    return build_pattern(masked_cfg, "token")


def test_rows_match_route_rank(masked_cfg, token_pattern):
    for rank in range(masked_cfg.world_size):
        routing = route_rank(masked_cfg, rank)
        counts = rank_counts(routing, DEEPSEEK.num_experts, masked_cfg.world_size)
        tokens_row, selections_row = counts.tokens, counts.selections
        assert np.array_equal(token_pattern.dispatch_tokens[rank], tokens_row)
        assert np.array_equal(token_pattern.dispatch_selections[rank], selections_row)
        kept = routing.topk_ids >= 0
        assert selections_row.sum() == int(kept.sum())
        # A token counts once per destination rank that holds at least one of its kept experts.
        destination = expert_rank(routing.topk_ids, 256, 8)
        per_token = torch.stack([(destination == dst).any(1) for dst in range(8)], dim=1)
        assert np.array_equal(tokens_row, per_token.sum(0).numpy())


def test_matrix_invariants(masked_cfg, token_pattern):
    pattern = token_pattern
    assert all(
        m.dtype == np.int64 and m.shape == (8, 8)
        for m in (
            pattern.dispatch_tokens,
            pattern.dispatch_selections,
            pattern.dispatch_bytes,
            pattern.combine_bytes,
        )
    )
    assert (pattern.dispatch_tokens <= pattern.dispatch_selections).all()
    assert (pattern.dispatch_tokens <= masked_cfg.tokens_per_rank).all()
    assert pattern.dispatch_selections.sum() == pattern.expert_load.sum() == pattern.stats["selections_kept"]
    assert np.array_equal(pattern.dispatch_bytes, pattern.dispatch_tokens * 7392)
    assert np.array_equal(pattern.combine_bytes, pattern.dispatch_tokens.T * 2 * 7168)
    assert pattern.name == "deepseek-v3" and pattern.send_mode == "token" and pattern.skew_text == "zipf:1.2"
    assert pattern.routing_cfg is masked_cfg


def test_selection_mode_bytes(masked_cfg, token_pattern):
    pattern = build_pattern(masked_cfg, "selection")
    assert np.array_equal(pattern.dispatch_selections, token_pattern.dispatch_selections)
    assert np.array_equal(pattern.dispatch_bytes, pattern.dispatch_selections * 7392)
    assert np.array_equal(pattern.combine_bytes, pattern.dispatch_selections.T * 14336)


def test_bf16_dispatch_bytes():
    pattern = build_pattern(config(model=QWEN, skew="uniform", world=4, tokens=256))
    assert np.array_equal(pattern.dispatch_bytes, pattern.dispatch_tokens * 2 * 2048)


def test_unknown_send_mode():
    with pytest.raises(UsageError, match="send mode 'expert' not known; use token, selection or node"):
        build_pattern(config(world=2, tokens=8), "expert")


def test_expert_load_and_stats(masked_cfg, token_pattern):
    stats, load = token_pattern.stats, token_pattern.expert_load
    expected_load = sum(rank_counts(route_rank(masked_cfg, rank), 256, 8).expert_load for rank in range(8))
    assert np.array_equal(load, expected_load)
    mean = load.mean()
    assert stats["expert_load_max"] == load.max() and stats["expert_load_mean"] == pytest.approx(mean)
    assert stats["expert_maxvio"] == pytest.approx((load.max() - mean) / mean)
    assert stats["expert_cv"] == pytest.approx(load.std() / mean)
    received = token_pattern.dispatch_selections.sum(0)
    assert stats["rank_recv_selections_max"] == received.max()
    assert stats["rank_maxvio"] == pytest.approx((received.max() - received.mean()) / received.mean())
    assert stats["rank_recv_tokens_max"] == token_pattern.dispatch_tokens.sum(0).max()
    routed = 8 * 1024 * 8
    assert stats["selections_routed"] == routed
    assert stats["dropped_fraction"] == pytest.approx(1 - load.sum() / routed)
    assert 0.1 < stats["dropped_fraction"] < 0.6  # masking plus capacity
    assert stats["capacity"] == masked_cfg.capacity and stats["mask_ratio"] == 0.1
    assert len(stats["hot_experts"]) == 8 and 0 < stats["hot_share"] < 1


def test_uniform_is_nearly_balanced():
    stats = build_pattern(config(skew="uniform", tokens=2048)).stats
    assert stats["expert_maxvio"] < 0.25 and stats["rank_maxvio"] < 0.05 and stats["dropped_fraction"] == 0


def test_rank_imbalance_stats():
    stats = build_pattern(config(model=QWEN, skew="rank-imbalance:3", world=8, tokens=2048)).stats
    assert stats["hot_rank_ratio"] == pytest.approx(3.0, rel=0.05)
    assert stats["hot_rank_ratio_target"] == 3.0 and stats["hot_share_target"] == pytest.approx(0.3)
    assert stats["hot_experts"] == list(range(16 * stats["hot_rank"], 16 * stats["hot_rank"] + 16))


def test_destination_hits_with_any_placement_and_send_counts():
    ids = np.array([[0, 3, -1], [4, 1, 2], [-1, -1, -1]])
    owner = np.array([0, 0, 0, 1, 2])  # uneven: 3 experts on rank 0, one each on ranks 1 and 2
    assert destination_hits(ids, owner, 3).tolist() == [[1, 1, 0], [2, 0, 1], [0, 0, 0]]
    # Contiguous placement (2 experts per rank): the rows a plan sends, per destination and per slot.
    routing = Routing(rank=0, topk_ids=torch.tensor([[0, 3], [1, 2], [3, -1]]), topk_weights=torch.ones(3, 2))
    counts = rank_counts(routing, num_experts=4, world_size=2)
    assert counts.tokens.tolist() == [2, 3] and counts.selections.tolist() == [2, 3]
    assert counts.expert_load.tolist() == [1, 1, 1, 2]
    assert counts.send_counts("token").tolist() == [[2], [3]]
    assert counts.send_counts("selection").tolist() == [[1, 1], [1, 2]]


def test_balanced_pattern():
    pattern = balanced_pattern(4, 1003)
    assert pattern.send_mode == "balanced" and pattern.name == "balanced"
    assert (pattern.dispatch_bytes == 250).all() and (pattern.combine_bytes == 0).all()
    assert (pattern.dispatch_tokens == 1).all() and pattern.dispatch_bytes.dtype == np.int64
    assert pattern.stats == {"size_bytes": 1000, "requested_size_bytes": 1003, "bytes_per_peer": 250}
    assert pattern.routing_cfg is None and pattern.expert_load.size == 0
    assert balanced_pattern(1, 7).dispatch_bytes.tolist() == [[7]]


@pytest.mark.parametrize("world, size", [(0, 8), (2, -1), (2, 1.5)])
def test_balanced_pattern_bad_input(world, size):
    with pytest.raises(UsageError):
        balanced_pattern(world, size)


def test_pattern_to_json(masked_cfg, token_pattern):
    data = json.loads(json.dumps(pattern_to_json(token_pattern)))
    assert data["model"] == "deepseek-v3" and data["world"] == 8 and data["tokens"] == 1024
    assert data["skew"] == "zipf:1.2" and data["seed"] == 0 and data["send_mode"] == "token"
    for key in ("dispatch_tokens", "dispatch_selections", "dispatch_bytes", "combine_bytes"):
        assert np.array_equal(np.array(data[key]), getattr(token_pattern, key))
        assert all(isinstance(v, int) for row in data[key] for v in row)
    assert data["expert_load"] == token_pattern.expert_load.tolist()
    assert data["stats"]["hot_experts"] == token_pattern.stats["hot_experts"]
    balanced = pattern_to_json(balanced_pattern(2, 64))
    assert balanced["tokens"] is None and balanced["dispatch_bytes"] == [[32, 32], [32, 32]]
    json.dumps(balanced)
