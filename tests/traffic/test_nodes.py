"""Node mode's counts (traffic.nodes, the node Pattern): nodes, forwarders, and each stage's bytes per link
class against a closed form counted token by token."""

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.layout import build_layout
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.links import link_class_bytes
from commbench.traffic.nodes import Nodes, node_phases, node_stage_rows, node_token_counts
from commbench.traffic.pattern import (
    build_pattern,
    destination_hits,
    pattern_from_counts,
    pattern_to_json,
    rank_counts,
)
from commbench.traffic.routing import Routing, RoutingConfig, route_rank

# 4 experts, one per rank on 4 ranks; 16 B dispatch rows, 32 B combine rows.
TINY = ModelConfig(name="tiny", hidden=16, num_experts=4, topk=2, dispatch_dtype="bf16")


def test_nodes_of_a_layout_local_index_and_forwarders():
    nodes = Nodes.of(np.array([5, 5, 2, 2, 2, 7]))  # ids in order of first appearance
    assert nodes.node_of_rank.tolist() == [0, 0, 1, 1, 1, 2]
    assert nodes.sizes.tolist() == [2, 3, 1] and not nodes.uniform
    assert nodes.local_index.tolist() == [0, 1, 0, 1, 2, 0]
    # Rank 4 (local index 2) reaches node 0 (2 ranks) through local index 2 % 2 = 0: rank 0.
    assert nodes.forwarders[4].tolist() == [0, 4, 5]
    assert nodes.forwarders[1].tolist() == [1, 3, 5]
    assert Nodes.contiguous(4, 2) == Nodes.of(np.array([0, 0, 1, 1])) and Nodes.contiguous(4, 2).uniform
    assert node_phases() == (
        "dispatch", "dispatch:scaleout", "dispatch:nvlink", "combine", "combine:nvlink", "combine:scaleout",
    )  # fmt: skip


def test_node_token_counts_count_a_token_once_per_node():
    hits = np.array([[[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]]])  # 3 tokens over 4 ranks in 2 nodes
    assert node_token_counts(hits, np.array([0, 0, 1, 1]), 2).tolist() == [[2, 1]]


def _routing(rank, ids):
    ids = torch.tensor(ids, dtype=torch.int64)
    return Routing(rank, ids, torch.where(ids >= 0, 0.5, 0.0).float())


def test_a_token_whose_experts_sit_on_ranks_of_one_remote_node_crosses_the_nic_once():
    cfg = RoutingConfig(TINY, parse_skew("uniform"), world_size=4, tokens_per_rank=1)
    nodes = Nodes.contiguous(4, 2)  # node 0 = ranks 0, 1; node 1 = ranks 2, 3
    # Rank 0's token picks experts 2 and 3 (both on node 1); rank 1's stays home; rank 2's goes to rank 0 and
    # to itself; rank 3's selections are dropped.
    routings = [_routing(0, [[2, 3]]), _routing(1, [[0, 1]]), _routing(2, [[0, 2]]), _routing(3, [[-1, -1]])]
    counts = [rank_counts(r, 4, 4, nodes) for r in routings]
    node = pattern_from_counts(cfg, "node", counts, nodes)
    token = pattern_from_counts(cfg, "token", [rank_counts(r, 4, 4) for r in routings])
    row = TINY.dispatch_bytes_per_token
    scaleout = node.stages["dispatch"]["scaleout"] // row
    nvlink = node.stages["dispatch"]["nvlink"] // row
    assert scaleout.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    # Rank 2 hands rank 0's token to itself and to rank 3; rank 0 hands rank 2's to itself; rank 1 sends its
    # own token to rank 0 and to itself; rank 2 sends its own token to itself.
    assert nvlink.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 2, 1], [0, 0, 0, 0]]
    domains = build_layout(4, ranks_per_domain=2).domain_of_rank
    by_node = link_class_bytes(node.dispatch_bytes, domains)
    by_rank = link_class_bytes(token.dispatch_bytes, domains)
    assert by_node["scaleout"] == 2 * row and by_rank["scaleout"] == 3 * row  # 0 -> {2, 3} once, 2 -> 0
    assert by_node["nvlink"] == 2 * row and by_node["self"] == 4 * row
    assert node.stats["scaleout_rows"] == 2 and node.stats["rank_scaleout_rows"] == 3
    combine = TINY.combine_bytes_per_token
    assert np.array_equal(node.stages["combine"]["scaleout"], scaleout.T * combine)
    assert np.array_equal(node.combine_bytes, (scaleout + nvlink).T * combine)
    assert np.array_equal(node.dispatch_tokens, token.dispatch_tokens)  # what reaches whom is unchanged


def _per_token_reference(cfg, nodes):
    """Stage rows counted token by token (the closed form the vectorized builder must match)."""
    n = cfg.world_size
    owner = np.arange(cfg.model.num_experts) // (cfg.model.num_experts // n)
    scaleout, nvlink = np.zeros((n, n), np.int64), np.zeros((n, n), np.int64)
    for src in range(n):
        hits = destination_hits(route_rank(cfg, src).topk_ids.numpy(), owner, n)
        for ranks in (np.flatnonzero(row) for row in hits):
            home = nodes.node_of_rank[src]
            for node in sorted({int(nodes.node_of_rank[r]) for r in ranks} - {int(home)}):
                scaleout[src, nodes.forwarders[src, node]] += 1
            for r in ranks:
                node = nodes.node_of_rank[r]
                nvlink[src if node == home else nodes.forwarders[src, node], r] += 1
    return scaleout, nvlink


@pytest.mark.parametrize(
    "domains", [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 2, 2]]
)
def test_node_stages_match_the_per_token_closed_form(domains):
    cfg = RoutingConfig(load_model("deepseek-v3"), parse_skew("zipf:1.2"), 8, 48, seed=3, mask_ratio=0.1)
    nodes = Nodes.of(np.array(domains))
    pattern = build_pattern(cfg, "node", nodes)
    scaleout, nvlink = _per_token_reference(cfg, nodes)
    row = cfg.model.dispatch_bytes_per_token
    assert np.array_equal(pattern.stages["dispatch"]["scaleout"], scaleout * row)
    assert np.array_equal(pattern.stages["dispatch"]["nvlink"], nvlink * row)
    # Stage 1 only crosses NICs, stage 2 only NVLink (or stays on the GPU) and delivers token mode's rows.
    classes = [
        link_class_bytes(pattern.stages["dispatch"][s], np.array(domains)) for s in ("scaleout", "nvlink")
    ]
    assert classes[0]["scaleout"] == classes[0]["total"] and classes[1]["scaleout"] == 0
    token = build_pattern(cfg, "token")
    assert nvlink.sum() == token.dispatch_tokens.sum()
    assert (
        link_class_bytes(pattern.dispatch_bytes, np.array(domains))["scaleout"]
        <= link_class_bytes(token.dispatch_bytes, np.array(domains))["scaleout"]
    )
    printed = pattern_to_json(pattern)
    assert printed["send_mode"] == "node" and printed["node_of_rank"] == nodes.node_of_rank.tolist()
    assert np.array_equal(
        printed["stages"]["combine"]["nvlink"], nvlink.T * cfg.model.combine_bytes_per_token
    )


def test_node_stage_rows_checks_its_shapes_and_node_mode_needs_nodes():
    with pytest.raises(ValueError, match="need tokens"):
        node_stage_rows(np.zeros((4, 4)), np.zeros((4, 3)), Nodes.contiguous(4, 2))
    cfg = RoutingConfig(TINY, parse_skew("uniform"), world_size=4, tokens_per_rank=4)
    with pytest.raises(UsageError, match="--ranks-per-domain"):
        build_pattern(cfg, "node")
    with pytest.raises(UsageError, match="cover 2 ranks"):
        build_pattern(cfg, "node", Nodes.contiguous(2, 1))
