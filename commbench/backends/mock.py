"""Mock backend and in-process thread ranks, for unit tests of the harness and report code only.

``MockBackend`` moves no data: it returns what each rank must receive (built from every rank's plan, see
``Backend.setup_peers``) and a deterministic modelled time, ``latency + bottleneck link bytes / bandwidth``.
Its rows are labelled "mock (no data movement)" and emulated. ``run_threads`` runs ``entry(comm, *args)`` for
every rank as threads of this process (``ThreadComm``), so world sizes no machine has can be exercised.
Neither says anything about real communication: tests of data movement use gloo processes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from commbench.backends.base import Backend
from commbench.errors import CommbenchError, CommError, UsageError
from commbench.run.dist import Comm, hang_bound_s
from commbench.traffic.payload import expected_rows, expert_outputs
from commbench.traffic.plan import RankPlan, row_matrix

_DEFAULT_OPTIONS = {"link_GBps": 100.0, "latency_us": 10.0}


class MockBackend(Backend):
    name = "mock"
    emulated = True

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` over the defaults, as floats (UsageError on a bad key or value)."""
        unknown = set(options) - set(_DEFAULT_OPTIONS)
        if unknown:
            raise UsageError(
                f"unknown mock option(s) {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(_DEFAULT_OPTIONS)}"
            )
        merged = {**_DEFAULT_OPTIONS, **options}
        for key, value in merged.items():
            try:
                merged[key] = float(value)
            except (TypeError, ValueError):
                raise UsageError(f"mock option {key}={value!r} must be a number") from None
        if merged["link_GBps"] <= 0:
            raise UsageError(f"mock link_GBps must be positive, got {merged['link_GBps']}")
        return merged

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.options = self.check_options(self.options)
        self._peers: list[RankPlan] | None = None
        self._rows = np.zeros((0, 0), dtype=np.int64)
        self._recv_counts = torch.zeros(0, 1, dtype=torch.int64)
        self._expected = torch.zeros(0, 0, dtype=torch.uint8)
        self._last_seconds: float | None = None

    @property
    def label(self) -> str:
        return "mock (no data movement)"

    def knobs(self) -> dict[str, Any]:
        return {
            "mock_link_GBps": float(self.options["link_GBps"]),
            "mock_latency_us": float(self.options["latency_us"]),
        }

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:
        self._peers = list(plans)

    def setup(self, plan: RankPlan) -> None:
        if self._peers is None:
            raise RuntimeError("MockBackend.setup needs setup_peers(plans of every rank) first")
        me = self.comm.rank
        device = self.comm.device
        self._rows = row_matrix(self._peers)
        self._recv_counts = torch.stack([peer.send_counts[me].cpu() for peer in self._peers]).to(device)
        self._expected = expected_rows(self._peers, me, device)

    def _model(self, sent_rows: np.ndarray, recv_rows: np.ndarray, row_bytes: int) -> float:
        """Seconds for this rank: latency + max(link bytes sent, received) / bandwidth (self excluded)."""
        me = self.comm.rank
        sent = (int(sent_rows.sum()) - int(sent_rows[me])) * row_bytes
        received = (int(recv_rows.sum()) - int(recv_rows[me])) * row_bytes
        return float(self.options["latency_us"]) * 1e-6 + max(sent, received) / (
            float(self.options["link_GBps"]) * 1e9
        )

    def modelled_seconds(self) -> float | None:
        return self._last_seconds

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        return self._recv_counts.clone()

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        me = self.comm.rank
        self._last_seconds = self._model(self._rows[me], self._rows[:, me], plan.dispatch_row_bytes)
        return self._expected.clone()

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        me = self.comm.rank
        hidden = int(expert_out.shape[1])
        # Combine sends back what dispatch received: the transpose of the dispatch rows.
        self._last_seconds = self._model(self._rows[:, me], self._rows[me], plan.combine_row_bytes)
        returned = expert_outputs(me, plan.send_token_index, plan.send_key, hidden)
        combined = torch.zeros(plan.num_tokens, hidden, dtype=torch.float32, device=returned.device)
        combined.index_add_(0, plan.send_token_index, returned.float() * plan.combine_weight.unsqueeze(1))
        return combined


class GenerationBarrier:
    """A reusable barrier whose release cannot be undone by a later ``abort``.

    ``threading.Barrier.abort`` breaks the barrier for threads that were already released but had not yet
    woken up (the barrier's state flips from "draining" to "broken" before they look), so a rank that
    completed a collective could still raise BrokenBarrierError. Here each wait belongs to a generation: a
    waiter returns normally once its generation is released, whatever happens afterwards; ``abort`` (or a
    timeout) only fails waits whose generation has not been released, and every later wait.
    """

    def __init__(self, parties: int, timeout: float | None = None) -> None:
        if parties < 1:
            raise ValueError(f"a barrier needs at least one party, got {parties}")
        self.parties = parties
        self.timeout = timeout
        self._cond = threading.Condition()  # re-entrant lock: a test can hold it across wait() + abort()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    @property
    def broken(self) -> bool:
        return self._broken

    def wait(self, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.parties:  # the last arrival releases this generation
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            released = self._cond.wait_for(
                lambda: self._generation != generation or self._broken, timeout=timeout
            )
            if self._generation != generation:  # released, even if the barrier broke since
                return
            if not released:  # timed out: nobody else will come, fail every waiter
                self._broken = True
                self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        """Fail every pending and future wait (generations already released stay released)."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class _Hub:
    """What the thread ranks of one run share: a barrier and one slot per rank for gathers."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.barrier = GenerationBarrier(world_size, timeout=timeout_s)
        self.slots: list[Any] = [None] * world_size


@dataclass
class ThreadComm(Comm):
    """A rank that is a thread of this process (backend name "threads"); collectives are object-level only."""

    hub: Any = None

    def barrier(self) -> None:
        with self.guard("barrier"):
            self.hub.barrier.wait()

    def all_gather_object(self, obj: Any) -> list[Any]:
        with self.guard("all_gather_object"):
            self.hub.slots[self.rank] = copy.deepcopy(obj)
            self.hub.barrier.wait()
            gathered = list(self.hub.slots)
            self.hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered

    def gather_object(self, obj: Any) -> list[Any] | None:
        gathered = self.all_gather_object(obj)
        return gathered if self.rank == 0 else None


def run_threads(
    world_size: int, entry: Callable[..., Any], args: Sequence[Any] = (), timeout_s: float = 60.0
) -> Any:
    """Run ``entry(comm, *args)`` on ``world_size`` thread ranks; returns rank 0's result.

    An exception in one rank breaks the others' barriers; the root cause is re-raised (a CommbenchError other
    than CommError first, then any other exception, then CommError).
    """
    hub = _Hub(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        comm = ThreadComm(rank, world_size, rank, torch.device("cpu"), "threads", None, timeout_s, None, hub)
        try:
            results[rank] = entry(comm, *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            errors[rank] = exc
            hub.barrier.abort()

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    bound = hang_bound_s(timeout_s)
    for thread in threads:
        thread.join(bound)
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        hub.barrier.abort()
        raise CommError(f"thread rank(s) {', '.join(map(str, hung))} made no progress for {bound:.0f} s")
    ordered = [errors[rank] for rank in sorted(errors)]
    for exc in ordered:
        if isinstance(exc, CommbenchError) and not isinstance(exc, CommError):
            raise exc
    for exc in ordered:
        if not isinstance(exc, CommbenchError):
            raise exc
    if ordered:
        raise ordered[0]
    return results[0]
