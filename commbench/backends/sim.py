"""Simulated backend: in-process, no data movement, phase times from the fabric model.

``SimBackend`` answers each phase with what every rank must receive (from every rank's plan, given through
``Backend.setup_peers``) and reports, through ``modelled_seconds``, the fabric model's time for the phase's
traffic on a system spec: the mocked backend for harness tests at sizes no machine here has (the harness's
thread ranks can stand for a 72-GPU rack), and a what-if tool. Rows are labelled emulated and are not
verified (nothing moved: #wrong n/a).

What it needs from the harness: ``setup_peers(plans)`` with every rank's RankPlan before ``setup`` (the full
[src][dst] count matrix is built from them; nothing else is exchanged). Every rank computes the same model;
the prediction is cached per traffic matrix, so thread ranks share one computation.

Options (``--backend-option key=value``): ``spec`` (name or YAML path, default gb300-nvl72),
``ranks_per_domain`` and ``ranks_per_host`` (default: the spec's, ranks placed contiguously), and the model
knobs of ``commbench.fabric.model.FabricParams``: ``nvlink_efficiency``, ``scaleout_efficiency``,
``phase_latency_us``, ``nvlink_peer_latency_us``, ``scaleout_peer_latency_us``, ``rail_optimized``, ``pxn``,
``oversubscription``, ``pod_gpus``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from commbench.backends.options import (
    MAX_LATENCY_US,
    MAX_RANKS,
    BackendOption,
    DeclaredOptions,
)
from commbench.errors import UsageError
from commbench.fabric.model import Fabric, PhasePrediction, make_fabric, predict_phase
from commbench.run.interface import Backend
from commbench.traffic.payload import expected_rows, expert_outputs
from commbench.traffic.plan import RankPlan, row_matrix

# Options given in microseconds; FabricParams takes seconds ("phase_latency_us" -> "phase_latency_s").
_US_OPTIONS = ("phase_latency_us", "nvlink_peer_latency_us", "scaleout_peer_latency_us")
_LAYOUT_OPTIONS = ("spec", "ranks_per_domain", "ranks_per_host")
# Above this a leaf group's uplinks carry almost nothing: far beyond any built fabric (8:1 is already rare).
MAX_OVERSUBSCRIPTION = 1024.0

# Predictions shared by the thread ranks of one process: key = (fabric, phase bytes digest).
_CACHE: OrderedDict[tuple[Any, ...], PhasePrediction] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 16


def _predict_cached(traffic: np.ndarray, fabric: Fabric) -> PhasePrediction:
    digest = hashlib.blake2b(np.ascontiguousarray(traffic, dtype=np.int64).tobytes(), digest_size=16).digest()
    key = (
        fabric.spec,
        fabric.params,
        fabric.layout.domain_of_rank.tobytes(),
        fabric.layout.host_of_rank.tobytes(),
        digest,
    )
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    prediction = predict_phase(traffic, fabric)
    with _CACHE_LOCK:
        _CACHE[key] = prediction
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return prediction


class SimBackend(DeclaredOptions, Backend):
    name = "sim"
    emulated = True
    models_report_layout = True  # the launch hands it --spec and the layout overrides (cli.launch)
    moves_data = False  # hands back the expected rows: nothing to verify

    # The layout and the model knobs of commbench.fabric.model.FabricParams; None = the spec's value.
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption("spec", str, None, "system spec: catalogue name or YAML path (default gb300-nvl72)"),
        BackendOption(
            "ranks_per_domain",
            int,
            None,
            "ranks per NVLink domain (default: the spec's)",
            minimum=0,
            maximum=MAX_RANKS,
        ),
        BackendOption(
            "ranks_per_host", int, None, "ranks per host (default: the spec's)", minimum=0, maximum=MAX_RANKS
        ),
        BackendOption(
            "pod_gpus",
            int,
            None,
            "GPUs under one leaf group (0 = no uplink limit)",
            minimum=0,
            maximum=MAX_RANKS,
        ),
        BackendOption(
            "nvlink_efficiency",
            float,
            None,
            "fraction of the NVLink spec reached, in (0, 1]",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
        BackendOption(
            "scaleout_efficiency",
            float,
            None,
            "fraction of the NIC line rate reached, in (0, 1]",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
        BackendOption(
            "oversubscription",
            float,
            None,
            "scale-out oversubscription above a pod (1 = non-blocking)",
            minimum=1,
            maximum=MAX_OVERSUBSCRIPTION,
        ),
        BackendOption(
            "phase_latency_us",
            float,
            None,
            "latency per phase, microseconds",
            minimum=0,
            maximum=MAX_LATENCY_US,
        ),
        BackendOption(
            "nvlink_peer_latency_us",
            float,
            None,
            "latency per NVLink peer, microseconds",
            minimum=0,
            maximum=MAX_LATENCY_US,
        ),
        BackendOption(
            "scaleout_peer_latency_us",
            float,
            None,
            "latency per scale-out peer, us",
            minimum=0,
            maximum=MAX_LATENCY_US,
        ),
        BackendOption("rail_optimized", bool, None, "rail-optimized scale-out (else a fat tree)"),
        BackendOption("pxn", bool, None, "forward scale-out bytes over NVLink to the destination's rail"),
    )

    @classmethod
    def check_options(cls, options: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
        """The typed options; with ``world_size`` also the fabric they describe (spec, model knobs, layout),
        so a bad spec or a layout that does not fit is refused in the parent, before any launch."""
        checked = super().check_options(options)
        if world_size is not None:
            cls.fabric_for(checked, world_size)
        return checked

    @staticmethod
    def fabric_for(options: Mapping[str, Any], world_size: int) -> Fabric:
        """The fabric of checked ``options`` for ``world_size`` ranks; UsageError when it cannot be built."""
        given = {k: v for k, v in options.items() if v is not None and k not in _LAYOUT_OPTIONS}
        overrides = {k: v for k, v in given.items() if k not in _US_OPTIONS}
        overrides.update(
            {k.removesuffix("_us") + "_s": v * 1e-6 for k, v in given.items() if k in _US_OPTIONS}
        )
        return make_fabric(
            options.get("spec"),
            int(world_size),
            ranks_per_domain=options.get("ranks_per_domain"),
            ranks_per_host=options.get("ranks_per_host"),
            **overrides,
        )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.options = self.check_options(self.options)
        self.fabric: Fabric = self.fabric_for(self.options, int(comm.world_size))
        self._peers: list[RankPlan] | None = None
        self._rows = np.zeros((0, 0), dtype=np.int64)
        self._recv_counts = torch.zeros(0, 1, dtype=torch.int64)
        self._expected = torch.zeros(0, 0, dtype=torch.uint8)
        self._counts_pending = False
        self._counts_seconds = 0.0
        self._last_seconds: float | None = None
        self.last_prediction: PhasePrediction | None = None

    @property
    def label(self) -> str:
        return f"sim (fabric model of {self.fabric.spec.name}, no data movement)"

    def knobs(self) -> dict[str, Any]:
        p = self.fabric.params
        return {
            "sim_spec": self.fabric.spec.name,
            "sim_ranks_per_domain": int(np.bincount(self.fabric.layout.domain_of_rank).max()),
            "sim_nvlink_efficiency": p.nvlink_efficiency,
            "sim_scaleout_efficiency": p.scaleout_efficiency,
            "sim_phase_latency_us": p.phase_latency_s * 1e6,
        }

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:
        self._peers = list(plans)

    def setup(self, plan: RankPlan) -> None:
        if self._peers is None:
            raise RuntimeError("SimBackend.setup needs setup_peers(plans of every rank) first")
        me = self.comm.rank
        self._rows = row_matrix(self._peers)
        self._recv_counts = torch.stack([peer.send_counts[me].cpu() for peer in self._peers]).to(
            self.comm.device
        )
        self._expected = expected_rows(self._peers, me, self.comm.device)
        slots = int(plan.send_counts.shape[1]) if plan.send_counts.ndim == 2 else 1
        world = self.fabric.world_size
        counts = np.full((world, world), 8 * slots, dtype=np.int64)  # int64 counts per (src, dst)
        self._counts_seconds = _predict_cached(counts, self.fabric).time_s

    def phase_prediction(self, phase: str, plan: RankPlan) -> PhasePrediction:
        """The model's prediction (time, bottleneck) of ``phase`` ("dispatch" or "combine") for the plans."""
        if phase == "dispatch":
            traffic = self._rows * int(plan.dispatch_row_bytes)
        elif phase == "combine":
            traffic = np.ascontiguousarray(self._rows.T) * int(plan.combine_row_bytes)
        else:
            raise UsageError(f"unknown phase {phase!r}; choose dispatch or combine")
        return _predict_cached(traffic, self.fabric)

    def modelled_seconds(self) -> float | None:
        return self._last_seconds

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        self._counts_pending = True
        return self._recv_counts.clone()

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        self.last_prediction = self.phase_prediction("dispatch", plan)
        counts = self._counts_seconds if self._counts_pending else 0.0
        self._counts_pending = False
        self._last_seconds = counts + self.last_prediction.time_s
        return self._expected.clone()

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        me = self.comm.rank
        hidden = int(expert_out.shape[1])
        self.last_prediction = self.phase_prediction("combine", plan)
        self._last_seconds = self.last_prediction.time_s
        # What each source would have sent back: the expert output of every row this rank dispatched.
        returned = expert_outputs(me, plan.send_token_index, plan.send_key, hidden)
        combined = torch.zeros(plan.num_tokens, hidden, dtype=torch.float32, device=returned.device)
        combined.index_add_(0, plan.send_token_index, returned.float() * plan.combine_weight.unsqueeze(1))
        return combined
