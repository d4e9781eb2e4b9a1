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

from commbench.fabric.model import (
    NVLINK,
    RECV,
    SCALEOUT,
    SEND,
    FabricParams,
    LinkLoads,
    PhasePrediction,
    balanced_traffic,
    make_fabric,
    predict_loads,
    predict_phase,
)
from commbench.inputs.userfiles import load_yaml

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
# score in each node. FP8 dispatch rows = hidden x (1 + 4/128) bytes, BF16 combine rows = 2 x hidden.
DEEPEP_TOKENS, DEEPEP_HIDDEN, DEEPEP_EXPERTS, DEEPEP_TOPK = 4096, 7168, 256, 8
DEEPEP_FP8_ROW = DEEPEP_HIDDEN + DEEPEP_HIDDEN // 128 * 4
DEEPEP_BF16_ROW = 2 * DEEPEP_HIDDEN
DEEPEP_LOCAL_RANKS = 8


def deepep_test_hits(num_ranks: int, tokens: int, rng: np.random.Generator, chunk: int = 8) -> np.ndarray:
    """bool [src rank, token, dst rank]: which ranks each token reaches under DeepEP's test routing
    (|N(0,1)| + 1 scores, node-group limit top-min(nodes, 4) by max score, then top-8 experts)."""
    nodes = max(1, num_ranks // DEEPEP_LOCAL_RANKS)
    topk_groups = min(nodes, 4)
    experts_per_node = DEEPEP_EXPERTS // nodes
    experts_per_rank = DEEPEP_EXPERTS // num_ranks
    hits = np.zeros((num_ranks, tokens, num_ranks), dtype=bool)
    for start in range(0, num_ranks, chunk):
        count = min(chunk, num_ranks - start)
        scores = np.abs(rng.standard_normal((count, tokens, DEEPEP_EXPERTS), dtype=np.float32)) + 1.0
        if nodes > 1 and topk_groups < nodes:
            group_scores = scores.reshape(count, tokens, nodes, experts_per_node).max(-1)
            keep = np.argpartition(-group_scores, topk_groups - 1, axis=-1)[..., :topk_groups]
            kept = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(kept, keep, True, axis=-1)
            scores = np.where(np.repeat(kept, experts_per_node, axis=-1), scores, 0.0)
        experts = np.argpartition(-scores, DEEPEP_TOPK - 1, axis=-1)[..., :DEEPEP_TOPK]
        np.put_along_axis(hits[start : start + count], experts // experts_per_rank, True, axis=-1)
    return hits


def deepep_internode_loads(
    hits: np.ndarray, row_bytes: int, combine: bool = False
) -> tuple[LinkLoads, np.ndarray]:
    """DeepEP normal-kernel traffic (dispatch, or its mirror for combine) and the bytes DeepEP's test counts.

    A token crosses the network once per destination node (to the rank with the sender's local index there),
    then that rank forwards it over NVLink to each rank of the node that holds its experts; the sender's own
    node is reached over NVLink directly. The counted bytes follow the test: RDMA = (token, node) pairs,
    the sender's own node included; NVL (intranode) = rows received, the rank's own included.
    """
    num_ranks, tokens, _ = hits.shape
    local_ranks = min(DEEPEP_LOCAL_RANKS, num_ranks)
    nodes = num_ranks // local_ranks
    by_node = hits.reshape(num_ranks, tokens, nodes, local_ranks)
    node_hit = by_node.any(-1)  # [src, token, node]
    src_node = np.arange(num_ranks) // local_ranks
    src_local = np.arange(num_ranks) % local_ranks
    rows_to_node = node_hit.sum(1).astype(np.float64)  # [src, node]
    remote = src_node[:, None] != np.arange(nodes)[None, :]
    # NVLink forwarding at node b by the rank with the sender's local index l: every rank hit there but l.
    hits_at = by_node.sum(1).astype(np.float64)  # [src, node, local]: tokens of src that reach (node, local)
    own_slot = hits_at[np.arange(num_ranks), :, src_local]  # [src, node]: reach the forwarder itself
    forward_rows = hits_at.sum(-1) - own_slot  # [src, node]
    receive_rows = hits_at.copy()
    receive_rows[np.arange(num_ranks), :, src_local] = 0.0  # the forwarder's own rows stay on its GPU

    loads = np.zeros((num_ranks, 2, 2))
    msgs = np.zeros((num_ranks, 2, 2), dtype=np.int64)
    nic_out = np.where(remote, rows_to_node, 0.0)
    loads[:, SCALEOUT, SEND] = nic_out.sum(1) * row_bytes
    msgs[:, SCALEOUT, SEND] = (nic_out > 0).sum(1)
    # The receiving NIC of node b with local index l takes what every remote sender with local index l sends.
    recv_nic = np.zeros((nodes, local_ranks))
    recv_msgs = np.zeros((nodes, local_ranks), dtype=np.int64)
    np.add.at(recv_nic, (slice(None), src_local), nic_out.T)
    np.add.at(recv_msgs, (slice(None), src_local), (nic_out > 0).T.astype(np.int64))
    loads[:, SCALEOUT, RECV] = recv_nic.reshape(-1) * row_bytes
    msgs[:, SCALEOUT, RECV] = recv_msgs.reshape(-1)
    forward = np.zeros((nodes, local_ranks))
    np.add.at(forward, (slice(None), src_local), forward_rows.T)
    loads[:, NVLINK, SEND] = forward.reshape(-1) * row_bytes
    loads[:, NVLINK, RECV] = receive_rows.sum(0).reshape(-1) * row_bytes
    msgs[:, NVLINK, :] = local_ranks - 1
    if combine:  # combine mirrors dispatch: every send becomes a receive
        loads = loads[:, :, ::-1].copy()
        msgs = msgs[:, :, ::-1].copy()
    rdma_counted = rows_to_node.sum(1) * row_bytes
    nvl_counted = hits.sum((0, 1)).astype(np.float64) * row_bytes
    counted = rdma_counted if nodes > 1 else nvl_counted
    total = hits.sum() * float(row_bytes)
    return LinkLoads(bytes=loads, messages=msgs, total_bytes=total), counted


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
    hits = deepep_test_hits(case.world_size, tokens, np.random.default_rng(seed))
    combine = case.kind == "deepep_combine"
    loads, counted = deepep_internode_loads(hits, DEEPEP_BF16_ROW if combine else DEEPEP_FP8_ROW, combine)
    prediction = predict_loads(loads, fabric)
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
