"""Calibration: the fabric model against published all-to-all figures (nccl-tests and DeepEP).

The cases are data (``calibration.yaml`` next to this module: each figure as its source defines it, with its
source); this module predicts the same figure for each case. ``commbench simulate --calibration`` prints the
table of docs/fabric-model.md from ``calibration_rows``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

import numpy as np

from commbench.fabric.model import FabricParams, PhasePrediction, balanced_traffic, make_fabric, predict_phase
from commbench.inputs.userfiles import load_yaml
from commbench.traffic.nodes import Nodes, node_stage_rows, node_token_counts

KINDS = ("nccl_busbw", "nccl_time_us", "deepep_dispatch", "deepep_combine")


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


@functools.lru_cache(maxsize=1)
def calibration_cases() -> tuple[CalibrationCase, ...]:
    """The cases of ``calibration.yaml``, in file order."""
    text = resources.files("commbench.fabric").joinpath("calibration.yaml").read_text(encoding="utf-8")
    known = {f.name for f in fields(CalibrationCase)}
    cases = []
    for entry in load_yaml(text, "calibration.yaml")["cases"]:  # the one bounded YAML loader
        unknown = sorted(set(entry) - known)
        if unknown or entry.get("kind") not in KINDS:
            raise ValueError(
                f"calibration.yaml, case {entry.get('label')!r}: unknown keys {unknown} or kind "
                f"{entry.get('kind')!r} not one of {', '.join(KINDS)}"
            )
        cases.append(CalibrationCase(**{**entry, "published": float(entry["published"])}))
    return tuple(cases)


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


def predict_case(
    case: CalibrationCase, params: FabricParams | None, tokens: int, seed: int
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure, and the prediction behind it."""
    fabric = make_fabric(case.spec, case.world_size, ranks_per_domain=case.ranks_per_domain, params=params)
    if case.kind.startswith("nccl"):
        prediction = predict_phase(
            balanced_traffic(case.world_size, case.size_bytes / case.world_size), fabric
        )
        if case.kind == "nccl_time_us":
            return prediction.time_s * 1e6, prediction
        busbw = case.size_bytes * (case.world_size - 1) / case.world_size / prediction.time_s / 1e9
        return busbw, prediction
    per_node = min(case.ranks_per_domain, case.world_size)
    hits = deepep_test_hits(case.world_size, per_node, tokens, np.random.default_rng(seed))
    combine = case.kind == "deepep_combine"
    nodes = Nodes.of(fabric.layout.domain_of_rank)
    matrix, counted = deepep_node_traffic(
        hits, nodes, DEEPEP_BF16_ROW if combine else DEEPEP_FP8_ROW, combine
    )
    prediction = predict_phase(matrix, fabric)
    # DeepEP prints rank 0's counted bytes over its kernel time; the mean over ranks is its expectation.
    return float(counted.mean()) / prediction.time_s / 1e9, prediction


def calibration_rows(
    params: FabricParams | None = None, tokens: int = DEEPEP_TOKENS, seed: int = 0
) -> list[dict[str, Any]]:
    """Every calibration case with the model's prediction and its error (prediction / published - 1)."""
    rows = []
    for case in calibration_cases():
        predicted, prediction = predict_case(case, params, tokens, seed)
        rows.append(
            {
                "case": case.label,
                "spec": case.spec,
                "ranks": case.world_size,
                "metric": case.metric,
                "published": case.published,
                "predicted": predicted,
                "error_pct": 100.0 * (predicted / case.published - 1.0),
                "bottleneck": prediction.bottleneck,
                "source": case.source,
                "note": case.note,
            }
        )
    return rows
