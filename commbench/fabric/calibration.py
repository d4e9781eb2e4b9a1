"""Calibration: the fabric model against published all-to-all figures (nccl-tests and DeepEP).

The cases are data (``calibration.yaml`` next to this module: each figure as its source defines it, with its
source); this module predicts the same figure for each case. ``commbench simulate --calibration`` prints the
table of docs/fabric-model.md from ``calibration_rows``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

import numpy as np

from commbench.fabric.engines import table_values
from commbench.fabric.lsq import jacobian, levenberg_marquardt, unconstrained
from commbench.fabric.model import (
    FabricParams,
    LinkLoads,
    PhasePrediction,
    balanced_traffic,
    compute_loads,
    make_fabric,
    predict_loads,
)
from commbench.inputs.specs import load_spec
from commbench.inputs.userfiles import load_yaml
from commbench.traffic.nodes import Nodes, node_stage_rows, node_token_counts

# What a published figure is (calibration.yaml's header defines each); the engine that produced it.
KIND_KERNEL = {
    "nccl_busbw": "nccl",
    "nccl_time_us": "nccl",
    "deepep_dispatch": "normal",
    "deepep_combine": "normal",
    "ll_dispatch_us": "low-latency",
    "ll_combine_us": "low-latency",
}
KINDS = tuple(KIND_KERNEL)
# Regimes the accuracy is stated for (docs/fabric-model.md): one node or one NVL72 rack; nccl-tests
# all-to-all across NVLink domains; GPU-initiated EP kernels across nodes; low-latency (decode) kernels.
REGIMES = ("one domain", "nccl across domains", "EP kernels across nodes", "low-latency kernels")
CASE_FILES = ("calibration.yaml", "published.yaml")  # the second: gathered measurements, when present


@dataclass(frozen=True)
class CalibrationCase:
    """One published figure: what was run (spec, ranks, NVLink domain size), what was measured, and where."""

    label: str
    spec: str
    world_size: int
    ranks_per_domain: int
    metric: str  # what the published number is, e.g. "busbw GB/s"
    published: float
    source: str
    kind: str  # one of KINDS
    size_bytes: int = 0  # nccl-tests size (bytes per rank)
    note: str = ""  # set when the model does not explain the figure
    untrusted: str = ""  # why the figure is not used to fit or judge the model (listed, never dropped)
    regime: str = ""  # one of REGIMES; "" = from the kind and the layout
    transport: str = ""  # "" = the spec's
    sms: int = 0  # SMs the kernel ran on; 0 = the engine's default
    tokens: int = 0  # tokens per rank of an EP case; 0 = DeepEP's test default for the kind
    hidden: int = 0  # 0 = DeepEP's 7168
    experts: int = 0  # 0 = DeepEP's 256
    topk: int = 0  # 0 = DeepEP's 8
    dispatch_fp8: bool = True  # FP8 dispatch rows (hidden + scales) rather than BF16
    cuda_graph: bool = False  # the figure excludes launch cost (CUDA graph, or kernel time from a profiler)

    @property
    def kernel(self) -> str:
        return KIND_KERNEL[self.kind]

    @property
    def case_regime(self) -> str:
        if self.regime:
            return self.regime
        if self.kernel == "low-latency":
            return REGIMES[3]
        if self.world_size <= self.ranks_per_domain:
            return REGIMES[0]
        return REGIMES[1] if self.kernel == "nccl" else REGIMES[2]


def _cases_of(file_name: str) -> list[CalibrationCase]:
    root = resources.files("commbench.fabric").joinpath(file_name)
    if not root.is_file():
        return []
    known = {f.name for f in fields(CalibrationCase)}
    cases = []
    for entry in load_yaml(root.read_text(encoding="utf-8"), file_name).get("cases") or []:
        unknown = sorted(set(entry) - known)
        if unknown or entry.get("kind") not in KINDS or entry.get("regime", REGIMES[0]) not in REGIMES:
            raise ValueError(
                f"{file_name}, case {entry.get('label')!r}: unknown keys {unknown}, kind "
                f"{entry.get('kind')!r} not one of {', '.join(KINDS)}, or regime not one of {REGIMES}"
            )
        cases.append(CalibrationCase(**{**entry, "published": float(entry["published"])}))
    return cases


@functools.lru_cache(maxsize=1)
def calibration_cases() -> tuple[CalibrationCase, ...]:
    """The cases of ``calibration.yaml`` then ``published.yaml`` (if shipped), in file order."""
    return tuple(case for name in CASE_FILES for case in _cases_of(name))


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
    experts_per_node = experts // nodes
    experts_per_rank = experts // num_ranks
    hits = np.zeros((num_ranks, tokens, num_ranks), dtype=bool)
    for start in range(0, num_ranks, chunk):
        count = min(chunk, num_ranks - start)
        scores = np.abs(rng.standard_normal((count, tokens, experts), dtype=np.float32)) + 1.0
        if nodes > 1 and topk_groups < nodes:
            group_scores = scores.reshape(count, tokens, nodes, experts_per_node).max(-1)
            keep = np.argpartition(-group_scores, topk_groups - 1, axis=-1)[..., :topk_groups]
            kept = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(kept, keep, True, axis=-1)
            scores = np.where(np.repeat(kept, experts_per_node, axis=-1), scores, 0.0)
        chosen = np.argpartition(-scores, topk - 1, axis=-1)[..., :topk]
        np.put_along_axis(hits[start : start + count], chosen // experts_per_rank, True, axis=-1)
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


DEEPEP_LL_TOKENS = 128  # DeepEP's low-latency test: 128 tokens per rank (decode), hidden 7168, top-8


def ll_selection_traffic(
    num_ranks: int, tokens: int, experts: int, topk: int, rng: np.random.Generator
) -> np.ndarray:
    """[src][dst] selections of DeepEP's low-latency test routing: each token picks its top-k of random
    scores over all experts (no node limit), ``experts`` contiguous over the ranks; one message per
    selection."""
    experts_per_rank = max(1, experts // num_ranks)
    counts = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    for src in range(num_ranks):
        scores = rng.random((tokens, experts), dtype=np.float32)
        chosen = np.argpartition(-scores, topk - 1, axis=-1)[:, :topk]
        counts[src] = np.bincount((chosen // experts_per_rank).ravel(), minlength=num_ranks)[:num_ranks]
    return counts


@dataclass
class CaseTraffic:
    """What a case moves, built once (it does not depend on the parameters): loads and counted bytes."""

    case: CalibrationCase
    loads: LinkLoads
    counted_bytes: float  # what the published GB/s figure divides by the time (0 for a time or busbw)


def case_params(case: CalibrationCase, table: Mapping[str, float] | None = None) -> FabricParams:
    """The model's knobs for a case: its engine, transport, SMs and graph flag, values from ``table``."""
    spec = load_spec(case.spec)
    return FabricParams.from_spec(
        spec,
        table,
        kernel=case.kernel,
        transport=case.transport or None,
        sms=case.sms or None,
        cuda_graph=case.cuda_graph,
    )


def case_traffic(case: CalibrationCase, tokens: int = DEEPEP_TOKENS, seed: int = 0) -> CaseTraffic:
    """Build a case's traffic and loads (``tokens``: per rank for normal-kernel cases that state none)."""
    fabric = make_fabric(
        case.spec, case.world_size, ranks_per_domain=case.ranks_per_domain, params=case_params(case)
    )
    rng = np.random.default_rng(seed)
    hidden = case.hidden or DEEPEP_HIDDEN
    fp8_row = hidden + hidden // 128 * 4 if case.dispatch_fp8 else 2 * hidden
    combine = case.kind.endswith("combine") or case.kind == "ll_combine_us"
    row = 2 * hidden if combine else fp8_row
    if case.kernel == "nccl":
        traffic = balanced_traffic(case.world_size, case.size_bytes / case.world_size)
        return CaseTraffic(case, compute_loads(traffic, fabric), 0.0)
    experts, topk = case.experts or DEEPEP_EXPERTS, case.topk or DEEPEP_TOPK
    if case.kernel == "low-latency":
        selections = ll_selection_traffic(
            case.world_size, case.tokens or DEEPEP_LL_TOKENS, experts, topk, rng
        ).astype(np.float64)
        matrix = (selections.T if combine else selections) * row
        return CaseTraffic(case, compute_loads(matrix, fabric, row), 0.0)
    per_node = min(case.ranks_per_domain, case.world_size)
    hits = deepep_test_hits(case.world_size, per_node, case.tokens or tokens, rng, experts=experts, topk=topk)
    nodes = Nodes.of(fabric.layout.domain_of_rank)
    matrix, counted = deepep_node_traffic(hits, nodes, row, combine)
    # DeepEP prints rank 0's counted bytes over its kernel time; the mean over ranks is its expectation.
    return CaseTraffic(case, compute_loads(matrix, fabric, row), float(counted.mean()))


def case_value(
    traffic: CaseTraffic, table: Mapping[str, float] | None = None
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure under ``table``, and the prediction behind it."""
    case = traffic.case
    fabric = make_fabric(
        case.spec, case.world_size, ranks_per_domain=case.ranks_per_domain, params=case_params(case, table)
    )
    prediction = predict_loads(traffic.loads, fabric)
    if case.kind == "nccl_busbw":
        n = case.world_size
        return case.size_bytes * (n - 1) / n / prediction.time_s / 1e9, prediction
    if case.kind.endswith("_us"):
        return prediction.time_s * 1e6, prediction
    return traffic.counted_bytes / prediction.time_s / 1e9, prediction


def predict_case(
    case: CalibrationCase, table: Mapping[str, float] | None, tokens: int, seed: int
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure, and the prediction behind it."""
    return case_value(case_traffic(case, tokens, seed), table)


# Parameters the calibration fits (calibration.yaml marks them "fitted"); each is held at its table value
# when no trusted case constrains it (say, no EFA case).
FIT_PARAMETERS = (
    "nvlink_efficiency",
    "scaleout_efficiency.infiniband",
    "scaleout_efficiency.roce",
    "scaleout_efficiency.efa",
    "message_cost_us.efa",
    "nccl.phase_latency_us",
    "nccl.nvlink_peer_latency_us",
    "normal.kernel_latency_us",
    "low-latency.kernel_latency_us",
    "per_sm_GBps",
)
_AT_MOST_ONE = ("nvlink_efficiency", "scaleout_efficiency.")  # fractions of line rate


@dataclass
class CalibrationFit:
    """Fitted values (unit of calibration.yaml) with relative one-sigma, and what was held fixed."""

    values: dict[str, float]
    relative_sigma: dict[str, float]
    held: list[str]  # not constrained by the cases fitted: kept at the table value


def fit_table(traffics: Sequence[CaseTraffic], names: Sequence[str] = FIT_PARAMETERS) -> CalibrationFit:
    """Least squares of log(model / published) over ``traffics`` for the parameters ``names``."""
    base = table_values()
    names = list(names)

    def residual_of(active: list[str]) -> Callable[[np.ndarray], np.ndarray]:
        def residual(log_x: np.ndarray) -> np.ndarray:
            table = {**base, **dict(zip(active, np.exp(log_x), strict=True))}
            return np.array(
                [math.log(case_value(t, table)[0] / t.case.published) for t in traffics], dtype=np.float64
            )

        return residual

    start = np.log([max(base[n], 1e-3) for n in names])
    held_idx = unconstrained(jacobian(residual_of(names), start, step=0.05))
    active = [n for i, n in enumerate(names) if i not in held_idx]
    high = np.array([0.0 if n.startswith(_AT_MOST_ONE) else np.inf for n in active])
    if not active:
        return CalibrationFit({}, {}, names)
    fit = levenberg_marquardt(
        residual_of(active),
        np.log([max(base[n], 1e-3) for n in active]),
        bounds=(np.full(len(active), -np.inf), high),
    )
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
    traffics = [case_traffic(case, tokens, seed) for case in calibration_cases()]
    loso: dict[int, float] = {}
    if leave_one_out:
        trusted = [t for t in traffics if not t.case.untrusted]
        for source in sorted({t.case.source for t in trusted}):
            fit = fit_table([t for t in trusted if t.case.source != source])
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
