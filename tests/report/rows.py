"""Harness-like result and rank rows built from [src][dst] byte matrices, for the report's tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from commbench.traffic.links import link_class_byte_columns, per_rank_link_bytes

# 4 ranks in two NVLink domains {0, 1} and {2, 3}.
TWO_DOMAINS = np.array([0, 0, 1, 1])


def row_from_matrix(
    matrix: np.ndarray,
    time_us: float,
    *,
    pattern: str,
    phase: str,
    size_bytes: int | None = None,
    domains: np.ndarray | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A result row as the harness emits it: bytes and times only (self traffic on the diagonal)."""
    sent, recv, self_bytes = matrix.sum(1), matrix.sum(0), np.diag(matrix)
    if size_bytes is None:  # MoE rows: the bottleneck rank's max(sent, received), self included
        size_bytes = int(np.maximum(sent, recv).max())
    domains = np.zeros(len(matrix), dtype=np.int64) if domains is None else domains
    return {
        "pattern": pattern,
        "phase": phase,
        "backend": "gloo",
        "backend_name": "gloo",
        "emulated": False,
        "world_size": matrix.shape[0],
        "skew": extra.pop("skew", None),
        "size_bytes": size_bytes,
        "total_bytes": int(matrix.sum()),
        "link_bytes": int(matrix.sum() - self_bytes.sum()),
        "max_send_bytes": int(sent.max()),
        "max_recv_bytes": int(recv.max()),
        "max_send_link_bytes": int((sent - self_bytes).max()),
        "max_recv_link_bytes": int((recv - self_bytes).max()),
        **link_class_byte_columns(matrix, domains),
        "time_us_min": time_us * 0.9,
        "time_us_p50": time_us,
        "time_us_p99": time_us * 1.2,
        "time_us_mean": time_us,
        "wrong": 0,
        "knobs": {},
        **extra,
    }


def rank_rows_from_matrix(
    row: dict[str, Any], matrix: np.ndarray, domains: np.ndarray
) -> list[dict[str, Any]]:
    """The rank rows of ``row``'s phase as the harness emits them (bytes per class, no bandwidth)."""
    per_rank = per_rank_link_bytes(matrix, domains)
    sent, received, self_bytes = (
        per_rank["total_send_bytes"],
        per_rank["total_recv_bytes"],
        per_rank["self_bytes"],
    )
    classes = {
        "link": (sent - self_bytes, received - self_bytes),
        "nvlink": (per_rank["nvlink_send_bytes"], per_rank["nvlink_recv_bytes"]),
        "scaleout": (per_rank["scaleout_send_bytes"], per_rank["scaleout_recv_bytes"]),
    }
    rows = []
    for rank in range(len(matrix)):
        record: dict[str, Any] = {
            "pattern": row["pattern"],
            "phase": row["phase"],
            "backend": row["backend"],
            "skew": row.get("skew"),
            "rank": rank,
            "domain": int(domains[rank]),
            "sent_bytes": int(sent[rank]),
            "recv_bytes": int(received[rank]),
            "self_bytes": int(self_bytes[rank]),
            "knobs": dict(row["knobs"]),
        }
        for name, (out, into) in classes.items():
            record[f"{name}_sent_bytes"] = int(out[rank])
            record[f"{name}_recv_bytes"] = int(into[rank])
        record["time_us_p50"] = row["time_us_p50"] * 0.8
        record["phase_time_us_p50"] = row["time_us_p50"]
        rows.append(record)
    return rows


def balanced_matrix(world: int, size_bytes: int) -> np.ndarray:
    return np.full((world, world), size_bytes // world, dtype=np.int64)


def balanced_row(world: int, size_bytes: int, time_us: float, **extra: Any) -> dict[str, Any]:
    matrix = balanced_matrix(world, size_bytes)
    return row_from_matrix(
        matrix, time_us, pattern="balanced", phase="alltoall", size_bytes=size_bytes, **extra
    )


# Rank 2 is the hot destination in dispatch; combine is the transpose (x2 bytes).
DISPATCH = (
    np.array([[10, 20, 300, 5], [7, 11, 290, 3], [4, 6, 400, 2], [9, 1, 250, 8]], dtype=np.int64) * 1000
)


def skewed_rows(time_us: float = 100.0, **extra: Any) -> list[dict[str, Any]]:
    common = dict(pattern="toy", skew="hot:1:0.5", send_mode="token", tokens_per_rank=64, maxvio=1.5, **extra)
    return [
        row_from_matrix(DISPATCH, time_us, phase="dispatch", **common),
        row_from_matrix(DISPATCH.T.copy() * 2, 2 * time_us, phase="combine", **common),
    ]


def all_rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank rows for rows made by ``balanced_row`` and ``skewed_rows`` (one domain)."""
    out = []
    for row in rows:
        if row["phase"] == "alltoall":
            matrix = balanced_matrix(row["world_size"], row["size_bytes"])
        else:
            matrix = DISPATCH if row["phase"] == "dispatch" else DISPATCH.T * 2
        out += rank_rows_from_matrix(row, matrix, np.zeros(len(matrix), dtype=np.int64))
    return out
