import math

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.fabric.budget import (
    RECORD_TFLOPS,
    busiest_rank_selections,
    check_tflops,
    compute_time_us,
    expert_flops,
    make_budget,
    simulated_budgets,
    throughputs,
)
from commbench.fabric.ep_groups import grouped_pattern, simulate
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.skew import parse_skew
from commbench.inputs.specs import load_spec, no_spec
from commbench.traffic.pattern import build_pattern
from commbench.traffic.routing import RoutingConfig, route_rank

DEEPSEEK = load_model("deepseek-v3")
# 4096 tokens x top-8 spread evenly: what each rank's experts receive on average.
MEAN_SELECTIONS = 4096 * 8
# By hand: 2 FLOPs x 3 matmuls x 7168 x 2048 = 88,080,384 FLOPs per selection.
FORWARD_FLOPS = 88_080_384 * MEAN_SELECTIONS  # 2,886,218,022,912
FORWARD_US = FORWARD_FLOPS / 1648e12 * 1e6  # 1,751.35 us at the record


def test_deepseek_v3_expert_flops_by_hand():
    assert DEEPSEEK.hidden == 7168 and DEEPSEEK.moe_intermediate == 2048
    assert expert_flops(DEEPSEEK, MEAN_SELECTIONS) == 2_886_218_022_912
    assert expert_flops(DEEPSEEK, MEAN_SELECTIONS, training=True) == 3 * 2_886_218_022_912
    assert expert_flops(DEEPSEEK, 1) == 2 * 3 * 7168 * 2048
    assert expert_flops(DEEPSEEK, 0) == 0.0
    per_rank = expert_flops(DEEPSEEK, np.array([1, 10, 100]))  # vectorized over ranks
    assert per_rank.tolist() == [88_080_384.0, 880_803_840.0, 8_808_038_400.0]


def test_compute_time_at_the_record_and_at_a_peak():
    assert compute_time_us(FORWARD_FLOPS, RECORD_TFLOPS) == pytest.approx(1751.346, abs=1e-3)
    assert compute_time_us(1e12, 1000) == pytest.approx(1000.0)  # 1 TFLOP at 1 PFLOP/s: 1 ms
    peak = load_spec("gb300-nvl72").dense_tflops_bf16
    assert compute_time_us(FORWARD_FLOPS, peak) == pytest.approx(FORWARD_FLOPS / 2500e6)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, 2e6])
def test_bad_tflops_is_refused(bad):
    with pytest.raises(UsageError, match="--tflops"):
        check_tflops(bad)
    with pytest.raises(UsageError, match="--tflops"):
        make_budget(DEEPSEEK, 10, 1.0, tflops=bad)


def test_a_model_without_moe_intermediate_is_not_computed():
    bare = ModelConfig("my-model", hidden=1024, num_experts=16, topk=2)
    assert bare.moe_intermediate is None
    with pytest.raises(UsageError, match="not computed: no moe_intermediate"):
        expert_flops(bare, 100)
    budget = make_budget(bare, 100, 50.0)
    assert not budget.computed and budget.rows == ()
    assert "not computed: no moe_intermediate in model my-model" in budget.verdict()


def test_busiest_rank_selections_of_a_hand_matrix():
    # [src][dst]: rank 1's experts receive 1 + 5 = 6 selections, rank 0's 3 + 2 = 5.
    assert busiest_rank_selections(np.array([[3, 1], [2, 5]])) == 6
    # [group, src, dst]: the busiest rank of any group (group 1, rank 0: 7 + 4).
    grouped = np.array([[[1, 1], [1, 1]], [[7, 0], [4, 0]]])
    assert busiest_rank_selections(grouped) == 11
    with pytest.raises(ValueError, match="square"):
        busiest_rank_selections(np.ones((2, 3)))


def test_busiest_rank_selections_of_a_small_pattern_count_selections_not_rows():
    model = ModelConfig("small", hidden=64, num_experts=8, topk=4, moe_intermediate=128)
    cfg = RoutingConfig(model=model, skew=parse_skew("zipf:1.2"), world_size=2, tokens_per_rank=64, seed=3)
    pattern = build_pattern(cfg, send_mode="token")
    # By hand: every rank's routed (token, expert) pairs, each counted on the rank holding the expert.
    received = np.zeros(2, dtype=np.int64)
    for rank in range(2):
        ids = route_rank(cfg, rank).topk_ids.numpy().ravel()
        received += np.bincount(ids[ids >= 0] // 4, minlength=2)
    assert busiest_rank_selections(pattern.dispatch_selections) == received.max()
    # Token mode sends a token once per rank: its rows undercount the experts' work.
    assert pattern.dispatch_tokens.sum(0).max() < received.max()
    assert received.max() == pattern.stats["rank_recv_selections_max"]


def test_hide_criterion_both_ways_forward():
    hides = make_budget(DEEPSEEK, MEAN_SELECTIONS, comm_us=FORWARD_US * 0.99)
    exposed = make_budget(DEEPSEEK, MEAN_SELECTIONS, comm_us=FORWARD_US * 1.01)
    assert hides.row("forward").hides and hides.row("forward").ratio == pytest.approx(0.99)
    assert not exposed.row("forward").hides and exposed.row("forward").ratio == pytest.approx(1.01)
    assert "forward hides it" in hides.verdict() and "forward cannot hide it" in exposed.verdict()


def test_training_counts_three_forwards_of_compute_against_two_all_to_alls():
    # 1.2 x the forward compute: exposed in a forward pass, hidden in training (2 x 1.2 / 3 = 0.8).
    budget = make_budget(DEEPSEEK, MEAN_SELECTIONS, comm_us=FORWARD_US * 1.2)
    forward, training = budget.row("forward"), budget.row("training")
    assert training.compute_us == pytest.approx(3 * forward.compute_us)
    assert training.comm_us == pytest.approx(2 * forward.comm_us)
    assert forward.ratio == pytest.approx(1.2) and training.ratio == pytest.approx(0.8)
    assert not forward.hides and training.hides
    assert "training hides it" in budget.verdict() and "forward cannot hide it" in budget.verdict()
    # Twice the compute of training: exposed both ways.
    slow = make_budget(DEEPSEEK, MEAN_SELECTIONS, comm_us=FORWARD_US * 2)
    assert not slow.row("training").hides and slow.row("training").ratio == pytest.approx(4 / 3)


def test_throughputs_add_the_spec_dense_peaks():
    spec = load_spec("hgx-h100")
    speeds = throughputs(800, spec)
    assert [s.tflops for s in speeds] == [800, 989.5, 1979]
    assert speeds[0].label == "--tflops" and "dense FP8 peak" in speeds[2].label
    assert throughputs(spec=None)[0].label == "--tflops (record, delivered)"
    assert len(throughputs(RECORD_TFLOPS, no_spec("CPU run"))) == 1  # no figures: --tflops only
    budget = make_budget(DEEPSEEK, MEAN_SELECTIONS, 1000.0, 800, spec)
    assert len(budget.rows) == 6  # 3 throughputs x forward, training
    fp8 = budget.row("forward", 2)
    assert fp8.compute_us == pytest.approx(FORWARD_FLOPS / 1979e6)


def test_simulated_budgets_use_the_simulated_traffic_and_time():
    model = load_model("qwen3-30b-a3b")
    inputs = {"tokens_per_rank": 128, "skew": "zipf:1.2", "seed": 5, "sample_tokens": 512}
    simulation = simulate(model, [8, 16], "hgx-h100", **inputs)
    budgets = simulated_budgets(model, simulation, 500.0, "hgx-h100", ranks_per_domain=None, **inputs)
    assert [world for world, _ in budgets] == [8, 16]
    totals = {row["ranks"]: row["time_us"] for row in simulation.rows if row["phase"] == "total"}
    for world, budget in budgets:
        pattern = grouped_pattern(model, world, **inputs)
        assert budget.selections == busiest_rank_selections(pattern.dispatch_selections)
        assert budget.comm_us == totals[world]
        assert budget.row("forward").ratio == pytest.approx(
            totals[world] / compute_time_us(expert_flops(model, budget.selections), 500.0)
        )
