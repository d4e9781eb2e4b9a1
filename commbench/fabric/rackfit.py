"""Fit the fabric model to the user's own rack: link parameters from a report folder's measured phases.

``commbench simulate --calibrate RUN_DIR`` reads the folder (the CLI does: this stage never imports the
report stage) and hands each measured phase here as plain arrays: a balanced-sweep size or a MoE phase
(every rank's bytes sent and received per link class, and its time), or one pairwise message (one pair's
bytes and time). The nccl engine's model (docs/fabric-model.md) is fitted to them by least squares on the
log of the times, five physical parameters:

- ``nvlink_GBps`` and ``scaleout_GBps``: the effective per-direction bandwidth of a rank's link inside its
  NVLink domain and across domains (what line rate x efficiency is on a catalogue spec);
- ``phase_latency_us``: the fixed time of a collective phase (launch included);
- ``nvlink_peer_latency_us`` and ``scaleout_peer_latency_us``: the cost of each peer, in sequence (a
  pairwise message pays one).

A parameter no measurement depends on (no bytes ever crossed domains), or two the measurements cannot tell
apart (every phase with the same peers, and no pairwise latency), is refused with the parameter named, and
so are fewer distinct measured phases than parameters: the fit would be a guess. The two stages of a
``--send-mode node`` run come as two phases (the CLI hands them down so, each with its own peers). The
fitted rack then predicts a model's dispatch and combine at 1, 2, 4, 8, 16 racks (or any world sizes), with
error bars from the fit's covariance (parameter draws).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.fabric.lsq import Fit, jacobian, levenberg_marquardt, unconstrained
from commbench.fabric.model import Fabric, FabricParams, LinkLoads, compute_loads, predict_loads
from commbench.inputs.layout import Layout
from commbench.inputs.specs import SystemSpec

RACK_PARAMETERS = (
    "nvlink_GBps",
    "scaleout_GBps",
    "phase_latency_us",
    "nvlink_peer_latency_us",
    "scaleout_peer_latency_us",
)
RACK_UNITS = ("GB/s per direction", "GB/s per direction", "us", "us per peer", "us per peer")
# What each parameter needs measured, for the refusal.
NEEDS = {
    "nvlink_GBps": "bytes between ranks of one NVLink domain",
    "scaleout_GBps": "bytes between NVLink domains (run with --ranks-per-domain below the world size)",
    "phase_latency_us": "a collective phase (the balanced sweep or a MoE run)",
    "nvlink_peer_latency_us": "phases with different NVLink peer counts, or the pairwise latency test",
    "scaleout_peer_latency_us": "phases with different scale-out peer counts, or pairs across domains",
}
START = np.array([10.0, 10.0, 20.0, 1.0, 1.0])  # starting point (GB/s, us): any positive value works
# Where the search may go (log space): a parameter the data leaves free runs to a bound, not to overflow,
# and the checks below then name it. 1e-6..1e9 GB/s and us hold any host or GPU fabric.
BOUNDS = (np.full(len(RACK_PARAMETERS), np.log(1e-6)), np.full(len(RACK_PARAMETERS), np.log(1e9)))
DEFAULT_RACKS = (1, 2, 4, 8, 16)
DRAWS = 32  # parameter draws behind the error bars


@dataclass
class MeasuredPhase:
    """One measured time and what moved: per rank [class (nvlink, scaleout), direction (send, recv)]."""

    label: str
    bytes: np.ndarray  # float [n, 2, 2]
    peers: np.ndarray  # int [n, 2, 2]: peers a rank exchanged bytes with through that resource
    time_s: float
    collective: bool = True  # False: one point-to-point message (no phase latency)


@dataclass
class RackFit:
    """Fitted rack parameters (RACK_PARAMETERS order) with relative one-sigma, and every residual."""

    values: np.ndarray
    relative_sigma: np.ndarray
    covariance: np.ndarray  # of the log values
    measured_s: np.ndarray
    fitted_s: np.ndarray
    labels: list[str]
    ranks_per_domain: int
    ranks_per_host: int

    @property
    def residual_pct(self) -> np.ndarray:
        return 100.0 * (self.fitted_s / self.measured_s - 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "parameters": {
                name: {"value": float(v), "relative_sigma": float(s), "unit": unit}
                for name, v, s, unit in zip(
                    RACK_PARAMETERS, self.values, self.relative_sigma, RACK_UNITS, strict=True
                )
            },
            "residuals": [
                {"phase": label, "measured_us": m * 1e6, "fitted_us": f * 1e6, "residual_pct": r}
                for label, m, f, r in zip(
                    self.labels, self.measured_s, self.fitted_s, self.residual_pct, strict=True
                )
            ],
        }


def rack_spec(values: np.ndarray, ranks_per_domain: int, ranks_per_host: int) -> SystemSpec:
    """A spec whose line rates are the fitted effective bandwidths (the efficiencies are then 1)."""
    return SystemSpec(
        name="this rack (fitted)",
        gpus_per_domain=ranks_per_domain,
        nvlink_GBps_per_direction=float(values[0]),
        nic_Gbps_per_direction=float(values[1]) * 8.0,
        gpus_per_host=ranks_per_host,
        rail_optimized=False,
        description="fitted by commbench simulate --calibrate",
    )


def rack_params(values: np.ndarray) -> FabricParams:
    return FabricParams(
        nvlink_efficiency=1.0,
        scaleout_efficiency=1.0,
        phase_latency_s=float(values[2]) * 1e-6,
        nvlink_peer_latency_s=float(values[3]) * 1e-6,
        scaleout_peer_latency_s=float(values[4]) * 1e-6,
        rail_optimized=False,
        pxn=False,
        launch_s=0.0,  # inside the fitted phase latency
    )


def _layout(n: int, ranks_per_domain: int, ranks_per_host: int) -> Layout:
    ranks = np.arange(n, dtype=np.int64)
    return Layout(ranks // ranks_per_domain, ranks // max(1, ranks_per_host), "fitted")


def predicted_times(
    phases: Sequence[MeasuredPhase], values: np.ndarray, per_domain: int, per_host: int
) -> np.ndarray:
    """The model's time (s) of each phase on a rack with parameter ``values`` (RACK_PARAMETERS order)."""
    spec = rack_spec(values, per_domain, per_host)
    params = rack_params(values)
    pair = FabricParams(**{**params.__dict__, "phase_latency_s": 0.0})
    times = []
    for phase in phases:
        n = phase.bytes.shape[0]
        fabric = Fabric(spec, _layout(n, per_domain, per_host), params if phase.collective else pair)
        loads = LinkLoads(bytes=phase.bytes, messages=phase.peers)
        times.append(predict_loads(loads, fabric).time_s)
    return np.array(times)


def fit_rack(phases: Sequence[MeasuredPhase], ranks_per_domain: int, ranks_per_host: int) -> RackFit:
    """Least squares of log(model / measured) over ``phases``; UsageError naming a parameter the phases
    cannot constrain."""
    if not phases:
        raise UsageError("--calibrate: the folder has no measured phase (no results.csv rows, no pairs.csv)")
    measured = np.array([p.time_s for p in phases])
    # What no measurement can tell, read off the data before any fit: a resource nothing crossed, a
    # phase latency without a collective phase.
    present = {
        "nvlink_GBps": any(p.bytes[:, 0].any() for p in phases),
        "scaleout_GBps": any(p.bytes[:, 1].any() for p in phases),
        "phase_latency_us": any(p.collective for p in phases),
    }
    for name, seen in present.items():
        if not seen:
            raise UsageError(
                f"--calibrate: the folder's runs cannot constrain {name}: no measured time depends on it "
                f"(it needs {NEEDS[name]})"
            )
    distinct = len({(p.bytes.tobytes(), p.peers.tobytes(), p.collective) for p in phases})
    if distinct < len(RACK_PARAMETERS):
        raise UsageError(
            f"--calibrate: the folders hold {distinct} distinct measured phase(s), fewer than the "
            f"{len(RACK_PARAMETERS)} parameters to fit ({', '.join(RACK_PARAMETERS)}); add a folder with the "
            "balanced sweep and the pairwise test (commbench suite writes both; --ranks-per-domain below "
            "the world size on one host)"
        )

    def residual(log_x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            times = predicted_times(phases, np.exp(log_x), ranks_per_domain, ranks_per_host)
        return np.log(times / measured)

    # The phase time is a max over links, so the cost has a local minimum for every link that could be the
    # one that limits: start from NVLink faster, equal, and slower than scale-out, and keep the best.
    starts = [np.log(START * np.array([ratio, 1.0, 1.0, 1.0, 1.0])) for ratio in (10.0, 1.0, 0.1)]
    fits = [levenberg_marquardt(residual, x0, max_iterations=40, bounds=BOUNDS) for x0 in starts]
    scale = min(fits, key=lambda f: float(f.residuals @ f.residuals))
    # Constrained at all? A parameter no time depends on, tried at a large step.
    jac = jacobian(residual, scale.log_x, step=0.5)
    for index in unconstrained(jac):
        name = RACK_PARAMETERS[index]
        raise UsageError(
            f"--calibrate: the folder's runs cannot constrain {name}: no measured time depends on it (it "
            f"needs {NEEDS[name]}, limiting a measured time)"
        )
    fit: Fit = levenberg_marquardt(residual, scale.log_x, max_iterations=60, bounds=BOUNDS)
    local = jacobian(residual, fit.log_x)
    singular = np.linalg.svd(local / np.linalg.norm(local, axis=0), compute_uv=True)
    if singular[1][-1] < 1e-6:
        name = RACK_PARAMETERS[int(np.argmax(np.abs(singular[2][-1])))]
        raise UsageError(
            f"--calibrate: the folder's runs cannot constrain {name}: it trades off exactly against "
            f"another parameter in every measurement (it needs {NEEDS[name]})"
        )
    values = fit.values
    return RackFit(
        values=values,
        relative_sigma=fit.relative_sigma,
        covariance=fit.covariance,
        measured_s=measured,
        fitted_s=predicted_times(phases, values, ranks_per_domain, ranks_per_host),
        labels=[p.label for p in phases],
        ranks_per_domain=ranks_per_domain,
        ranks_per_host=ranks_per_host,
    )


def balanced_phase(
    label: str, world: int, per_domain: int, size_bytes: float, time_s: float
) -> MeasuredPhase:
    """A balanced all-to-all of ``size_bytes`` per rank (nccl-tests' size) on contiguous domains."""
    domain = np.arange(world) // per_domain
    same = domain[:, None] == domain[None, :]
    per_peer = size_bytes / world
    nv_peers = same.sum(1) - 1
    so_peers = world - same.sum(1)
    loads = np.zeros((world, 2, 2))
    peers = np.zeros((world, 2, 2), dtype=np.int64)
    loads[:, 0, :] = (nv_peers * per_peer)[:, None]
    loads[:, 1, :] = (so_peers * per_peer)[:, None]
    peers[:, 0, :] = nv_peers[:, None]
    peers[:, 1, :] = so_peers[:, None]
    return MeasuredPhase(label, loads, peers, time_s)


def pair_phase(
    label: str, world: int, src: int, dst: int, scaleout: bool, size_bytes: float, time_s: float
) -> MeasuredPhase:
    """One message of ``size_bytes`` from ``src`` to ``dst`` over NVLink or scale-out."""
    loads = np.zeros((world, 2, 2))
    peers = np.zeros((world, 2, 2), dtype=np.int64)
    cls = 1 if scaleout else 0
    loads[src, cls, 0] = loads[dst, cls, 1] = size_bytes
    peers[src, cls, 0] = peers[dst, cls, 1] = 1
    return MeasuredPhase(label, loads, peers, time_s, collective=False)


def _time_of(loads: LinkLoads, values: np.ndarray, layout: Layout, per_domain: int, per_host: int) -> float:
    fabric = Fabric(rack_spec(values, per_domain, per_host), layout, rack_params(values))
    return predict_loads(loads, fabric).time_s


def predict_racks(
    fit: RackFit,
    model: Any,
    world_sizes: Sequence[int],
    tokens_per_rank: int = 4096,
    seed: int = 0,
    draws: int = DRAWS,
) -> list[dict[str, Any]]:
    """Dispatch and combine of ``model`` at each world size on the fitted rack: the fit's time and the
    spread (16th-84th percentile) over parameter draws from its covariance."""
    from commbench.fabric.ep_groups import grouped_pattern  # routing needs torch: only when predicting

    rng = np.random.default_rng(seed)
    log_draws = rng.multivariate_normal(np.log(fit.values), fit.covariance, size=draws)
    rows = []
    for world in world_sizes:
        per_domain = min(fit.ranks_per_domain, world)
        per_host = math.gcd(per_domain, fit.ranks_per_host)
        layout = _layout(world, per_domain, per_host)
        domains = layout.domain_of_rank
        pattern = grouped_pattern(model, world, tokens_per_rank, seed=seed, domain_of_rank=domains)
        shape = Fabric(rack_spec(fit.values, per_domain, per_host), layout, rack_params(fit.values))
        for phase, traffic in (("dispatch", pattern.dispatch_bytes), ("combine", pattern.combine_bytes)):
            loads = compute_loads(traffic, shape)  # bytes and peers: the same for every draw
            best = _time_of(loads, fit.values, layout, per_domain, per_host)
            spread = [_time_of(loads, np.exp(d), layout, per_domain, per_host) for d in log_draws]
            low, high = np.percentile(spread, [16, 84])
            rows.append(
                {
                    "ranks": world,
                    "racks": world / fit.ranks_per_domain,
                    "phase": phase,
                    "time_us": best * 1e6,
                    "low_us": float(low) * 1e6,
                    "high_us": float(high) * 1e6,
                }
            )
    return rows
