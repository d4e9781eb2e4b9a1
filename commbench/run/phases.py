"""What each phase runs and checks: the MoE layer's dispatch and combine, and the balanced all-to-all.

``MoeLayer`` is the one MoE runner: given every rank's plans (a skewed job's, or the balanced layout of its
imbalance-cost reference) it sets the backend up and hands out the dispatch phase (counts exchange + rows,
timed together as a dispatcher does both) and then the combine phase (expert outputs derived from what
actually arrived, weighted reduction), each verified against what every source's plan says
(``traffic.payload``: ``RowCheck``, ``CombineCheck``, built when first needed). The harness times and
checks every ``Phase`` the same way.

The traffic of an MoE job (``moe_traffic``): every rank re-routes every source rank (routing is deterministic)
to rebuild the plans it verifies against, and builds the job's Pattern from the same routings' counts.
Routings, plans and counts are read-only, so thread ranks (mock runs) share them through a cache that
``clear_traffic_cache`` empties at the end of a run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from commbench.run.interface import Backend
from commbench.run.jobs import MoeJob
from commbench.traffic.node_plan import NodePlan, node_plans
from commbench.traffic.nodes import Nodes
from commbench.traffic.pattern import Pattern, RankCounts, pattern_from_counts, rank_counts
from commbench.traffic.payload import (
    COMBINE_RTOL,
    CombineCheck,
    RowCheck,
    decode_header,
    encode_rows,
    expected_combine,
    expected_rows,
    expert_outputs,
    received_keys,
)
from commbench.traffic.plan import RankPlan, balanced_pair_rows, plan_balanced, plan_balanced_moe, plan_rank
from commbench.traffic.routing import Routing, RoutingConfig, experts_per_rank, route_rank


class Check(Protocol):
    """What one rank must hold after a phase: ``full`` counts every wrong byte or element, ``checksum`` a
    cheaper per-iteration count in the same unit (``traffic.payload.RowCheck``, ``CombineCheck``)."""

    def full(self, output: torch.Tensor) -> int: ...
    def checksum(self, output: torch.Tensor) -> int: ...


class _Lazy:
    """A ``Check`` built on first use (the expected rows cost memory and time: unchecked runs skip them)."""

    def __init__(self, build: Callable[[], Check]) -> None:
        self._build = build
        self._check: Check | None = None

    def _get(self) -> Check:
        if self._check is None:
            self._check = self._build()
        return self._check

    def full(self, output: torch.Tensor) -> int:
        return self._get().full(output)

    def checksum(self, output: torch.Tensor) -> int:
        return self._get().checksum(output)


@dataclass(frozen=True)
class Phase:
    """One phase as the harness times it: ``call`` is one iteration, ``check`` counts what is wrong in an
    iteration's output on this rank (``unit``: bytes or elements); None: an output that is not defined (the
    in-place all-to-all), timed and never checked."""

    name: str  # the rows' phase: "dispatch", "combine" or "alltoall"
    label: str  # names the phase in errors and #wrong messages, e.g. "alltoall 4096 B"
    call: Callable[[], torch.Tensor]
    check: Check | None
    unit: str

    @property
    def corrupted_by(self) -> str:
        """The ``RunOptions.corrupt`` value that hits this phase's output (a node-mode stage's too)."""
        return "combine" if self.name.startswith("combine") else "dispatch"

    def corrupt(self, output: torch.Tensor) -> None:
        """Test hook: change one combined element, or flip the last byte of the first received row."""
        if not output.numel():
            return
        if self.corrupted_by == "combine":
            output.view(-1)[:1].add_(1.0)
        else:
            output[0, -1:].bitwise_xor_(0xFF)


def _set_up(comm: Any, backend: Backend, plans: Sequence[RankPlan]) -> tuple[RankPlan, torch.Tensor]:
    """Give the backend every rank's plan, then this rank's (untimed); returns (plan, encoded token rows)."""
    plan = plans[comm.rank].to(comm.device)
    tokens = encode_rows(
        comm.rank, torch.arange(plan.num_tokens, device=comm.device), plan.dispatch_row_bytes
    )
    backend.setup_peers(plans)
    backend.setup(plan)
    return plan, tokens


class MoeLayer:
    """One rank's MoE layer over every rank's ``plans``: ``dispatch()``, then ``combine()`` after dispatch."""

    def __init__(
        self,
        comm: Any,
        backend: Backend,
        plans: Sequence[RankPlan],
        hidden: int,
        send_mode: str,
        label: str = "",
    ) -> None:
        self.comm = comm
        self.backend = backend
        self.plans = list(plans)
        self.hidden = hidden
        self.send_mode = send_mode
        self.label = label  # appended to the phase name, e.g. " imbalance-cost uniform reference"
        self.plan, self.tokens = _set_up(comm, backend, plans)
        self.recv_counts: torch.Tensor | None = None
        self.received: torch.Tensor | None = None

    def dispatch(self) -> Phase:
        plan, backend = self.plan, self.backend

        def call() -> torch.Tensor:
            counts = plan.static_recv_counts
            if counts is None:
                with backend.steps("count exchange"):
                    counts = backend.exchange_counts(plan.send_counts)
            self.recv_counts = counts
            self.received = backend.dispatch(self.tokens, plan, counts)
            return self.received

        return Phase("dispatch", f"dispatch{self.label}", call, _row_check(self.comm, self.plans), "bytes")

    def combine(self) -> Phase:
        if self.received is None or self.recv_counts is None:
            raise RuntimeError("MoeLayer.combine needs a dispatch first")
        plan, backend, counts = self.plan, self.backend, self.recv_counts
        src, token = decode_header(self.received)
        keys = received_keys(counts, self.comm.rank, self.send_mode)
        expert_out = expert_outputs(src, token, keys, self.hidden)
        hidden = self.hidden
        rtol = float(getattr(backend, "combine_rtol", COMBINE_RTOL))
        return Phase(
            "combine",
            f"combine{self.label}",
            lambda: backend.combine(expert_out, plan, counts),
            # A backend whose library reduces in bf16 says how close its output can be (combine_rtol).
            _Lazy(lambda: CombineCheck(*expected_combine(plan, hidden, rtol))),
            "elements",
        )


def _row_check(comm: Any, plans: Sequence[RankPlan]) -> Check:
    """What ``comm.rank`` must receive from every source's plan (built on first use)."""
    return _Lazy(lambda: RowCheck(expected_rows(plans, comm.rank, comm.device)))


def alltoall_phases(comm: Any, backend: Backend, size: int) -> tuple[Phase, Phase | None]:
    """The balanced all-to-all of ``size`` bytes per rank (nccl-tests alltoall): (out-of-place, in-place).

    Out-of-place sends the token rows and receives into the backend's receive buffer, checked. In-place
    (None where the backend has none: ``Backend.in_place``) is the same exchange with the token rows as its
    input and its output (``dispatch_in_place``), as nccl-tests' in-place alltoall passes one buffer; it is
    run after the out-of-place one, so it may overwrite the rows, and its result is undefined (a row may be
    overwritten before it is sent), so it is not checked (``check`` None), as nccl-tests reports no #wrong
    for it."""
    plans = [plan_balanced(src, comm.world_size, int(size)) for src in range(comm.world_size)]
    plan, tokens = _set_up(comm, backend, plans)
    out_of_place = Phase(
        "alltoall",
        f"alltoall {size} B",
        lambda: backend.dispatch(tokens, plan, plan.static_recv_counts),
        _row_check(comm, plans),
        "bytes",
    )
    if not backend.in_place:
        return out_of_place, None
    in_place = Phase(
        "alltoall",
        f"alltoall in-place {size} B",
        lambda: backend.dispatch_in_place(tokens, plan),
        None,
        "bytes",
    )
    return out_of_place, in_place


def reference_traffic(
    job: MoeJob, plan: RankPlan, total_rows: int
) -> tuple[dict[str, np.ndarray], list[RankPlan]]:
    """The imbalance-cost reference of an MoE job whose dispatch moves ``total_rows`` rows (``plan``: one
    of its plans): ({phase: [src][dst] bytes}, every rank's plan). The same total rows, row sizes, tokens per
    rank and send mode, each (src, dst) pair total / world^2 rows (``balanced_pair_rows``,
    ``plan_balanced_moe``)."""
    world = plan.world_size
    per_rank = experts_per_rank(job.routing.model.num_experts, world)
    rows = balanced_pair_rows(world, total_rows)
    matrices = {
        "dispatch": rows * plan.dispatch_row_bytes,
        # Combine answers each row, from the expert side back to the token owner: the transpose.
        "combine": np.ascontiguousarray(rows.T) * plan.combine_row_bytes,
    }
    plans = [
        plan_balanced_moe(
            src,
            world,
            total_rows,
            plan.num_tokens,
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
            job.send_mode,
            per_rank,
        )
        for src in range(world)
    ]
    return matrices, plans


@functools.lru_cache(maxsize=128)
def _routing(cfg: RoutingConfig, rank: int) -> Routing:
    return route_rank(cfg, rank)


@functools.lru_cache(maxsize=128)
def _counts(cfg: RoutingConfig, rank: int) -> RankCounts:
    return rank_counts(_routing(cfg, rank), cfg.model.num_experts, cfg.world_size)


@functools.lru_cache(maxsize=128)
def _plan(cfg: RoutingConfig, send_mode: str, rank: int) -> RankPlan:
    return plan_rank(_routing(cfg, rank), cfg.model, cfg.world_size, send_mode)


@functools.lru_cache(maxsize=32)
def _pattern(cfg: RoutingConfig, send_mode: str) -> Pattern:
    return pattern_from_counts(cfg, send_mode, [_counts(cfg, src) for src in range(cfg.world_size)])


def moe_traffic(comm: Any, job: MoeJob) -> tuple[Pattern, list[RankPlan]]:
    """The job's Pattern and every rank's plan (``plans[src]``), from the same routings."""
    plans = []
    for src in range(comm.world_size):
        plans.append(_plan(job.routing, job.send_mode, src))
        _counts(job.routing, src)
        comm.heartbeat()  # routing a large config takes a while: tell the watchdog this rank is alive
    return _pattern(job.routing, job.send_mode), plans


@functools.lru_cache(maxsize=128)
def _node_counts(cfg: RoutingConfig, nodes: Nodes, rank: int) -> RankCounts:
    return rank_counts(_routing(cfg, rank), cfg.model.num_experts, cfg.world_size, nodes)


@functools.lru_cache(maxsize=8)
def _node_plans(cfg: RoutingConfig, nodes: Nodes) -> list[NodePlan]:
    return node_plans([_plan(cfg, "token", src) for src in range(cfg.world_size)], nodes)


@functools.lru_cache(maxsize=8)
def _node_pattern(cfg: RoutingConfig, nodes: Nodes) -> Pattern:
    counts = [_node_counts(cfg, nodes, src) for src in range(cfg.world_size)]
    return pattern_from_counts(cfg, "node", counts, nodes)


def node_traffic(comm: Any, job: MoeJob, nodes: Nodes) -> tuple[Pattern, list[NodePlan]]:
    """A node-mode job's Pattern (both stages' matrices) and every rank's NodePlan, from the same routings
    (each stage laid out from token mode's plans: ``traffic.node_plan``)."""
    for src in range(comm.world_size):
        _plan(job.routing, "token", src)
        _node_counts(job.routing, nodes, src)
        comm.heartbeat()  # routing a large config takes a while: tell the watchdog this rank is alive
    return _node_pattern(job.routing, nodes), _node_plans(job.routing, nodes)


def clear_traffic_cache() -> None:
    """Forget the cached routings, counts, plans and patterns (the end of a run)."""
    for cached in (_routing, _counts, _plan, _pattern, _node_counts, _node_plans, _node_pattern):
        cached.cache_clear()
