"""Node mode's plans (traffic.node_plan): both stages emulated in one process, every rank's rows and combine
output checked against what the plans say and against token mode."""

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.traffic.node_plan import (
    NODE_COMBINE_RTOL,
    check_uniform,
    expected_stage_rows,
    group_ranks,
    node_plans,
    stage_combine_reference,
)
from commbench.traffic.nodes import Nodes
from commbench.traffic.pattern import build_pattern
from commbench.traffic.payload import (
    CombineCheck,
    count_wrong_rows,
    decode_header,
    encode_rows,
    expected_combine,
    expected_rows,
    expert_outputs,
)
from commbench.traffic.plan import plan_rank
from commbench.traffic.routing import RoutingConfig, route_rank

SMALL = ModelConfig(name="small", hidden=32, num_experts=16, topk=4, dispatch_dtype="bf16")
WORLD = 8


def _all_to_all(nodes, stage, plans, inputs):
    """Every rank's received rows of one stage: its group members' send segments to it, in group order."""
    out = []
    for rank in range(WORLD):
        parts = []
        for member in group_ranks(nodes, rank, stage):
            plan = getattr(plans[member], stage)
            me = group_ranks(nodes, member, stage).index(rank)
            parts.append(inputs[member][plan.send_token_index[plan.segment(me)]])
        out.append(torch.cat(parts))
    return out


def _count(plans, nodes, stage, src, dst):
    plan = getattr(plans[src], stage)
    return int(plan.send_counts[group_ranks(nodes, src, stage).index(dst)].sum())


def _return_rows(nodes, stage, plans, rows):
    """Combine backwards: each rank's ``rows`` (one per row it received) back to their senders; a sender
    gets them in its send order (destinations in group order)."""
    back = []
    for rank in range(WORLD):
        parts = []
        for dest in group_ranks(nodes, rank, stage):
            before = group_ranks(nodes, dest, stage)  # the order ``dest`` received its sources in
            start = sum(_count(plans, nodes, stage, m, dest) for m in before[: before.index(rank)])
            parts.append(rows[dest][start : start + _count(plans, nodes, stage, rank, dest)])
        back.append(torch.cat(parts))
    return back


def _reduce(plan, rows):
    out = torch.zeros(plan.num_tokens, rows.shape[1], dtype=torch.float32)
    out.index_add_(0, plan.send_token_index, rows.float() * plan.combine_weight.unsqueeze(1))
    return out


@pytest.mark.parametrize("per_node", [2, 4])
def test_both_stages_deliver_token_modes_rows_and_combine(per_node):
    cfg = RoutingConfig(SMALL, parse_skew("zipf:1.2"), WORLD, 40, seed=2, mask_ratio=0.1)
    nodes = Nodes.contiguous(WORLD, per_node)
    tokens = [plan_rank(route_rank(cfg, r), SMALL, WORLD, "token") for r in range(WORLD)]
    plans = node_plans(tokens, nodes)
    row = SMALL.dispatch_bytes_per_token
    own = [encode_rows(r, torch.arange(plans[r].token.num_tokens), row) for r in range(WORLD)]
    # Stage 1 (scale-out), then stage 2 (NVLink) on [own tokens; what stage 1 delivered].
    first = _all_to_all(nodes, "scaleout", plans, own)
    inputs = [torch.cat([own[r], first[r]]) for r in range(WORLD)]
    second = _all_to_all(nodes, "nvlink", plans, inputs)
    for rank in range(WORLD):
        assert count_wrong_rows(first[rank], expected_stage_rows(plans, nodes, rank, "scaleout")) == 0
        assert count_wrong_rows(second[rank], expected_stage_rows(plans, nodes, rank, "nvlink")) == 0
        # In the end a rank holds exactly token mode's rows (in another order).
        final = sorted(map(tuple, torch.stack(decode_header(second[rank]), 1).tolist()))
        flat = sorted(map(tuple, torch.stack(decode_header(expected_rows(tokens, rank)), 1).tolist()))
        assert final == flat
    # The stage plans' counts are the Pattern's stage matrices.
    pattern = build_pattern(cfg, "node", nodes)
    for stage in ("scaleout", "nvlink"):
        moved = np.zeros((WORLD, WORLD), dtype=np.int64)
        for rank in range(WORLD):
            for j, member in enumerate(group_ranks(nodes, rank, stage)):
                moved[rank, member] = int(getattr(plans[rank], stage).send_counts[j].sum())
        assert np.array_equal(moved * row, pattern.stages["dispatch"][stage])
    # Combine: expert outputs of what arrived, stage 2 backwards (reduced per input row), the forwarded
    # partials in bf16 back over stage 1 (added per token), plus the own node's partial.
    outputs = [expert_outputs(*decode_header(second[r]), r, SMALL.hidden) for r in range(WORLD)]
    returned = _return_rows(nodes, "nvlink", plans, outputs)
    partial = [_reduce(plans[r].nvlink, returned[r]) for r in range(WORLD)]
    for rank in range(WORLD):
        check = CombineCheck(*stage_combine_reference(plans[rank], nodes, "nvlink", SMALL.hidden))
        assert check.full(partial[rank]) == 0
    forwarded = [partial[r][plans[r].token.num_tokens :].to(torch.bfloat16) for r in range(WORLD)]
    back = _return_rows(nodes, "scaleout", plans, forwarded)
    for rank in range(WORLD):
        plan = plans[rank]
        remote = _reduce(plan.scaleout, back[rank])
        check = CombineCheck(*stage_combine_reference(plan, nodes, "scaleout", SMALL.hidden))
        assert check.full(remote) == 0
        out = remote + partial[rank][: plan.token.num_tokens]
        # Token mode's reference, within the bf16 rounding of the forwarded partials.
        assert CombineCheck(*expected_combine(plan.token, SMALL.hidden, NODE_COMBINE_RTOL)).full(out) == 0
        if plan.scaleout.num_send_rows:  # the other nodes' partials missing: caught
            own_only = partial[rank][: plan.token.num_tokens]
            assert CombineCheck(*stage_combine_reference(plan, nodes, None, SMALL.hidden)).full(own_only) > 0


def test_stage_one_needs_equal_nodes():
    with pytest.raises(UsageError, match="same number of ranks"):
        check_uniform(Nodes.of(np.array([0, 0, 0, 1])))
    cfg = RoutingConfig(SMALL, parse_skew("uniform"), 4, 8)
    tokens = [plan_rank(route_rank(cfg, r), SMALL, 4, "token") for r in range(4)]
    with pytest.raises(UsageError, match="--ranks-per-domain"):
        node_plans(tokens, Nodes.of(np.array([0, 0, 0, 1])))
