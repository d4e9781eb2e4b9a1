"""Calibration: the fabric model against published all-to-all figures (nccl-tests and DeepEP).

The cases are data (``calibration.yaml`` next to this module: each figure as its source defines it, with its
source); this module predicts the same figure for each case. ``commbench simulate --calibration`` prints the
table of docs/fabric-model.md from ``calibration_rows``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from commbench.fabric.cases import REGIMES, CalibrationCase, calibration_cases
from commbench.fabric.engines import table_values
from commbench.fabric.lsq import jacobian, levenberg_marquardt, unconstrained
from commbench.fabric.model import (
    Fabric,
    FabricParams,
    LinkLoads,
    PhasePrediction,
    balanced_traffic,
    compute_loads,
    make_fabric,
    predict_loads,
)
from commbench.inputs.specs import SystemSpec, load_spec
from commbench.traffic.nodes import Nodes, node_stage_rows, node_token_counts

# DeepEP's benchmark setting (tests/test_intranode.py, tests/test_internode.py): 4096 tokens per rank, hidden
# 7168, 256 experts, top-8; internode: experts grouped by node, top min(nodes, 4) nodes per token by the max
# score in each node. FP8 dispatch rows = hidden x (1 + 4/128) bytes, BF16 combine rows = 2 x hidden. These
# are the published runs' inputs (the cases' ranks per node is their ranks_per_domain); the per-node traffic
# itself is the general node-mode builder of ``commbench.traffic.nodes``.
DEEPEP_TOKENS, DEEPEP_HIDDEN, DEEPEP_EXPERTS, DEEPEP_TOPK = 4096, 7168, 256, 8
DEEPEP_MAX_NODES = 4
DEEPEP_FP8_ROW = DEEPEP_HIDDEN + DEEPEP_HIDDEN // 128 * 4
DEEPEP_BF16_ROW = 2 * DEEPEP_HIDDEN


def deepep_test_hits(
    num_ranks: int,
    ranks_per_node: int,
    tokens: int,
    rng: np.random.Generator,
    experts: int = DEEPEP_EXPERTS,
    topk: int = DEEPEP_TOPK,
    max_nodes: int = DEEPEP_MAX_NODES,
    chunk: int = 8,
) -> np.ndarray:
    """bool [src rank, token, dst rank]: which ranks each token reaches under DeepEP's test routing
    (|N(0,1)| + 1 scores, node-group limit top-min(nodes, ``max_nodes``) by max score, then top-k experts),
    ``experts`` placed contiguously over ``num_ranks`` in nodes of ``ranks_per_node``."""
    nodes = max(1, num_ranks // ranks_per_node)
    topk_groups = min(nodes, max_nodes)
    # Contiguous placement, uneven when the ranks do not divide the experts (288 experts on 64 ranks).
    owner = (np.arange(experts) * num_ranks) // experts
    expert_node = np.minimum(owner // ranks_per_node, nodes - 1)
    node_starts = np.searchsorted(expert_node, np.arange(nodes))
    hits = np.zeros((num_ranks, tokens, num_ranks), dtype=bool)
    for start in range(0, num_ranks, chunk):
        count = min(chunk, num_ranks - start)
        scores = np.abs(rng.standard_normal((count, tokens, experts), dtype=np.float32)) + 1.0
        if nodes > 1 and topk_groups < nodes:
            group_scores = np.maximum.reduceat(scores, node_starts, axis=-1)
            keep = np.argpartition(-group_scores, topk_groups - 1, axis=-1)[..., :topk_groups]
            kept = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(kept, keep, True, axis=-1)
            scores = np.where(kept[..., expert_node], scores, 0.0)
        chosen = np.argpartition(-scores, topk - 1, axis=-1)[..., :topk]
        np.put_along_axis(hits[start : start + count], owner[chosen], True, axis=-1)
    return hits


def deepep_node_traffic(
    hits: np.ndarray, nodes: Nodes, row_bytes: int, combine: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """([src][dst] bytes of DeepEP's normal kernels, the bytes DeepEP's test counts per rank).

    The traffic is node mode's (``traffic.nodes``): a token crosses the network once per other node holding
    its experts (to the rank with the sender's local index there), which forwards it over NVLink to each of
    that node's ranks holding them; the sender's own node is reached over NVLink directly; combine is the
    mirror (the transpose), both stages at once as DeepEP pipelines them. The counted bytes follow the
    test: RDMA = (token, node) pairs, the sender's own node included; NVL (one node) = rows received, the
    rank's own included.
    """
    tokens = hits.sum(axis=1, dtype=np.int64)  # [src, dst]
    node_tokens = node_token_counts(hits, nodes.node_of_rank, nodes.num_nodes)  # [src, node]
    scaleout, nvlink = node_stage_rows(tokens, node_tokens, nodes)
    matrix = (scaleout + nvlink).astype(np.float64) * row_bytes
    if combine:
        matrix = np.ascontiguousarray(matrix.T)
    if nodes.num_nodes > 1:
        counted = node_tokens.sum(axis=1) * float(row_bytes)
    else:
        counted = tokens.sum(axis=0) * float(row_bytes)
    return matrix, counted


# Normal-kernel cases route at most this many tokens per rank and scale the bytes to the case's tokens: the
# bytes are linear in the tokens under uniform random routing, and 1,024 tokens keep the busiest rank's
# sampling noise near 1-2% (the tests hold it to 4,096-token routing) at a quarter of the time.
ROUTED_TOKENS = 1024
DEEPEP_LL_TOKENS = 128  # DeepEP's low-latency test: 128 tokens per rank (decode), hidden 7168, top-8


def ll_selection_traffic(
    num_ranks: int, tokens: int, experts: int, topk: int, rng: np.random.Generator
) -> np.ndarray:
    """[src][dst] selections of DeepEP's low-latency test routing: each token picks its top-k of random
    scores over all experts (no node limit), ``experts`` contiguous over the ranks; one message per
    selection."""
    owner = (np.arange(experts) * num_ranks) // experts  # contiguous, uneven when ranks do not divide
    counts = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    for src in range(num_ranks):
        scores = rng.random((tokens, experts), dtype=np.float32)
        chosen = np.argpartition(-scores, topk - 1, axis=-1)[:, :topk]
        counts[src] = np.bincount(owner[chosen].ravel(), minlength=num_ranks)
    return counts


@functools.lru_cache(maxsize=8)
def _routed_hits(
    ranks: int, per_node: int, tokens: int, seed: int, experts: int, topk: int, max_nodes: int
) -> np.ndarray:
    """DeepEP's test routing, shared by the cases of one table that differ only in SMs, dtype or timing."""
    rng = np.random.default_rng(seed)
    return deepep_test_hits(ranks, per_node, tokens, rng, experts=experts, topk=topk, max_nodes=max_nodes)


@dataclass
class CaseTraffic:
    """What a case moves, built once (it does not depend on the parameters): loads and counted bytes."""

    case: CalibrationCase
    loads: LinkLoads
    counted_bytes: float  # what the published GB/s figure divides by the time (0 for a time or busbw)


@functools.cache
def case_spec(case: CalibrationCase) -> SystemSpec:
    """The case's catalogue spec with its NIC rate, transport and net plugin as run."""
    spec = load_spec(case.spec)
    changes: dict[str, Any] = {}
    if case.nic_gbps:
        changes["nic_Gbps_per_direction"] = case.nic_gbps
    if case.transport:
        changes["transport"] = case.transport
    if case.net_max_recvs:
        changes["net_max_recvs"] = case.net_max_recvs
    return replace(spec, **changes) if changes else spec


@functools.cache
def _case_layout(case: CalibrationCase) -> Fabric:
    return make_fabric(
        case_spec(case),
        case.world_size,
        ranks_per_domain=case.ranks_per_domain,
        ranks_per_host=case.ranks_per_host or None,
        params=case_params(case),
    )


def case_params(
    case: CalibrationCase, table: Mapping[str, float] | None = None, kernel: str | None = None
) -> FabricParams:
    """The model's knobs for a case: its engine (or ``kernel``), transport, SMs and graph flag, values from
    ``table``."""
    api = (table or {}).get("torch_api_us", table_values()["torch_api_us"]) if case.torch_api else 0.0
    return FabricParams.from_spec(
        case_spec(case),
        table,
        kernel=kernel or case.kernel,
        library=case.library,
        sms=case.sms or None,
        cuda_graph=case.cuda_graph,
        api_overhead_s=api * 1e-6,
    )


def case_fabric(
    case: CalibrationCase, table: Mapping[str, float] | None = None, kernel: str | None = None
) -> Fabric:
    """The case's fabric (spec, layout) with the knobs of ``table``."""
    return replace(_case_layout(case), params=case_params(case, table, kernel))


def case_traffic(case: CalibrationCase, tokens: int = DEEPEP_TOKENS, seed: int = 0) -> CaseTraffic:
    """Build a case's traffic and loads (``tokens``: per rank for normal-kernel cases that state none)."""
    fabric = case_fabric(case)
    rng = np.random.default_rng(seed)
    hidden = case.hidden or DEEPEP_HIDDEN
    fp8_row = hidden + hidden // 128 * 4 if case.dispatch_fp8 else 2 * hidden
    combine = "combine" in case.kind
    row = 2 * hidden if combine else fp8_row
    if case.kernel == "nccl":
        traffic = balanced_traffic(case.world_size, case.size_bytes / case.world_size)
        return CaseTraffic(case, compute_loads(traffic, fabric), 0.0)
    experts, topk = case.experts or DEEPEP_EXPERTS, case.topk or DEEPEP_TOPK
    if case.kernel == "low-latency":
        ll_tokens = case.tokens or DEEPEP_LL_TOKENS
        if case.per_rank:  # once per destination rank: the token-mode rows of DeepEP's routing, no node limit
            per_node = min(case.ranks_per_domain, case.world_size)
            hits = _routed_hits(case.world_size, per_node, ll_tokens, seed, experts, topk, case.world_size)
            selections = hits.sum(axis=1, dtype=np.int64).astype(np.float64)
        else:
            selections = ll_selection_traffic(case.world_size, ll_tokens, experts, topk, rng).astype(
                np.float64
            )
        matrix = (selections.T if combine else selections) * row
        # NCCL-EP's bandwidth: selections a rank sends (combine: receives), its own included, x row / time.
        counted = float(selections.sum(axis=1).mean()) * row
        return CaseTraffic(case, compute_loads(matrix, fabric, row), counted)
    per_node = min(case.ranks_per_domain, case.world_size)
    wanted = case.tokens or tokens
    routed = min(wanted, ROUTED_TOKENS)
    hits = _routed_hits(
        case.world_size, per_node, routed, seed, experts, topk, case.max_nodes or case.world_size
    )
    nodes = Nodes.of(fabric.layout.domain_of_rank)
    matrix, counted = deepep_node_traffic(hits, nodes, row, combine)
    scale = wanted / routed
    # DeepEP prints rank 0's counted bytes over its kernel time; the mean over ranks is its expectation.
    return CaseTraffic(case, compute_loads(matrix * scale, fabric, row), float(counted.mean()) * scale)


def case_value(
    traffic: CaseTraffic, table: Mapping[str, float] | None = None, kernel: str | None = None
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure under ``table`` (and ``kernel`` instead of the
    case's engine), and the prediction behind it."""
    case = traffic.case
    prediction = predict_loads(traffic.loads, case_fabric(case, table, kernel), "combine" in case.kind)
    if case.kind == "nccl_busbw":
        n = case.world_size
        return case.size_bytes * (n - 1) / n / prediction.time_s / 1e9, prediction
    if case.kind.endswith("_us"):
        return prediction.time_s * 1e6, prediction
    return traffic.counted_bytes / prediction.time_s / 1e9, prediction  # GB/s as the source counts it


def predict_case(
    case: CalibrationCase, table: Mapping[str, float] | None, tokens: int, seed: int
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure, and the prediction behind it."""
    return case_value(case_traffic(case, tokens, seed), table)


# Parameters the calibration fits (calibration.yaml marks them "fitted"); each is held at its table value
# when no trusted case constrains it. RoCE's efficiency is not fitted: its only cases are one provider's
# GB300 cross-rack runs at 24% of line rate (the same provider's GB200 racks reach 87-90% on InfiniBand),
# which a transport-wide parameter would carry to every RoCE fabric; they stay in the table as misses.
# The per-SM byte rate is held at a bound read off the data (calibration.yaml): fitted beside the per-row
# cost it runs off to its limit, the per-row cost explaining the SM sweeps alone.
# The launch cost is not fitted either: only the CUDA-graph cases tell it from the fixed phase latency, and
# one source of them would decide it; it keeps its sourced prior. A normal kernel's fixed latency inside one
# NVLink domain is held too (fitted, it ran to its lower bound: calibration.yaml); its scale-out part is
# fitted.
FIT_PARAMETERS = (
    "nvlink_efficiency",
    "scaleout_efficiency.infiniband",
    "scaleout_efficiency.efa",
    "message_cost_us.efa",
    "nccl.phase_latency_us",
    "nccl.nvlink_peer_latency_us",
    "normal.scaleout_latency_us",
    "low-latency.kernel_latency_us",
    "row_cost_us",
    "combine_sm_speed",
    "torch_api_us",
    # Each library's kernels against DeepEP's (calibration.yaml's library.* rows): held at 1 where none of
    # its figures constrains one (the fit's Jacobian says so).
    *(name for name in table_values() if name.startswith("library.")),
)
_AT_MOST_ONE = ("nvlink_efficiency", "scaleout_efficiency.")  # fractions of line rate
_LIBRARY_SPAN = math.log(8.0)  # a library.* factor stays within 1/8..8 (log bound)


HUBER_DELTA = 0.15  # log-error beyond which a case counts linearly, not squared (a 15% miss)


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    """Pseudo-residuals whose squares are the Huber loss: a few figures the model does not explain (the
    mid-size dips of nccl-tests curves) pull the physical parameters no harder than a 15% miss each."""
    big = np.abs(r) > delta
    out = r.copy()
    out[big] = np.sign(r[big]) * np.sqrt(2 * delta * (np.abs(r[big]) - delta / 2))
    return out


def _log_bounds(name: str, log_value: float) -> tuple[float, float]:
    """The fit's bounds on log(parameter) around its table value ``log_value`` (see fit_table)."""
    if name.startswith("library."):
        return -_LIBRARY_SPAN, _LIBRARY_SPAN
    return log_value - 4.0, 0.0 if name.startswith(_AT_MOST_ONE) else log_value + 4.0


@dataclass
class CalibrationFit:
    """Fitted values (unit of calibration.yaml) with relative one-sigma, and what was held fixed."""

    values: dict[str, float]
    relative_sigma: dict[str, float]
    held: list[str]  # not constrained by the cases fitted: kept at the table value


def fit_table(
    traffics: Sequence[CaseTraffic], names: Sequence[str] = FIT_PARAMETERS, max_iterations: int = 30
) -> CalibrationFit:
    """Least squares of log(model / published) over ``traffics`` for the parameters ``names``."""
    base = table_values()
    names = list(names)

    def residual_of(active: list[str]) -> Callable[[np.ndarray], np.ndarray]:
        def residual(log_x: np.ndarray) -> np.ndarray:
            table = {**base, **dict(zip(active, np.exp(log_x), strict=True))}
            logs = [math.log(max(case_value(t, table)[0], 1e-12) / t.case.published) for t in traffics]
            return huber(np.array(logs, dtype=np.float64)) * weights

        return residual

    # Every series (one table, one set of conditions) weighs the same, however many rows it has.
    series = [t.case.series or t.case.source for t in traffics]
    sizes = {name: series.count(name) for name in set(series)}
    weights = np.array([1.0 / math.sqrt(sizes[name]) for name in series])
    start = np.log([max(base[n], 1e-3) for n in names])
    held_idx = unconstrained(jacobian(residual_of(names), start, step=0.05))
    active = [n for i, n in enumerate(names) if i not in held_idx]
    if not active:
        return CalibrationFit({}, {}, names)
    # Within a factor of e^4 (~55) of the table's value, a fraction of line rate at most 1, and a library's
    # factor on DeepEP's kernels within 1/8..8 (a kernel design, not a different machine).
    x0 = np.log([max(base[n], 1e-3) for n in active])
    low, high = np.array([_log_bounds(n, x) for n, x in zip(active, x0, strict=True)]).T
    fit = levenberg_marquardt(residual_of(active), np.clip(x0, low, high), max_iterations, bounds=(low, high))
    values = dict(zip(active, fit.values.tolist(), strict=True))
    sigma = dict(zip(active, fit.relative_sigma.tolist(), strict=True))
    return CalibrationFit(values, sigma, [names[i] for i in held_idx])


def calibration_rows(
    table: Mapping[str, float] | None = None,
    tokens: int = DEEPEP_TOKENS,
    seed: int = 0,
    leave_one_out: bool = True,
) -> list[dict[str, Any]]:
    """Every case with the model's prediction, its error (prediction / published - 1) and, with
    ``leave_one_out``, the error when the fitted parameters are fitted without the case's source."""
    if table is None:  # the shipped table: computed once per process (the fits take most of a minute)
        return [dict(row) for row in _shipped_rows(tokens, seed, leave_one_out)]
    return _rows(table, tokens, seed, leave_one_out)


@functools.lru_cache(maxsize=4)
def _shipped_rows(tokens: int, seed: int, leave_one_out: bool) -> tuple[dict[str, Any], ...]:
    return tuple(_rows(None, tokens, seed, leave_one_out))


def _rows(
    table: Mapping[str, float] | None, tokens: int, seed: int, leave_one_out: bool
) -> list[dict[str, Any]]:
    traffics = [case_traffic(case, tokens, seed) for case in calibration_cases()]
    loso: dict[int, float] = {}
    if leave_one_out:
        trusted = [t for t in traffics if not t.case.untrusted]
        for source in sorted({t.case.source for t in trusted}):
            # Started from the table (the full fit): a few steps reach the fit without the source.
            fit = fit_table([t for t in trusted if t.case.source != source], max_iterations=8)
            fitted = {**table_values(), **(table or {}), **fit.values}
            for index, t in enumerate(traffics):
                if t.case.source == source:
                    loso[index] = 100.0 * (case_value(t, fitted)[0] / t.case.published - 1.0)
    rows = []
    for index, t in enumerate(traffics):
        case = t.case
        predicted, prediction = case_value(t, table)
        rows.append(
            {
                "case": case.label,
                "spec": case.spec,
                "ranks": case.world_size,
                "kernel": case.kernel,
                "regime": case.case_regime,
                "metric": case.metric,
                "published": case.published,
                "predicted": predicted,
                "error_pct": 100.0 * (predicted / case.published - 1.0),
                "loso_error_pct": loso.get(index, math.nan),
                "bottleneck": prediction.bottleneck,
                "source": case.source,
                "note": case.note,
                "untrusted": case.untrusted,
            }
        )
    return rows


# The model before transfer engines (commbench 2026-12-01): every phase a host collective (a latency per
# peer in sequence), no launch or Python-call cost, no SM bound, one scale-out efficiency for every transport.
BEFORE_TABLE = {
    "nvlink_efficiency": 0.72,
    "scaleout_efficiency.infiniband": 0.87,
    "scaleout_efficiency.roce": 0.87,
    "scaleout_efficiency.efa": 0.87,
    "message_cost_us.efa": 0.0,
    "nccl.phase_latency_us": 12.0,
    "nccl.nvlink_peer_latency_us": 0.3,
    "nccl.scaleout_peer_latency_us": 3.0,
    "launch_us": 0.0,
    "torch_api_us": 0.0,
}


def before_rows(tokens: int = DEEPEP_TOKENS, seed: int = 0) -> list[dict[str, Any]]:
    """Every case as the model predicted it before transfer engines (``BEFORE_TABLE``, the nccl engine),
    with the same traffic (the per-node dedup of DeepEP's cases included): the "before" of the docs."""
    rows = []
    for case in calibration_cases():
        t = case_traffic(case, tokens, seed)
        predicted, prediction = case_value(t, BEFORE_TABLE, kernel="nccl")
        rows.append(
            {
                "case": case.label,
                "regime": case.case_regime,
                "published": case.published,
                "predicted": predicted,
                "error_pct": 100.0 * (predicted / case.published - 1.0),
                "loso_error_pct": math.nan,
                "untrusted": case.untrusted,
            }
        )
    return rows


def regime_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per regime: trusted cases, how many within 15% (strictly: |model / published - 1| <= 0.15, no
    rounding), the median |error|, and how many leave-one-source-out predictions are within 25%."""
    summary = []
    for regime in REGIMES:
        mine = [r for r in rows if r["regime"] == regime and not r["untrusted"]]
        errors = np.array([abs(r["error_pct"]) for r in mine])
        loso = np.array([abs(r["loso_error_pct"]) for r in mine if not math.isnan(r["loso_error_pct"])])
        summary.append(
            {
                "regime": regime,
                "cases": len(mine),
                "within_15": int((errors <= 15.0).sum()),
                "median_abs_error_pct": float(np.median(errors)) if errors.size else math.nan,
                "loso_cases": int(loso.size),
                "loso_within_25": int((loso <= 25.0).sum()),
                "untrusted": sum(1 for r in rows if r["regime"] == regime and r["untrusted"]),
            }
        )
    return summary
