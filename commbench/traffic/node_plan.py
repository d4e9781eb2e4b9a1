"""Node mode's per-rank layouts (``--send-mode node``, ``traffic.nodes``): each rank's plan of both stages,
what it must receive in each, and each stage's combine reference.

Both stages are laid out from token mode's plans (``traffic.plan``: a row per (token, destination rank),
weight = the token's gates on that rank's experts), so node mode delivers exactly token mode's rows:

- stage 1 (scale-out), on the rank's local-index group (one rank per node, group rank = node id): a row per
  (token, other node it reaches), grouped by node, tokens ascending; weight 1 (combine adds the nodes up);
- stage 2 (NVLink), on the rank's node (group rank = local index): its input rows are its own tokens, then
  the stage-1 rows it received (sources in node order, each source's tokens ascending, as the all-to-all
  delivers them); a row per (input row, destination rank of this node holding the token's experts), grouped
  by destination, input rows ascending; weight and key as token mode's row (key = the destination rank).

A forwarded row keeps its origin's header (src, token), so every stage's rows are checked byte for byte
against ``traffic.payload.encode_rows``. Combine runs stage 2 backwards (each rank's expert outputs back to
the rank that handed it the row, reduced per input row in float32), then stage 1 backwards: the forwarder's
partial sums travel in bf16 (the combine row), so a combined output is within ``NODE_COMBINE_RTOL`` of the
float64 reference where token mode's is within ``COMBINE_RTOL``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from commbench.errors import UsageError
from commbench.traffic.nodes import Nodes
from commbench.traffic.payload import COMBINE_RTOL, combine_reference, encode_rows, expected_combine
from commbench.traffic.plan import RankPlan

# A forwarder's partial sum is rounded to bf16 (8 significant bits: at most 2^-8 of it) before it crosses
# the scale-out link; twice that bounds the rounding of every node's partial with room for float32's own.
NODE_COMBINE_RTOL = 2.0**-7


@dataclass
class NodePlan:
    """One rank's node-mode layout (module docstring)."""

    rank: int  # global rank
    token: RankPlan  # token mode's plan of the rank's own tokens: the rows both stages deliver in the end
    scaleout: RankPlan  # stage 1, on the local-index group (rank = node id, world_size = nodes)
    nvlink: RankPlan  # stage 2, on the node group (rank = local index, num_tokens = input rows)
    input_src: torch.Tensor  # int64 [inputs]: origin rank of each stage-2 input row
    input_token: torch.Tensor  # int64 [inputs]: origin token of each stage-2 input row

    def to(self, device: torch.device | str) -> NodePlan:
        return replace(
            self,
            token=self.token.to(device),
            scaleout=self.scaleout.to(device),
            nvlink=self.nvlink.to(device),
            input_src=self.input_src.to(device),
            input_token=self.input_token.to(device),
        )


def check_uniform(nodes: Nodes) -> None:
    """UsageError unless every node has the same number of ranks (stage 1 pairs ranks of one local index)."""
    if not nodes.uniform:
        raise UsageError(
            "--send-mode node runs stage 1 among the ranks of one local index, so every node (NVLink "
            f"domain) needs the same number of ranks; this layout has {nodes.describe()}: set "
            "--ranks-per-domain"
        )


def _scaleout_plan(plan: RankPlan, nodes: Nodes, node: torch.Tensor, forwarders: torch.Tensor) -> RankPlan:
    tokens = plan.num_tokens
    to_node = node[plan.send_key]
    remote = to_node != int(node[plan.rank])
    pair = torch.unique(to_node[remote] * tokens + plan.send_token_index[remote], sorted=True)
    target = pair // tokens
    return RankPlan(
        rank=int(node[plan.rank]),
        world_size=nodes.num_nodes,
        send_mode="token",
        num_tokens=tokens,
        send_token_index=(pair % tokens).contiguous(),
        send_key=forwarders[plan.rank, target].contiguous(),  # the forwarder (global rank) of each row
        send_counts=torch.bincount(target, minlength=nodes.num_nodes).reshape(-1, 1),
        combine_weight=torch.ones(pair.numel(), dtype=torch.float32),
        dispatch_row_bytes=plan.dispatch_row_bytes,
        combine_row_bytes=plan.combine_row_bytes,
    )


def node_plans(token_plans: Sequence[RankPlan], nodes: Nodes) -> list[NodePlan]:
    """Every rank's NodePlan from every rank's token-mode plan (``token_plans[rank]``) on ``nodes``."""
    check_uniform(nodes)
    if len(token_plans) != nodes.world_size:
        raise ValueError(f"got {len(token_plans)} plans for {nodes.world_size} ranks")
    node = torch.tensor(nodes.node_of_rank)
    local = torch.tensor(nodes.local_index)
    forwarders = torch.tensor(nodes.forwarders)
    scaleout = [_scaleout_plan(plan, nodes, node, forwarders) for plan in token_plans]
    out = []
    for rank, own in enumerate(token_plans):
        home = int(node[rank])
        # Input rows: own tokens, then each other node's same-index rank's stage-1 rows to this node.
        srcs = [torch.full((own.num_tokens,), rank, dtype=torch.int64)]
        toks = [torch.arange(own.num_tokens, dtype=torch.int64)]
        mine = node[own.send_key] == home
        index, dst, weight = [own.send_token_index[mine]], [own.send_key[mine]], [own.combine_weight[mine]]
        base = own.num_tokens
        for other in range(nodes.num_nodes):
            if other == home:
                continue
            src = int(nodes.members(other)[nodes.local_index[rank]])
            arrived = scaleout[src].send_token_index[scaleout[src].segment(home)]
            srcs.append(torch.full((arrived.numel(),), src, dtype=torch.int64))
            toks.append(arrived)
            plan = token_plans[src]
            here = node[plan.send_key] == home
            index.append(base + torch.searchsorted(arrived, plan.send_token_index[here]))
            dst.append(plan.send_key[here])
            weight.append(plan.combine_weight[here])
            base += int(arrived.numel())
        input_index, dest = torch.cat(index), torch.cat(dst)
        order = torch.argsort(local[dest] * max(base, 1) + input_index)
        nvlink = RankPlan(
            rank=int(local[rank]),
            world_size=int(nodes.sizes[home]),
            send_mode="token",
            num_tokens=base,
            send_token_index=input_index[order].contiguous(),
            send_key=dest[order].contiguous(),
            send_counts=torch.bincount(local[dest], minlength=int(nodes.sizes[home])).reshape(-1, 1),
            combine_weight=torch.cat(weight)[order].contiguous(),
            dispatch_row_bytes=own.dispatch_row_bytes,
            combine_row_bytes=own.combine_row_bytes,
        )
        out.append(NodePlan(rank, own, scaleout[rank], nvlink, torch.cat(srcs), torch.cat(toks)))
    return out


def group_ranks(nodes: Nodes, rank: int, stage: str) -> list[int]:
    """The global ranks of ``rank``'s group for ``stage``, in group-rank order: scaleout = the ranks of its
    local index on every node (node order), nvlink = the ranks of its node."""
    if stage == "nvlink":
        return [int(r) for r in nodes.members(int(nodes.node_of_rank[rank]))]
    local = int(nodes.local_index[rank])
    return [int(nodes.members(node)[local]) for node in range(nodes.num_nodes)]


def expected_stage_rows(plans: Sequence[NodePlan], nodes: Nodes, rank: int, stage: str) -> torch.Tensor:
    """What ``rank`` must receive in ``stage`` of dispatch: every group member's rows to it, members in
    group order, each keeping its origin's (src, token) header."""
    srcs, toks = [], []
    for member in group_ranks(nodes, rank, stage):
        plan = plans[member]
        if stage == "scaleout":
            rows = plan.scaleout.send_token_index[plan.scaleout.segment(int(nodes.node_of_rank[rank]))]
            srcs.append(torch.full_like(rows, member))
            toks.append(rows)
        else:
            index = plan.nvlink.send_token_index[plan.nvlink.segment(int(nodes.local_index[rank]))]
            srcs.append(plan.input_src[index])
            toks.append(plan.input_token[index])
    return encode_rows(torch.cat(srcs), torch.cat(toks), plans[rank].token.dispatch_row_bytes)


def stage_combine_reference(
    plan: NodePlan, nodes: Nodes, stage: str | None, hidden: int, rtol: float = COMBINE_RTOL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, tolerance) of one rank's combine output: ``stage`` "nvlink" = stage 2 backwards alone
    (float32 [input rows, hidden] partial sums, ``rtol``), "scaleout" = stage 1 backwards alone (the other
    nodes' partials added per token), None = both (the layer's output, token mode's reference); the last two
    within max(rtol, NODE_COMBINE_RTOL)."""
    coarse = max(rtol, NODE_COMBINE_RTOL)
    if stage is None:
        return expected_combine(plan.token, hidden, coarse)
    if stage == "nvlink":
        rows = plan.nvlink
        index = rows.send_token_index
        return combine_reference(
            index, rows.num_tokens, plan.input_src[index], plan.input_token[index], rows.send_key,
            rows.combine_weight, hidden, rtol,
        )  # fmt: skip
    token = plan.token
    node = torch.tensor(nodes.node_of_rank).to(token.send_key.device)
    remote = node[token.send_key] != int(node[plan.rank])
    index = token.send_token_index[remote]
    return combine_reference(
        index, token.num_tokens, torch.full_like(index, plan.rank), index, token.send_key[remote],
        token.combine_weight[remote], hidden, coarse,
    )  # fmt: skip
