"""``--send-mode node`` on torch.distributed: each stage an all-to-all(v) on a sub-group, timed and verified.

The nodes are the layout's NVLink domains (``traffic.nodes``). Two sets of sub-groups (``dist.new_group``,
made once per run under the run's timeout): the ranks of one local index (one per node; stage 1, the
scale-out link) and the ranks of one node (stage 2, NVLink). Each stage runs on its own instance of the
run's backend class bound to its sub-group (``GroupComm``), through the backend's own counts exchange,
dispatch and combine, so the two stages are two ordinary all-to-all(v)s of that library.

``NodeLayer`` hands the harness six phases, in this order (``traffic.nodes.node_phases``):

- ``dispatch``: stage 1 (counts exchange + rows), the forwarded rows copied after the rank's own tokens
  ("forward"), stage 2 (counts exchange + rows); checked against what the rank must hold in the end;
- ``dispatch:scaleout``, ``dispatch:nvlink``: each stage alone, its input prepared untimed (stage 2's: the
  rows stage 1 must deliver), checked against that stage's rows;
- ``combine``: stage 2 backwards (each rank's expert outputs back to the rank that handed it the row,
  reduced per input row), the forwarded partial sums cast to bf16 ("forward"), stage 1 backwards (added
  per token), then the own node's partial added ("node reduce"); checked against token mode's reference;
- ``combine:nvlink``, ``combine:scaleout``: each stage backwards alone (stage 1's input: the exact partial
  sums in bf16), so each stage's #wrong is its own.

Every received byte of every stage is checked (``traffic.node_plan``: forwarded rows keep their origin's
header), every combined element against a float64 reference, each phase with the harness's poisoning and
check mode. A stage alone starts from its own barrier, so the stage rows add up to about the phase row.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from commbench.run.interface import Backend
from commbench.run.nccl_env import applied
from commbench.run.phases import Phase, _Lazy
from commbench.run.steps import NO_STEPS
from commbench.traffic.node_plan import (
    NodePlan,
    check_uniform,
    expected_stage_rows,
    group_ranks,
    stage_combine_reference,
)
from commbench.traffic.nodes import STAGES, Nodes, stage_phase
from commbench.traffic.pattern import Pattern
from commbench.traffic.payload import (
    COMBINE_RTOL,
    CombineCheck,
    RowCheck,
    decode_header,
    encode_rows,
    expert_outputs,
)


class GroupComm:
    """What a backend reads of its ``Comm`` (rank, world size, device, process group, group), for one
    sub-group; heartbeats and guarded errors go through the parent, which names ranks globally."""

    def __init__(self, parent: Any, ranks: Sequence[int], group: Any) -> None:
        self.parent = parent
        self.ranks = tuple(int(r) for r in ranks)
        self.group = group
        self.rank = self.ranks.index(parent.rank)
        self.world_size = len(self.ranks)
        self.local_rank = parent.local_rank
        self.device = parent.device
        self.process_group = parent.process_group
        self.timeout_s = parent.timeout_s

    def heartbeat(self) -> None:
        self.parent.heartbeat()

    def guard(self, operation: str) -> contextlib.AbstractContextManager[None]:
        return self.parent.guard(operation)

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        return self.parent.quiet()


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two sub-groups on ``nodes``."""

    nodes: Nodes
    scaleout: GroupComm  # the ranks of this rank's local index, one per node, in node order
    nvlink: GroupComm  # the ranks of this rank's node


def make_node_groups(comm: Any, nodes: Nodes) -> NodeGroups:
    """Collective (every rank, same order): the sub-groups of both stages, under the run's timeout."""
    import torch.distributed as dist

    check_uniform(nodes)
    firsts = nodes.members(0)
    by_local = [group_ranks(nodes, int(rank), "scaleout") for rank in firsts]
    by_node = [[int(r) for r in nodes.members(node)] for node in range(nodes.num_nodes)]
    nccl = applied() if comm.process_group == "nccl" else None  # NCCL's own timeout, as the world group's
    seconds = nccl.process_group_timeout_s if nccl is not None else comm.timeout_s
    timeout = datetime.timedelta(seconds=seconds)
    with comm.guard("new_group (--send-mode node sub-groups)"):
        local_group, _ = dist.new_subgroups_by_enumeration(by_local, timeout=timeout)
        node_group, _ = dist.new_subgroups_by_enumeration(by_node, timeout=timeout)
    comm.heartbeat()
    scaleout = GroupComm(comm, group_ranks(nodes, comm.rank, "scaleout"), local_group)
    return NodeGroups(nodes, scaleout, GroupComm(comm, group_ranks(nodes, comm.rank, "nvlink"), node_group))


class _StageSteps:
    """A stage backend's view of the profiler (``run.steps``): its steps named after the stage ("scaleout
    pack", "nvlink payload transfer"), its peers' arrivals by global rank."""

    enabled = True

    def __init__(self, recorder: Any, stage: str, ranks: Sequence[int]) -> None:
        self.recorder, self.stage, self.ranks = recorder, stage, tuple(ranks)

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.recorder(f"{self.stage} {name}")

    def peer_arrival(self, src: int) -> None:
        self.recorder.peer_arrival(self.ranks[src])


class StagePair:
    """Both stages' backends as the harness times a phase (``harness.bench``): poisoned, synchronized and
    profiled together (each stage's steps named after it)."""

    moves_data = True
    emulated = False

    def __init__(self, scaleout: Backend, nvlink: Backend) -> None:
        self.stages = {"scaleout": scaleout, "nvlink": nvlink}
        self._steps: Any = NO_STEPS

    @property
    def steps(self) -> Any:
        return self._steps

    @steps.setter
    def steps(self, recorder: Any) -> None:
        self._steps = recorder
        for stage, backend in self.stages.items():
            enabled = getattr(recorder, "enabled", False)
            backend.steps = _StageSteps(recorder, stage, backend.comm.ranks) if enabled else NO_STEPS

    @property
    def blocking(self) -> bool:
        """Always True: the NVLink stage forwards what the scale-out stage received, so each stage's calls
        finish inside the phase's call (``--blocking 0`` cannot issue ahead here)."""
        return True

    @blocking.setter
    def blocking(self, value: bool) -> None:
        pass

    def poison_receive_buffers(self) -> None:
        for backend in self.stages.values():
            backend.poison_receive_buffers()

    def synchronize(self) -> None:
        self.stages["nvlink"].synchronize()

    def modelled_seconds(self) -> float | None:
        return None

    def close(self) -> None:
        for backend in self.stages.values():
            backend.close()


def phase_matrix(pattern: Pattern, name: str) -> np.ndarray:
    """The [src][dst] bytes of one node-mode row phase ("dispatch", "combine:nvlink", ...)."""
    phase, _, stage = name.partition(":")
    if not stage:
        return pattern.dispatch_bytes if phase == "dispatch" else pattern.combine_bytes
    return pattern.stages[phase][stage]


class NodeLayer:
    """One rank's node-mode MoE layer over every rank's ``plans`` (module docstring); ``phases()`` yields
    the six phases, each built when the previous one has been measured (its input is what that delivered)."""

    def __init__(
        self,
        comm: Any,
        groups: NodeGroups,
        backend: Backend,
        options: dict[str, Any],
        plans: Sequence[NodePlan],
        hidden: int,
    ) -> None:
        self.comm, self.groups, self.plans, self.hidden = comm, groups, list(plans), hidden
        cls = type(backend)
        self.pair = StagePair(cls(groups.scaleout, options), cls(groups.nvlink, options))
        self.rtol = float(getattr(backend, "combine_rtol", COMBINE_RTOL))
        self.mine = plans[comm.rank].to(comm.device)
        for stage in STAGES:
            members = group_ranks(groups.nodes, comm.rank, stage)
            self.pair.stages[stage].setup_peers([getattr(plans[r], stage) for r in members])
            self.pair.stages[stage].setup(getattr(self.mine, stage))
        token = self.mine.token
        self.own = token.num_tokens
        self.tokens = encode_rows(
            comm.rank, torch.arange(self.own, device=comm.device), token.dispatch_row_bytes
        )
        # Stage 2's input rows: the rank's own tokens, then what stage 1 delivered (copied in by "forward").
        self.inputs = torch.empty(
            (self.mine.nvlink.num_tokens, token.dispatch_row_bytes), dtype=torch.uint8, device=comm.device
        )
        self.inputs[: self.own] = self.tokens
        self.counts: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] = {}
        self.returned: dict[str, torch.Tensor] = {}
        self.back = torch.empty(
            (self.inputs.shape[0] - self.own, hidden), dtype=torch.bfloat16, device=comm.device
        )  # stage 1 backwards' input: the forwarded rows' partial sums, bf16 as the combine row
        # Combine's input, set by phases() from what dispatch delivered.
        self.expert_out = torch.empty((0, hidden), dtype=torch.bfloat16, device=comm.device)

    def _dispatch(self, stage: str, rows: torch.Tensor) -> torch.Tensor:
        backend, plan = self.pair.stages[stage], getattr(self.mine, stage)
        with backend.steps("count exchange"):
            counts = backend.exchange_counts(plan.send_counts)
        self.counts[stage] = counts
        self.received[stage] = backend.dispatch(rows, plan, counts)
        return self.received[stage]

    def _forward(self) -> None:
        with self.pair.steps("forward"):
            self.inputs[self.own :].copy_(self.received["scaleout"])

    def _both_dispatch(self) -> torch.Tensor:
        self._dispatch("scaleout", self.tokens)
        self._forward()
        return self._dispatch("nvlink", self.inputs)

    def _combine(self, stage: str, rows: torch.Tensor) -> torch.Tensor:
        backend, plan = self.pair.stages[stage], getattr(self.mine, stage)
        self.returned[stage] = backend.combine(rows, plan, self.counts[stage])
        return self.returned[stage]

    def _return_partials(self) -> None:
        with self.pair.steps("forward"):
            self.back.copy_(self.returned["nvlink"][self.own :])  # bf16 over the scale-out link

    def _both_combine(self) -> torch.Tensor:
        partial = self._combine("nvlink", self.expert_out)
        self._return_partials()
        out = self._combine("scaleout", self.back)
        with self.pair.steps("node reduce"):
            return out.add_(partial[: self.own])

    def _rows(self, name: str, stage: str) -> Phase:
        plans, nodes, rank, device = self.plans, self.groups.nodes, self.comm.rank, self.comm.device
        check = _Lazy(lambda: RowCheck(expected_stage_rows(plans, nodes, rank, stage).to(device)))
        rows = self.tokens if stage == "scaleout" else self.inputs
        call = self._both_dispatch if name == "dispatch" else (lambda: self._dispatch(stage, rows))
        return Phase(name, name, call, check, "bytes")

    def _outputs(self, name: str, stage: str | None) -> Phase:
        mine, nodes, hidden = self.plans[self.comm.rank], self.groups.nodes, self.hidden
        rtol, device = self.rtol, self.comm.device

        def build() -> CombineCheck:
            reference, tolerance = stage_combine_reference(mine, nodes, stage, hidden, rtol)
            return CombineCheck(reference.to(device), tolerance.to(device))

        if stage is None:
            call = self._both_combine
        else:
            rows = self.expert_out if stage == "nvlink" else self.back
            call = lambda: self._combine(stage, rows)  # noqa: E731 - one expression
        return Phase(name, name, call, _Lazy(build), "elements")

    def phases(self) -> Iterator[Phase]:
        """dispatch, dispatch:scaleout, dispatch:nvlink, combine, combine:nvlink, combine:scaleout."""
        plans, nodes, rank = self.plans, self.groups.nodes, self.comm.rank
        yield self._rows("dispatch", "nvlink")
        yield self._rows(stage_phase("dispatch", "scaleout"), "scaleout")
        # Stage 2 alone starts from the rows stage 1 must deliver (untimed), so its #wrong is its own.
        arrived = expected_stage_rows(plans, nodes, rank, "scaleout")
        self.inputs[self.own :].copy_(arrived.to(self.comm.device))
        yield self._rows(stage_phase("dispatch", "nvlink"), "nvlink")
        # Expert outputs from what dispatch delivered (a misrouted row also breaks combine).
        src, token = decode_header(self.received["nvlink"])
        self.expert_out = expert_outputs(src, token, rank, self.hidden)
        yield self._outputs("combine", None)
        yield self._outputs(stage_phase("combine", "nvlink"), "nvlink")
        # Stage 1 backwards alone starts from the exact partial sums in bf16 (untimed), as a forwarder sends.
        partial, _ = stage_combine_reference(plans[rank], nodes, "nvlink", self.hidden)
        self.back.copy_(partial[self.own :].to(self.comm.device))
        yield self._outputs(stage_phase("combine", "scaleout"), "scaleout")

    def close(self) -> None:
        self.pair.close()


def node_backend_refusal(backend_class: type, send_modes: Sequence[str]) -> str:
    """Why ``backend_class`` cannot run jobs of these send modes ("" when it can): node mode runs on a
    backend that can be bound to a sub-group of the ranks (``Backend.node_stages``)."""
    if "node" not in send_modes or getattr(backend_class, "node_stages", False):
        return ""
    return (
        f"--send-mode node runs its two stages as all-to-alls on sub-groups of the ranks, which --backend "
        f"{backend_class.name} cannot; use --backend nccl or gloo, or --send-mode token"
    )
