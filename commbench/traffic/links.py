"""Bytes per link class: split a [src][dst] byte matrix by the link each byte crosses.

Classes: ``self`` (src == dst: stays on the GPU), ``nvlink`` (same NVLink domain, src != dst) and ``scaleout``
(different domains: leaves through the NIC). Per rank, sent and received bytes per class; in total, bytes per
class; per class, the bottleneck rank (the one with the most bytes in one direction). Bytes only: the report
(``commbench.report.frame``) turns them into bandwidths against a spec. Vectorized over the n x n matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commbench.errors import UsageError

LINK_CLASSES = ("self", "nvlink", "scaleout")
DIRECTIONS = ("send", "recv")


def _check(matrix: np.ndarray, domain_of_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(matrix)
    dom = np.asarray(domain_of_rank, dtype=np.int64).ravel()
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise UsageError(f"traffic matrix must be square [src][dst], got shape {m.shape}")
    if dom.size != m.shape[0]:
        raise UsageError(f"domain_of_rank has {dom.size} entries for a {m.shape[0]}-rank matrix")
    return m, dom


def link_class_matrix(domain_of_rank: np.ndarray) -> np.ndarray:
    """int8 [n, n]: 0 = self, 1 = nvlink (same domain), 2 = scaleout (different domains)."""
    dom = np.asarray(domain_of_rank, dtype=np.int64).ravel()
    classes = np.where(dom[:, None] == dom[None, :], np.int8(1), np.int8(2))
    np.fill_diagonal(classes, 0)
    return classes


def per_rank_link_bytes(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank arrays: ``self_bytes``, ``{nvlink,scaleout}_{send,recv}_bytes`` and
    ``total_{send,recv}_bytes`` (self included)."""
    m, dom = _check(matrix, domain_of_rank)
    classes = link_class_matrix(dom)
    zero = np.zeros((), dtype=m.dtype)
    out: dict[str, np.ndarray] = {"self_bytes": np.diagonal(m).copy()}
    for name in ("nvlink", "scaleout"):
        part = np.where(classes == LINK_CLASSES.index(name), m, zero)
        out[f"{name}_send_bytes"] = part.sum(axis=1)
        out[f"{name}_recv_bytes"] = part.sum(axis=0)
    out["total_send_bytes"] = m.sum(axis=1)
    out["total_recv_bytes"] = m.sum(axis=0)
    return out


def link_class_bytes(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, int]:
    """Total bytes per class, ``link`` (nvlink + scaleout) and ``total`` (all, self included)."""
    m, dom = _check(matrix, domain_of_rank)
    classes = link_class_matrix(dom)
    sums = np.bincount(classes.ravel(), weights=m.ravel().astype(np.float64), minlength=3)
    # bincount sums in float64: exact for totals below 2**53 bytes (9 PB), far beyond any pattern.
    out = {name: int(round(sums[i])) for i, name in enumerate(LINK_CLASSES)}
    out["link"] = out["nvlink"] + out["scaleout"]
    out["total"] = int(m.sum())
    return out


def class_bottlenecks(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per link class (nvlink, scaleout) the busiest rank and direction.

    Each value: ``{"rank", "direction" ("send"|"recv"), "bytes"}``; rank -1 and bytes 0 when the class
    carries nothing. Ties go to the lowest rank, sends before receives.
    """
    per_rank = per_rank_link_bytes(matrix, domain_of_rank)
    out: dict[str, dict[str, Any]] = {}
    for name in ("nvlink", "scaleout"):
        both = np.stack([per_rank[f"{name}_send_bytes"], per_rank[f"{name}_recv_bytes"]], axis=1)  # [n, 2]
        flat = int(np.argmax(both))
        rank, direction = divmod(flat, 2)
        value = int(both.ravel()[flat]) if both.size else 0
        out[name] = {"rank": rank if value > 0 else -1, "direction": DIRECTIONS[direction], "bytes": value}
    return out


def link_class_byte_columns(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, Any]:
    """The byte columns of one result row (no time, no spec: the report derives bandwidths from them, so a
    re-render with another spec never trusts stale figures).

    ``self_bytes``, ``nvlink_bytes``, ``scaleout_bytes``, ``link_bytes`` (nvlink + scaleout): totals over
    ranks; per class ``c`` in (nvlink, scaleout): ``c_bottleneck_rank`` (-1 when the class carries nothing),
    ``c_bottleneck_dir`` (send|recv, "" when nothing), ``c_bottleneck_bytes`` (that rank's bytes of the class
    in that one direction).
    """
    m, dom = _check(matrix, domain_of_rank)
    totals = link_class_bytes(m, dom)
    necks = class_bottlenecks(m, dom)
    cols: dict[str, Any] = {f"{name}_bytes": totals[name] for name in ("self", "nvlink", "scaleout", "link")}
    for name in ("nvlink", "scaleout"):
        neck = necks[name]
        cols[f"{name}_bottleneck_rank"] = neck["rank"]
        cols[f"{name}_bottleneck_dir"] = neck["direction"] if totals[name] > 0 else ""
        cols[f"{name}_bottleneck_bytes"] = neck["bytes"]
    return cols
