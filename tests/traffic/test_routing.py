import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import commbench.traffic.routing as routing_module
from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.routing import (
    RoutingConfig,
    expert_popularity,
    expert_rank,
    experts_per_rank,
    route_rank,
)

DEEPSEEK = load_model("deepseek-v3")
REPO = Path(__file__).resolve().parents[2]
QWEN = load_model("qwen3-30b-a3b")
MIXTRAL = load_model("mixtral-8x22b")


def config(model=DEEPSEEK, skew="uniform", world=8, tokens=2048, **options) -> RoutingConfig:
    return RoutingConfig(
        model=model, skew=parse_skew(skew), world_size=world, tokens_per_rank=tokens, **options
    )


def group_span(topk_ids: torch.Tensor, experts_per_group: int) -> torch.Tensor:
    """Distinct groups among each token's kept experts."""
    groups = torch.where(topk_ids >= 0, topk_ids // experts_per_group, -1).sort(dim=1).values
    new = torch.ones_like(groups, dtype=torch.bool)
    new[:, 1:] = groups[:, 1:] != groups[:, :-1]
    return (new & (groups >= 0)).sum(1)


def assert_valid(routing, cfg):
    ids, weights = routing.topk_ids, routing.topk_weights
    tokens, topk = cfg.tokens_per_rank, cfg.model.topk
    assert ids.shape == weights.shape == (tokens, topk)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert int(ids.min()) >= -1 and int(ids.max()) < cfg.model.num_experts
    ordered = ids.sort(dim=1).values
    assert not ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(), (
        "repeated expert in a token"
    )
    kept = ids >= 0
    assert (weights[~kept] == 0).all() and (weights[kept] > 0).all()
    has_kept = kept.any(1)
    assert torch.allclose(weights.sum(1)[has_kept], torch.ones(int(has_kept.sum())), atol=1e-5)


def test_experts_per_rank_and_expert_rank():
    assert experts_per_rank(256, 8) == 32
    ids = torch.tensor([[0, 31, 32, -1], [255, 64, -1, 100]])
    assert expert_rank(ids, 256, 8).tolist() == [[0, 0, 1, -1], [7, 2, -1, 3]]


def test_world_size_must_divide_experts():
    with pytest.raises(UsageError) as info:
        experts_per_rank(256, 3)
    assert (
        str(info.value) == "world size 3 does not divide 256 experts; use a divisor such as 2, 4, 8, 16 ..."
    )
    with pytest.raises(UsageError, match="world size 3 does not divide 256 experts"):
        config(world=3)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"mask_ratio": 1.0}, "mask ratio"),
        ({"mask_ratio": -0.1}, "mask ratio"),
        ({"capacity_factor": 0.0}, "capacity factor"),
        ({"capacity_factor": float("nan")}, "capacity factor"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"seed": 1.5}, "seed must be an integer >= 0"),
        ({"tokens": 0}, "tokens per rank must be an integer >= 1"),
        ({"world": 0}, "world size must be an integer >= 1"),
        ({"world": True}, "world size must be an integer >= 1"),
    ],
)
def test_routing_config_validation(options, words):
    with pytest.raises(UsageError, match=words):
        config(**options)


def test_numpy_integers_are_accepted():
    cfg = config(world=np.int64(4), tokens=np.int32(16), seed=np.uint8(3))
    assert (cfg.world_size, cfg.tokens_per_rank, cfg.seed) == (4, 16, 3)
    assert type(cfg.world_size) is int and hash(cfg)


def test_rank_out_of_range():
    with pytest.raises(UsageError, match="rank 8 outside world size 8"):
        route_rank(config(), 8)


@pytest.mark.parametrize(
    "model, skew",
    [
        (DEEPSEEK, "uniform"),
        (DEEPSEEK, "zipf:1.2"),
        (DEEPSEEK, "hot:4:0.3"),
        (QWEN, "zipf:0.8"),
        (load_model("kimi-k2"), "uniform"),
        (MIXTRAL, "zipf:2"),
        (load_model("llama4-maverick"), "uniform"),
        (load_model("gpt-oss-120b"), "rank-imbalance:2"),
    ],
)
def test_routing_invariants(model, skew):
    cfg = config(model=model, skew=skew, world=8 if model.num_experts >= 8 else 2, tokens=1500)
    routing = route_rank(cfg, 3 % cfg.world_size)
    assert_valid(routing, cfg)
    assert (routing.topk_ids >= 0).all()  # nothing dropped without masking or capacity
    if model.group_limited:
        assert int(group_span(routing.topk_ids, model.experts_per_group).max()) <= model.topk_group


def test_group_limit_is_binding_and_held():
    # With 4 of 8 groups allowed a uniform token would otherwise span up to 8 groups.
    routing = route_rank(config(skew="zipf:1.2", tokens=4096), 0)
    span = group_span(routing.topk_ids, DEEPSEEK.experts_per_group)
    assert int(span.max()) == 4 and int(span.min()) >= 1
    unlimited = ModelConfig("flat", hidden=64, num_experts=256, topk=8, n_group=8, topk_group=8)
    assert int(group_span(route_rank(config(model=unlimited, tokens=4096), 0).topk_ids, 32).max()) > 4


def select_from_groups(times: torch.Tensor, payload: torch.Tensor, model: ModelConfig):
    """Reference group-limited top-k on full candidate arrival times [rows, groups, c] (each group's
    candidates must hold its k earliest arrivals): groups scored by the sum of their top k // topk_group
    affinities, the best topk_group kept, then the k earliest. Returns (times [rows, k] ascending, ids)."""
    rows, groups, width = times.shape
    if model.group_limited:
        per_score = max(1, model.topk // model.topk_group)
        scores = torch.exp(-times.topk(per_score, dim=2, largest=False).values).sum(-1)
        kept = scores.topk(model.topk_group, dim=1).indices.unsqueeze(2).expand(-1, -1, width)
        times, payload = times.gather(1, kept), payload.gather(1, kept)
    best_times, position = times.reshape(rows, -1).topk(model.topk, dim=1, largest=False)
    return best_times, payload.reshape(rows, -1).gather(1, position)


def test_race_sampler_matches_the_full_score_matrix():
    """The lazy race equals, in distribution, top-k of exp(-X / w) over every expert (with group limit)."""
    cfg = config(skew="zipf:1.2", tokens=20000, seed=5)
    routing = route_rank(cfg, 0)
    weights = torch.tensor(expert_popularity(cfg).weights)
    exps = torch.from_numpy(np.random.default_rng(123).standard_exponential((20000, 256)))
    times = (exps / weights).view(20000, 8, 32)
    experts = torch.arange(256).view(1, 8, 32).expand(20000, -1, -1)
    reference_times, reference = select_from_groups(times, experts, DEEPSEEK)
    ours = torch.bincount(routing.topk_ids.view(-1), minlength=256).double()
    theirs = torch.bincount(reference.reshape(-1), minlength=256).double()
    used = (ours + theirs) > 0
    chi2 = float((((ours - theirs) ** 2) / (ours + theirs).clamp(min=1))[used].sum())
    dof = int(used.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5
    # Group span distribution and the weights agree as well.
    span_ours = torch.bincount(group_span(routing.topk_ids, 32), minlength=5).double() / 20000
    span_ref = torch.bincount(group_span(reference, 32), minlength=5).double() / 20000
    assert torch.allclose(span_ours, span_ref, atol=0.01)
    reference_weights = torch.exp(-reference_times)
    reference_weights /= reference_weights.sum(1, keepdim=True)
    assert torch.allclose(routing.topk_weights.double().mean(0), reference_weights.mean(0), atol=2e-3)


SMALL_GROUPS = ModelConfig("small-groups", hidden=64, num_experts=64, topk=8, n_group=16, topk_group=4)


def test_groups_smaller_than_topk_match_the_full_score_matrix():
    # Groups of 4 < k = 8: a kept group can run out of experts while the token still selects.
    cfg = config(model=SMALL_GROUPS, skew="zipf:1.5", world=4, tokens=20000, seed=2)
    ours = route_rank(cfg, 0).topk_ids
    weights = torch.tensor(expert_popularity(cfg).weights)
    exps = torch.from_numpy(np.random.default_rng(9).standard_exponential((20000, 64)))
    experts = torch.arange(64).view(1, 16, 4).expand(20000, -1, -1)
    _, reference = select_from_groups((exps / weights).view(20000, 16, 4), experts, SMALL_GROUPS)
    ours_load = torch.bincount(ours.view(-1), minlength=64).double()
    theirs = torch.bincount(reference.reshape(-1), minlength=64).double()
    used = (ours_load + theirs) > 0
    chi2 = float((((ours_load - theirs) ** 2) / (ours_load + theirs).clamp(min=1))[used].sum())
    dof = int(used.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5


def test_exhausted_group_is_never_selected_again():
    # Steep skew: an exhausted group's phantom next arrival (from the rounding residue of its remaining
    # weight) used to beat the real, very late arrivals of cold experts and selected past the group's end.
    cfg = config(model=SMALL_GROUPS, skew="zipf:30", world=4, tokens=4096)
    ids = route_rank(cfg, 0).topk_ids
    ordered = ids.sort(dim=1).values
    assert int(ordered[:, 0].min()) >= 0 and (ordered[:, 1:] != ordered[:, :-1]).all()
    assert int(group_span(ids, 4).max()) <= 4


def test_masking_rate():
    cfg = config(skew="zipf:1.2", tokens=4096, mask_ratio=0.3)
    routing = route_rank(cfg, 1)
    assert_valid(routing, cfg)
    assert abs(float((routing.topk_ids < 0).float().mean()) - 0.3) < 0.015
    # Masking drops selections and leaves the rest of the routing as it was.
    unmasked = route_rank(config(skew="zipf:1.2", tokens=4096), 1)
    kept = routing.topk_ids >= 0
    assert torch.equal(routing.topk_ids[kept], unmasked.topk_ids[kept])


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_never_exceeded_first_come(factor):
    cfg = config(skew="hot:4:0.3", tokens=2048, capacity_factor=factor)
    assert cfg.capacity == int(np.ceil(2048 * 8 / 256 * factor))
    routing = route_rank(cfg, 2)
    assert_valid(routing, cfg)
    uncapped = route_rank(config(skew="hot:4:0.3", tokens=2048), 2).topk_ids
    load = torch.bincount(routing.topk_ids[routing.topk_ids >= 0], minlength=256)
    assert int(load.max()) <= cfg.capacity
    dropped = (routing.topk_ids < 0) & (uncapped >= 0)
    assert dropped.any()
    for expert in uncapped[dropped].unique().tolist():
        # The expert is full, and every token that kept it comes before every token that lost it.
        assert int(load[expert]) == cfg.capacity
        kept_tokens = (routing.topk_ids == expert).any(1).nonzero().view(-1)
        lost_tokens = ((uncapped == expert) & dropped).any(1).nonzero().view(-1)
        assert int(kept_tokens.max()) < int(lost_tokens.min())


def test_capacity_rounding():
    assert config(tokens=1000, capacity_factor=1.28).capacity == 40  # 1000 * 8 / 256 * 1.28 = 40 exactly
    assert config(tokens=1000, capacity_factor=1.3).capacity == 41


def test_deterministic_per_seed_and_rank():
    cfg = config(skew="zipf:1.2", tokens=1024, seed=7)
    first, again = route_rank(cfg, 5), route_rank(cfg, 5)
    assert torch.equal(first.topk_ids, again.topk_ids) and torch.equal(first.topk_weights, again.topk_weights)
    assert not torch.equal(first.topk_ids, route_rank(cfg, 4).topk_ids)
    assert not torch.equal(
        first.topk_ids, route_rank(config(skew="zipf:1.2", tokens=1024, seed=8), 5).topk_ids
    )


def _digest(routing) -> str:
    return hashlib.sha256(
        routing.topk_ids.numpy().tobytes() + routing.topk_weights.numpy().tobytes()
    ).hexdigest()


def test_same_routing_in_another_process():
    script = (
        "from commbench.inputs.models import load_model; from commbench.inputs.skew import parse_skew;"
        "from commbench.traffic.routing import RoutingConfig, route_rank; import hashlib;"
        "model = load_model('qwen3-30b-a3b');"
        "r = route_rank(RoutingConfig(model, parse_skew('hot:4:0.3'), 8, 512, seed=3), 6);"
        "print(hashlib.sha256(r.topk_ids.numpy().tobytes() + r.topk_weights.numpy().tobytes()).hexdigest())"
    )
    # A fresh process with a minimal environment: what other tests leave in this process's environment
    # (ranks' variables, thread settings) must not decide what is compared.
    env = {key: os.environ[key] for key in ("PATH", "HOME", "PYTHONPATH") if key in os.environ}
    other = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env, cwd=REPO
    )
    assert other.stdout.strip() == _digest(
        route_rank(config(model=QWEN, skew="hot:4:0.3", tokens=512, seed=3), 6)
    ), other.stderr


def test_popularity_is_global_across_ranks():
    cfg = config(skew="zipf:1.5", tokens=4096)
    hottest = expert_popularity(cfg).hot_experts[0]
    top_sets = []
    for rank in (0, 5):
        load = torch.bincount(route_rank(cfg, rank).topk_ids.view(-1), minlength=256)
        top_sets.append(set(load.topk(5).indices.tolist()))
        assert hottest in top_sets[-1]
    assert top_sets[0] == top_sets[1]


def _hot_share(cfg) -> float:
    hot = torch.tensor(expert_popularity(cfg).hot_experts)
    total = hot_total = 0
    for rank in range(cfg.world_size):
        ids = route_rank(cfg, rank).topk_ids
        total += ids.numel()
        hot_total += int(torch.isin(ids, hot).sum())
    return hot_total / total


@pytest.mark.parametrize(
    "model, skew, world, target",
    [
        (DEEPSEEK, "hot:4:0.3", 8, 0.3),  # at most 4 of a token's 8 picks can be hot: naive weights miss
        (DEEPSEEK, "hot:16:0.7", 8, 0.7),
        (QWEN, "hot:2:0.2", 4, 0.2),
        (MIXTRAL, "hot:1:0.45", 2, 0.45),
    ],
)
def test_hot_share_hits_target(model, skew, world, target):
    cfg = config(model=model, skew=skew, world=world, tokens=2048)
    assert abs(_hot_share(cfg) / target - 1) < 0.03


@pytest.mark.parametrize(
    "model, world, ratio, tokens",
    [(DEEPSEEK, 8, 3.0, 2048), (DEEPSEEK, 16, 2.0, 1024), (MIXTRAL, 4, 2.0, 4096), (QWEN, 8, 4.0, 2048)],
)
def test_rank_imbalance_ratio_hits_target(model, world, ratio, tokens):
    cfg = config(model=model, skew=f"rank-imbalance:{ratio}", world=world, tokens=tokens)
    popularity = expert_popularity(cfg)
    received = torch.zeros(world)
    for rank in range(world):
        ids = route_rank(cfg, rank).topk_ids
        received += torch.bincount(expert_rank(ids, model.num_experts, world).view(-1), minlength=world)
    others = torch.cat([received[: popularity.hot_rank], received[popularity.hot_rank + 1 :]])
    assert abs(float(received[popularity.hot_rank] / others.mean()) / ratio - 1) < 0.04
    assert int(received.argmax()) == popularity.hot_rank


@pytest.mark.parametrize("model, skew, hot_per_token", [(QWEN, "hot:2:0.25", 2), (MIXTRAL, "hot:7:0.5", 1)])
def test_targets_at_the_limit(model, skew, hot_per_token):
    """F = N / k: every token takes every hot expert; F at the minimum: every token takes all cold ones."""
    cfg = config(model=model, skew=skew, world=2, tokens=512)
    hot = torch.tensor(expert_popularity(cfg).hot_experts)
    ids = route_rank(cfg, 1).topk_ids
    assert (torch.isin(ids, hot).sum(1) == hot_per_token).all()


def test_hot_rank_is_drawn_from_the_seed():
    ranks = {
        expert_popularity(config(model=QWEN, skew="rank-imbalance:2", seed=seed)).hot_rank
        for seed in range(8)
    }
    assert len(ranks) > 1


@pytest.mark.parametrize(
    "model, skew, world, words",
    [
        (DEEPSEEK, "hot:4:0.6", 8, "F can be at most 0.5"),
        (MIXTRAL, "hot:7:0.3", 2, "F must be at least 0.5"),
        (DEEPSEEK, "rank-imbalance:100", 64, "R can be at most 63"),
        (DEEPSEEK, "rank-imbalance:2", 1, "world size of at least 2"),
        (DEEPSEEK, "hot:300:0.5", 8, "only 256 experts"),
    ],
)
def test_infeasible_targets(model, skew, world, words):
    with pytest.raises(UsageError) as info:
        expert_popularity(config(model=model, skew=skew, world=world))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_steepest_zipf_keeps_experts_distinct():
    # Past the limit the coldest weights underflow to 0 and a token would repeat experts.
    with pytest.raises(UsageError, match="S can be at most 83") as info:
        route_rank(config(skew="zipf:1000", tokens=64), 0)
    assert "\n" not in str(info.value)
    for model, skew in ((DEEPSEEK, "zipf:83"), (QWEN, "zipf:94")):
        ids = route_rank(config(model=model, skew=skew, tokens=512), 0).topk_ids
        ordered = ids.sort(dim=1).values
        assert int(ordered[:, 0].min()) >= 0 and (ordered[:, 1:] != ordered[:, :-1]).all()


def test_trace_replay(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((10, 8)), axis=1)[:, :2]
    weights = rng.random((10, 2)).astype(np.float32) + 0.1
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=ids, topk_weights=weights)
    cfg = config(model=MIXTRAL, skew=f"trace:{path}", world=2, tokens=4)
    first, second = route_rank(cfg, 0), route_rank(cfg, 1)
    assert first.topk_ids.tolist() == ids[:4].tolist()
    assert second.topk_ids.tolist() == ids[4:8].tolist()
    expected = weights[:4] / weights[:4].sum(1, keepdims=True)
    assert np.allclose(first.topk_weights.numpy(), expected, atol=1e-6)
    # Ranks past the end of the trace wrap around.
    wrapped = route_rank(config(model=MIXTRAL, skew=f"trace:{path}", world=4, tokens=4), 2)
    assert wrapped.topk_ids.tolist() == ids[[8, 9, 0, 1]].tolist()


def test_a_traces_dropped_selections_move_nothing_and_weigh_nothing(tmp_path):
    """-1 in a trace (a dropped selection, as DeepEP's topk_idx and the mask/capacity paths): the id stays
    -1, its weight 0, and the token's kept weights still sum to 1."""
    ids = np.array([[0, 3], [-1, 6], [-1, -1], [2, 5]])
    weights = np.array([[1, 3], [5, 1], [2, 2], [1, 1]], dtype=np.float32)
    path = tmp_path / "dropped.npz"
    np.savez(path, topk_ids=ids, topk_weights=weights)
    cfg = config(model=MIXTRAL, skew=f"trace:{path}", world=2, tokens=4)
    routing = route_rank(cfg, 0)
    assert_valid(routing, cfg)
    assert routing.topk_ids.tolist() == ids.tolist()
    assert routing.topk_weights[1].tolist() == [0.0, 1.0] and routing.topk_weights[2].tolist() == [0, 0]


def test_parquet_trace_without_weights_and_masking(tmp_path):
    ids = np.tile(np.array([[3, 0], [1, 6]]), (50, 1))
    path = tmp_path / "trace.parquet"
    pq.write_table(pa.table({"topk_ids": list(ids.tolist())}), path)
    cfg = config(model=MIXTRAL, skew=f"trace:{path}", world=2, tokens=100, mask_ratio=0.25)
    routing = route_rank(cfg, 1)
    assert_valid(routing, cfg)
    kept = routing.topk_ids >= 0
    assert torch.equal(routing.topk_ids[kept], torch.from_numpy(ids)[kept])
    both = kept.all(1)
    assert torch.allclose(routing.topk_weights[both], torch.full((int(both.sum()), 2), 0.5))


def test_trace_problems_surface_at_routing(tmp_path):
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=np.array([[0, 1, 2]]))
    with pytest.raises(UsageError, match=r"shape \[1, 3\]; the model needs \[tokens, 2\]"):
        route_rank(config(model=MIXTRAL, skew=f"trace:{path}", world=2, tokens=4), 0)
    with pytest.raises(UsageError, match="not found"):
        route_rank(config(model=MIXTRAL, skew=f"trace:{tmp_path / 'absent.npz'}", world=2, tokens=4), 0)


def test_chunking_keeps_capacity_and_masking_in_token_order(tmp_path, monkeypatch):
    ids = np.tile(np.array([[0, 1], [2, 0], [1, 3]]), (400, 1))
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=ids)
    cfg = config(
        model=MIXTRAL, skew=f"trace:{path}", world=2, tokens=1200, mask_ratio=0.2, capacity_factor=0.9
    )
    whole = route_rank(cfg, 0)
    monkeypatch.setattr(routing_module, "CHUNK_TOKENS", 128)
    chunked = route_rank(cfg, 0)
    assert torch.equal(whole.topk_ids, chunked.topk_ids) and torch.equal(
        whole.topk_weights, chunked.topk_weights
    )
    load = torch.bincount(chunked.topk_ids[chunked.topk_ids >= 0], minlength=8)
    assert int(load.max()) == cfg.capacity == 270
