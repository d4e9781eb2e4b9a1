"""EP-group traffic at scale: expert placement, exact and sampled builds, and simulate's rows."""

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.fabric.ep_groups import expert_owner, grouped_pattern, simulate
from commbench.fabric.model import make_fabric, predict_phase
from commbench.inputs.skew import parse_skew
from commbench.traffic.nodes import Nodes
from commbench.traffic.pattern import build_pattern
from commbench.traffic.routing import RoutingConfig


def test_expert_owner():
    assert expert_owner(256, 64).tolist() == (np.arange(256) // 4).tolist()
    uneven = expert_owner(256, 72)
    counts = np.bincount(uneven)
    assert counts.size == 72 and set(counts.tolist()) == {3, 4} and counts.sum() == 256
    assert np.all(np.diff(uneven) >= 0)  # contiguous
    with pytest.raises(UsageError, match="between 1 and"):
        expert_owner(8, 16)


def test_exact_grouped_pattern_invariants():
    pattern = grouped_pattern("qwen3-30b-a3b", 16, tokens_per_rank=64, ep_size=8, exact=True)
    assert pattern.dispatch_tokens.shape == (2, 8, 8) and pattern.num_groups == 2
    assert np.all(pattern.dispatch_selections.sum(2) == 64 * 8)  # every token selects top-8, none dropped
    assert np.all(pattern.dispatch_selections >= pattern.dispatch_tokens)
    row = pattern.model.combine_bytes_per_token
    assert np.array_equal(pattern.combine_bytes[1], pattern.dispatch_tokens[1].T * row)
    one_expert_each = grouped_pattern("mixtral-8x22b", 8, tokens_per_rank=32, exact=True)
    assert np.array_equal(one_expert_each.dispatch_tokens, one_expert_each.dispatch_selections)


def test_an_exact_ep_group_moves_what_a_run_of_its_ranks_moves():
    pattern = grouped_pattern("qwen3-30b-a3b", 16, tokens_per_rank=64, skew="zipf:1.2", ep_size=8, exact=True)
    for group in range(2):  # group g routes like an 8-rank run with seed g
        cfg = RoutingConfig(
            pattern.model, parse_skew("zipf:1.2"), world_size=8, tokens_per_rank=64, seed=group
        )
        run = build_pattern(cfg, "token")
        assert np.array_equal(pattern.dispatch_tokens[group], run.dispatch_tokens)
        assert np.array_equal(pattern.dispatch_selections[group], run.dispatch_selections)


def test_exact_uneven_placement_counts_every_selection():
    pattern = grouped_pattern("deepseek-v3", 144, tokens_per_rank=16, ep_size=72, exact=True)
    assert pattern.dispatch_tokens.shape == (2, 72, 72)
    assert np.all(pattern.dispatch_selections.sum(2) == 16 * 8)  # 256 experts on 72 ranks: nothing lost
    assert np.all(pattern.dispatch_tokens <= 16) and np.all(pattern.dispatch_tokens.sum(2) >= 16)


def test_sampled_fast_path_matches_the_exact_build():
    kwargs = {"tokens_per_rank": 512, "seed": 1}
    fabric = make_fabric("gb300-nvl72", 32, ranks_per_domain=8)
    exact = grouped_pattern("deepseek-v3", 32, exact=True, **kwargs)
    fast = grouped_pattern("deepseek-v3", 32, exact=False, **kwargs)
    assert fast.method == "sampled" and exact.method == "exact"
    assert fast.dispatch_bytes.sum() == pytest.approx(exact.dispatch_bytes.sum(), rel=0.01)
    for phase in ("dispatch_bytes", "combine_bytes"):
        t_fast = predict_phase(getattr(fast, phase), fabric).time_s
        t_exact = predict_phase(getattr(exact, phase), fabric).time_s
        assert t_fast == pytest.approx(t_exact, rel=0.03)


def test_grouped_pattern_bad_sizes():
    with pytest.raises(UsageError, match="do not split into EP groups"):
        grouped_pattern("deepseek-v3", 300, tokens_per_rank=16)
    with pytest.raises(UsageError, match="between 1 and"):
        grouped_pattern("qwen3-30b-a3b", 256, tokens_per_rank=16, ep_size=256)


def test_simulate_rows_and_efficiency():
    result = simulate("qwen3-30b-a3b", [16, 8], spec="hgx-h100", tokens_per_rank=256, sample_tokens=1024)
    assert [r["ranks"] for r in result.rows] == [8, 8, 8, 16, 16, 16]
    first = [r for r in result.rows if r["ranks"] == 8]
    assert all(r["scaling_efficiency"] == 1.0 for r in first)
    dispatch16 = next(r for r in result.rows if r["ranks"] == 16 and r["phase"] == "dispatch")
    assert "scale-out" in dispatch16["bottleneck"]  # two HGX servers: the NIC limits
    assert dispatch16["scaling_efficiency"] < 1.0 and dispatch16["scaleout_bytes_per_gpu"] > 0
    total16 = next(r for r in result.rows if r["ranks"] == 16 and r["phase"] == "total")
    combine16 = next(r for r in result.rows if r["ranks"] == 16 and r["phase"] == "combine")
    assert total16["time_us"] == pytest.approx(dispatch16["time_us"] + combine16["time_us"])
    assert any("spans 2 NVLink domains" in note for note in result.notes)


def test_exact_node_mode_group_moves_what_a_node_mode_run_of_its_ranks_moves():
    domains = make_fabric("hgx-h100", 16, ranks_per_domain=4).layout.domain_of_rank
    kwargs = {"tokens_per_rank": 64, "skew": "zipf:1.2", "ep_size": 8, "exact": True}
    pattern = grouped_pattern("qwen3-30b-a3b", 16, send_mode="node", domain_of_rank=domains, **kwargs)
    token = grouped_pattern("qwen3-30b-a3b", 16, **kwargs)
    assert np.array_equal(pattern.dispatch_selections, token.dispatch_selections)  # the same routing
    row = pattern.model.dispatch_bytes_per_token
    for group in range(2):
        cfg = RoutingConfig(
            pattern.model, parse_skew("zipf:1.2"), world_size=8, tokens_per_rank=64, seed=group
        )
        run = build_pattern(cfg, "node", Nodes.contiguous(8, 4))
        for stage in ("scaleout", "nvlink"):
            assert np.array_equal(pattern.stage_rows[stage][group] * row, run.stages["dispatch"][stage])
        assert np.array_equal(pattern.dispatch_bytes[group], run.dispatch_bytes)
        assert np.array_equal(pattern.combine_bytes[group], run.combine_bytes)
    with pytest.raises(UsageError, match="NVLink domain"):
        grouped_pattern("qwen3-30b-a3b", 16, send_mode="node", **kwargs)


def test_sampled_node_mode_matches_the_exact_build_and_crosses_fewer_nic_bytes():
    fabric = make_fabric("hgx-h100", 32, ranks_per_domain=8)
    kwargs = {
        "tokens_per_rank": 512,
        "seed": 1,
        "send_mode": "node",
        "domain_of_rank": fabric.layout.domain_of_rank,
    }
    exact = grouped_pattern("deepseek-v3", 32, exact=True, **kwargs)
    fast = grouped_pattern("deepseek-v3", 32, exact=False, **kwargs)
    flat = grouped_pattern("deepseek-v3", 32, exact=True, tokens_per_rank=512, seed=1)
    for stage in ("scaleout", "nvlink"):
        assert fast.stage_rows[stage].sum() == pytest.approx(exact.stage_rows[stage].sum(), rel=0.02)
    for phase in ("dispatch_bytes", "combine_bytes"):
        t_fast = predict_phase(getattr(fast, phase), fabric).time_s
        t_exact = predict_phase(getattr(exact, phase), fabric).time_s
        assert t_fast == pytest.approx(t_exact, rel=0.03)
        node, token = (
            predict_phase(getattr(exact, phase), fabric),
            predict_phase(getattr(flat, phase), fabric),
        )
        assert node.scaleout_bytes < token.scaleout_bytes and node.time_s < token.time_s


def test_simulate_node_mode_uses_the_node_patterns_bytes():
    args = {"spec": "hgx-h100", "tokens_per_rank": 256, "sample_tokens": 1024}
    token = simulate("qwen3-30b-a3b", [16], **args)
    node = simulate("qwen3-30b-a3b", [16], send_mode="node", **args)
    flat, hier = (next(r for r in s.rows if r["phase"] == "dispatch") for s in (token, node))
    assert (
        hier["scaleout_bytes_per_gpu"] < flat["scaleout_bytes_per_gpu"] and hier["time_us"] < flat["time_us"]
    )
    assert "node mode" in node.notes[0]


def test_simulate_node_mode_on_nccl_runs_its_stages_in_sequence_and_gpu_kernels_pipeline_them():
    # nccl: two all-to-all(v)s, one after the other (as commbench run executes node mode), each with its own
    # fixed time: the phase is the sum of its stage rows; a GPU-initiated normal kernel pipelines the stages
    # (one phase, both stages' bytes at once, no stage rows). A group inside one node runs no scale-out stage.
    args = {"spec": "hgx-h100", "tokens_per_rank": 256, "sample_tokens": 1024, "send_mode": "node"}
    nccl = simulate("qwen3-30b-a3b", [8, 16], **args)
    rows = {(r["ranks"], r["phase"]): r for r in nccl.rows}
    for phase, stages in (("dispatch", ("scaleout", "nvlink")), ("combine", ("nvlink", "scaleout"))):
        parts = [rows[(16, f"{phase}:{stage}")]["time_us"] for stage in stages]
        assert rows[(16, phase)]["time_us"] == pytest.approx(sum(parts))
        assert (8, f"{phase}:scaleout") not in rows and (8, f"{phase}:nvlink") in rows
        assert rows[(8, phase)]["time_us"] == pytest.approx(rows[(8, f"{phase}:nvlink")]["time_us"])
    assert "two stages in sequence" in nccl.notes[1]
    normal = simulate("qwen3-30b-a3b", [16], kernel="normal", **args)
    assert [r["phase"] for r in normal.rows] == ["dispatch", "combine", "total"]
    assert "pipelined" in normal.notes[0]
    flat = simulate("qwen3-30b-a3b", [16], **{**args, "send_mode": "token"})
    dispatch = next(r for r in flat.rows if r["phase"] == "dispatch")
    assert rows[(16, "dispatch")]["scaleout_bytes_per_gpu"] < dispatch["scaleout_bytes_per_gpu"]
