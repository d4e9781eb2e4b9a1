"""Split a [src][dst] byte matrix by the link class each byte crosses.

Classes: ``self`` (src == dst: stays on the GPU), ``nvlink`` (same NVLink domain, src != dst) and ``scaleout``
(different domains: leaves through the NIC). Per rank, sent and received bytes per class; in total, bytes per
class; per class, the bottleneck rank (the one with the most bytes in one direction).

Bandwidths derived here are per GPU per direction (bytes one rank sent, or received, per second), compared
with the spec's per-direction figures: NVLink ``nvlink_GBps_per_direction`` and NIC
``nic_GBps_per_direction``. Aggregates are one direction too (every link byte is sent once), compared with the
spec's aggregate halved and scaled to the ranks used. All functions are vectorized over the n x n matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import UsageError

LINK_CLASSES = ("self", "nvlink", "scaleout")
LINK_CLASS_IDS = {name: i for i, name in enumerate(LINK_CLASSES)}
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


def _split(m: np.ndarray, dom: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(self bytes per rank, nvlink matrix, scaleout matrix), zeros elsewhere."""
    same = dom[:, None] == dom[None, :]
    np.fill_diagonal(same, False)
    other = dom[:, None] != dom[None, :]
    zero = np.zeros((), dtype=m.dtype)
    return np.diagonal(m).copy(), np.where(same, m, zero), np.where(other, m, zero)


def per_rank_link_bytes(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank arrays: ``self_bytes``, ``{nvlink,scaleout}_{send,recv}_bytes``, ``..._peers`` (ranks with
    a nonzero segment in that class and direction), plus ``total_{send,recv}_bytes`` (self included)."""
    m, dom = _check(matrix, domain_of_rank)
    self_bytes, nvlink, scaleout = _split(m, dom)
    out: dict[str, np.ndarray] = {"rank": np.arange(m.shape[0]), "domain": dom, "self_bytes": self_bytes}
    for name, part in (("nvlink", nvlink), ("scaleout", scaleout)):
        out[f"{name}_send_bytes"] = part.sum(axis=1)
        out[f"{name}_recv_bytes"] = part.sum(axis=0)
        nonzero = part > 0
        out[f"{name}_send_peers"] = nonzero.sum(axis=1)
        out[f"{name}_recv_peers"] = nonzero.sum(axis=0)
    out["total_send_bytes"] = m.sum(axis=1)
    out["total_recv_bytes"] = m.sum(axis=0)
    return out


def link_frame(matrix: np.ndarray, domain_of_rank: np.ndarray) -> pd.DataFrame:
    """``per_rank_link_bytes`` as a DataFrame, one row per rank."""
    return pd.DataFrame(per_rank_link_bytes(matrix, domain_of_rank))


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
    """Per link class (and ``link`` = both, and ``total`` = self included) the busiest rank and direction.

    Each value: ``{"rank", "direction" ("send"|"recv"), "bytes"}``; rank -1 and bytes 0 when the class
    carries nothing. Ties go to the lowest rank, sends before receives.
    """
    per_rank = per_rank_link_bytes(matrix, domain_of_rank)
    sides = {
        "nvlink": (per_rank["nvlink_send_bytes"], per_rank["nvlink_recv_bytes"]),
        "scaleout": (per_rank["scaleout_send_bytes"], per_rank["scaleout_recv_bytes"]),
        "link": (
            per_rank["nvlink_send_bytes"] + per_rank["scaleout_send_bytes"],
            per_rank["nvlink_recv_bytes"] + per_rank["scaleout_recv_bytes"],
        ),
        "total": (per_rank["total_send_bytes"], per_rank["total_recv_bytes"]),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (send, recv) in sides.items():
        both = np.stack([send, recv], axis=1)  # [n, 2]
        flat = int(np.argmax(both))
        rank, direction = divmod(flat, 2)
        value = int(both.ravel()[flat]) if both.size else 0
        out[name] = {"rank": rank if value > 0 else -1, "direction": DIRECTIONS[direction], "bytes": value}
    return out


def link_class_byte_columns(matrix: np.ndarray, domain_of_rank: np.ndarray) -> dict[str, Any]:
    """The byte columns of one result row (no time, no spec: the harness stores these, the report derives
    bandwidths from them so a re-render with another spec never trusts stale figures).

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


def class_bandwidth_columns(
    name: str,
    class_bytes: Any,
    bottleneck_bytes: Any,
    time_s: Any,
    per_gpu_spec_GBps: Any,
    aggregate_spec_GBps: Any,
) -> dict[str, Any]:
    """Bandwidth columns of link class ``name`` (scalars, numpy arrays or pandas Series alike).

    ``c_GBps`` = bottleneck rank's bytes of the class, one direction / time (achieved per GPU per direction);
    ``c_spec_GBps``, ``c_pct_spec``; ``c_agg_GBps`` = all bytes of the class / time (one direction: each byte
    is sent once); ``c_agg_spec_GBps``, ``c_agg_pct_spec``. Times that are not positive give NaN; percentages
    are NaN where the class carries nothing (no claim about a link that was not used).
    """
    time = np.asarray(time_s, dtype=np.float64)
    time = np.where(time > 0, time, np.nan)
    carried = np.asarray(class_bytes, dtype=np.float64)
    achieved = np.asarray(bottleneck_bytes, dtype=np.float64) / time / 1e9
    aggregate = carried / time / 1e9
    per_gpu = np.asarray(per_gpu_spec_GBps, dtype=np.float64)
    agg_spec = np.asarray(aggregate_spec_GBps, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where((carried > 0) & (per_gpu > 0), 100.0 * achieved / per_gpu, np.nan)
        agg_pct = np.where((carried > 0) & (agg_spec > 0), 100.0 * aggregate / agg_spec, np.nan)

    def out(values: np.ndarray) -> Any:
        return float(values) if values.ndim == 0 else values

    return {
        f"{name}_GBps": out(achieved),
        f"{name}_spec_GBps": out(per_gpu + 0.0 * achieved),
        f"{name}_pct_spec": out(pct),
        f"{name}_agg_GBps": out(aggregate),
        f"{name}_agg_spec_GBps": out(agg_spec + 0.0 * aggregate),
        f"{name}_agg_pct_spec": out(agg_pct),
    }


def link_class_columns(
    row_bytes_matrix: np.ndarray, domain_of_rank: np.ndarray, time_s: float, spec: Any
) -> dict[str, Any]:
    """Every per-class column of one result row from its matrix, time and spec (see
    ``link_class_byte_columns`` and ``class_bandwidth_columns``).

    ``row_bytes_matrix``: the phase's [src][dst] bytes; ``time_s``: the phase time (max over ranks);
    ``spec``: a ``SystemSpec`` (or a name/path ``load_spec`` accepts). Per-GPU specs are per
    direction: NVLink ``nvlink_GBps_per_direction``, scale-out NIC line rate / 8; aggregates: NVLink =
    domain aggregate / 2 scaled to the ranks, scale-out = ranks x NIC per direction.
    Also ``alg_GBps``: the busiest rank's max(sent, received) bytes, self INCLUDED, / time (what the layer
    sees); ``link_GBps``: the busiest rank's max(sent, received) link bytes, self EXCLUDED, / time.
    """
    from commbench.inputs.specs import load_spec  # local: keeps this module importable without the catalogue

    if not time_s or time_s <= 0:
        raise UsageError(f"phase time must be positive to compute bandwidth, got {time_s!r} s")
    system = load_spec(spec) if not hasattr(spec, "nvlink_GBps_per_direction") else spec
    m, dom = _check(row_bytes_matrix, domain_of_rank)
    n = m.shape[0]
    cols = link_class_byte_columns(m, dom)
    per_gpu_spec = {"nvlink": system.nvlink_GBps_per_direction, "scaleout": system.nic_GBps_per_direction}
    agg_spec = {
        "nvlink": system.aggregate_GBps_per_direction(n),
        "scaleout": n * system.nic_GBps_per_direction,
    }
    for name in ("nvlink", "scaleout"):
        cols.update(
            class_bandwidth_columns(
                name,
                cols[f"{name}_bytes"],
                cols[f"{name}_bottleneck_bytes"],
                time_s,
                per_gpu_spec[name],
                agg_spec[name],
            )
        )
    necks = class_bottlenecks(m, dom)
    cols["alg_GBps"] = necks["total"]["bytes"] / time_s / 1e9
    cols["link_GBps"] = necks["link"]["bytes"] / time_s / 1e9
    return cols
