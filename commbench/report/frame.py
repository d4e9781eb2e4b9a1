"""Bytes and times -> GB/s, %spec and aggregates: the only place commbench computes a bandwidth.

Harness rows hold bytes and times only. ``results_frame`` adds every derived column of a result row
(``DERIVED_COLUMNS``) against a ``SystemSpec``; ``rank_frame`` adds the per-rank GB/s of ranks.csv. Derived
columns are always recomputed, so a re-render with another spec never trusts stale saved figures.
``CONVENTIONS`` says what every figure means; it is printed in summary.md, report.html and results.json.

Pages are rendered from a folder's files alone (``report.folder.writer.render_folder``), so the rows come
typed from ``report.folder.reading``; the harness's rows in memory only pass through here on their way into
results.csv.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import UsageError
from commbench.inputs.specs import SystemSpec, load_spec
from commbench.plain import knobs_text

# Every convention a reader needs to interpret the numbers; shown in summary.md, report.html and results.json.
CONVENTIONS = """\
Conventions
- Bytes are payload only: token rows, FP8 scales included; routing metadata and the counts exchange are not
  counted (the counts exchange is inside the timed dispatch: the backend's collective, or on nvshmem with
  counts=device NVSHMEM puts into the peers' count slots and the layout computed on the GPU, no host sync;
  the rows' knobs say which). Dispatch rows are FP8 (hidden bytes + one fp32 scale per scale block) or
  BF16 (2 x hidden bytes); combine rows are BF16 (2 x hidden bytes).
- send_mode=token (DeepEP's intranode normal kernels): a token is sent once to each destination rank that
  holds at least one of its selected experts (de-duplicated per destination rank). send_mode=selection: one
  row per (token, expert) selection. send_mode=node (per-node dispatch, as DeepEP's internode kernels,
  Hybrid-EP and UCCL-EP; a node = an NVLink domain): a token is sent once to each OTHER node holding one of
  its experts, over scale-out to the rank with the sender's local index there (rows of phase
  dispatch:scaleout), then once to each rank of the node holding them, over NVLink, by that rank or, on the
  sender's own node, by the sender (dispatch:nvlink); combine mirrors it (combine:nvlink, the rows reduced
  per token on the rank that forwarded them, then combine:scaleout, one BF16 row per (token, node)). A
  node-mode dispatch or combine row counts both stages' bytes, each on the link it crosses (a forwarded
  token twice: once per hop), and times both stages back to back; a stage row times that stage alone.
  Dropped selections (mask ratio, capacity) send nothing.
- size(B): the bottleneck rank's max(bytes sent, bytes received), self traffic (a rank to itself) INCLUDED.
  For the balanced all-to-all, size = bytes each rank sends in total (nccl-tests alltoall size).
- time(us): the row's timing column says how it was timed (rows without one: iteration). iteration = a barrier
  before each timed iteration; an iteration's time is its maximum across ranks; min, p50, p99 and mean are
  taken over the timed iterations. window (as nccl-tests) = the timed iterations run back to back in one
  window, no barrier between them; a rank's time = window / iterations, the row's time = the maximum across
  ranks (nccl-tests' default, -a 1, averages across ranks instead). With --blocking 0 (the default, nccl-tests
  -z 0) the host issues a window's calls without waiting for each and waits once at its end (gloo runs up to
  two calls at once on its worker threads; NCCL runs them in order on its stream); with --blocking 1 it waits
  for each call before the next. Combine and node-mode stages wait inside each call. graph (--cuda-graph N, as
  nccl-tests -G) = N calls captured into one CUDA graph, the graph replayed --iters times back to back in one
  window: a rank's time = window / (iters x N), the row's time = the maximum across ranks; no host launch per
  call, so it is the device time of the call (a decode layer's figure), and graph rows are their own cases,
  never compared with window or iteration rows. Warm-up iterations are not timed.
- Which time a figure uses: the balanced all-to-all (the nccl-tests table on stdout, its summary.md and
  report.html table) and results.json's nccl-tests fields (time, alg_bw, bus_bw, out_of_place) use
  nccl-tests' time, the mean (time_us_mean; algbw_mean_GBps, busbw_mean_GBps, pct_spec_mean); MoE tables
  show time mean, p50 and p99 and take algbw, busbw, %spec and every other GB/s from p50 (time_us_p50;
  algbw_GBps, busbw_GBps, ...).
- The balanced all-to-all on stdout is printed in nccl-tests alltoall_perf's layout: count = elements each
  rank sends to each peer (size / ranks, as nccl-tests' count for alltoall), type uint8 (commbench moves
  bytes, so #wrong counts bytes = elements), redop none, root -1. The in-place columns time the same
  exchange with one buffer as its input and output (nccl-tests alltoall's in-place run: sendbuff ==
  recvbuff), right after the out-of-place one, the same way (warm-up, iterations, timing, the mean); where
  the backend has no in-place call (Backend.in_place False: mock, sim, shmem-emu, nvshmem, the dispatcher
  adapters) they say N/A. The in-place #wrong is N/A: an all-to-all whose input and output are one buffer
  may overwrite a row before sending it, so its result is undefined and it is not checked (nccl-tests:
  "We don't support in-place alltoall", its in-place #wrong N/A).
- Every bandwidth is ONE direction (bytes a rank sent, or received, per second) and is compared with a
  per-direction spec; a one-way figure is never compared with a bidirectional spec (NVLink 5: 1.8 TB/s
  bidirectional = 900 GB/s per direction; a NIC's line rate, e.g. 800 Gb/s = 100 GB/s, is per direction).
- algbw (algorithm bandwidth, what the MoE layer sees) = size / time, self traffic INCLUDED, like DeepEP's
  and nccl-tests' algbw.
- busbw (link bandwidth, bytes that crossed a link) = the bottleneck rank's link bytes in one direction, max
  over ranks of max(bytes sent, bytes received) EXCLUDING self traffic, / time. For the balanced all-to-all
  busbw = algbw x (n-1)/n, exactly nccl-tests' busbw.
- per-GPU bandwidth = busbw; %spec compares it with the per-GPU NVLink spec per direction (all link bytes,
  whatever link they crossed: with scale-out traffic read the per-class columns instead).
- agg = all link bytes of the job (every rank's sends, self traffic excluded) / time, one direction;
  %agg compares it with the NVLink-domain aggregate per direction scaled to the ranks used (NVL72: 130 TB/s
  bidirectional for 72 GPUs = 65 TB/s one way, x ranks / 72).
- Link classes: self (src == dst, stays on the GPU), nvlink (another rank of the same NVLink domain) and
  scaleout (a rank of another domain, through the NIC). Domains come from NVML's GPU fabric clique (an NVL72
  rack), else the host, unless --ranks-per-domain / --ranks-per-host override them (CPU what-ifs).
  nvlink_GBps / scaleout_GBps = the class's bottleneck rank's bytes of that class in its busiest direction /
  the phase time, against the per-GPU spec of the class (NVLink per direction; NIC line rate / 8);
  *_agg_GBps = all bytes of the class / time, against the class aggregate (NVLink: domain aggregate / 2 x
  ranks / GPUs per domain; scale-out: ranks x NIC per direction). The time is the whole phase, so a class's
  figure is what it carried over the phase, a lower bound of its own rate when the other class is slower.
- Per-rank rows (ranks.csv): bytes sent and received per class; *_GBps = those bytes / the phase time (its
  p50, see time), one direction.
- Imbalance cost: right after an MoE job's phases, the same launch runs dispatch (counts exchange included)
  and combine (weighted reduction included) again through the same code path on a uniform layout of the
  same rows (the uniform_ref_* columns; not the balanced sweep): same total rows, row sizes, tokens per
  rank and send mode, every (src, dst) pair (self included) total / world^2 rows (the remainder one row per
  pair), so every rank sends and receives the same rows; both are verified. skew_cost = time / uniform_ref
  time (1 = skew costs nothing); skew_bw_loss_pct = 100 x (1 - (total bytes / time) / (uniform_ref bytes /
  uniform_ref time)). Uniform routing is random, so it shows the cost of statistical imbalance alone.
- Avg bus bandwidth = the mean of busbw (from the mean time) over the balanced all-to-all rows only,
  out-of-place and in-place (where run) alike, as nccl-tests' footer; MoE phases are never averaged in.
- GB = 1e9 bytes; GB/s = 1e9 bytes per second; time in microseconds.
- #wrong: mismatched bytes after dispatch and the balanced all-to-all, mismatched output elements after
  combine (float64 reference, tolerance 1e-4 x sum |w x| + 1e-6; node mode's combine and combine:scaleout
  2^-7 x sum |w x| + 1e-6: the forwarded partial sums cross the scale-out link in BF16, as DeepEP's
  internode combine), summed over ranks and verified
  iterations; 0 = every verified iteration matched. check (a column of every row) says which were verified.
  checksum (default) and every: before each timed iteration every receive buffer is filled with a sentinel
  (0xFF bytes: a row header no (src, token) has, NaN as bf16/fp32), outside the timer, so an iteration
  that moves nothing cannot pass on stale bytes; checksum = each timed iteration's rows checksummed
  (header + sum of 8-byte words; a row whose checksum differs counts all its bytes), combine output
  compared element by element, the last iteration verified byte for byte; every = every timed iteration
  verified byte for byte (slower). window-last (window timing) = the receive buffers poisoned once before
  the timed window, the back-to-back iterations overwrite the same buffers (as in nccl-tests), the
  window's final output verified byte for byte. Backends that move no data (mock, sim): check n/a, #wrong
  n/a (empty), never 0. Out of bounds values (stdout) = the balanced rows with #wrong > 0 (nccl-tests
  counts its failed checks, one per rank and size).
- maxvio = (max expert load - mean) / mean over experts; expert_cv = std / mean of expert loads;
  expert_max_mean = max / mean.
- arrival_us_p50 (ranks.csv): per rank, the p50 over its timed calls of the host time from the call's
  common start (the barrier before it, or the previous call's return inside a window) until the rank
  entered the call. A rank that is late (host jitter, a slow process, --inject-delay) has a large arrival
  while its peers wait inside the call; the verdict's slow-rank rule judges this column, not end-to-end
  times, which a late rank makes alike on every rank. It does not see a slow link (the data is already in
  flight): the pairwise link test does. wait_us_p50: per rank, the p50 of the host time inside the call
  (its own work plus waiting for its peers; iteration timing: until the device synchronized): a late
  rank's is short, its peers' long.
- No spec (a CPU run, or a GPU the catalogue does not know, unless --spec names one): the report has no
  %spec column and no spec line; its figures are this host's memory and loopback, not a GPU fabric.
- Rows marked "emulated" do not measure a GPU fabric: mock and sim (models), shmem-emu (an emulator), and
  every row measured on CPU ranks (gloo stands in for NCCL: real data moved and verified, but through this
  host's memory and loopback). Their times and bandwidths are not GPU fabric figures."""

CLASS_SUFFIXES = ("GBps", "spec_GBps", "pct_spec", "agg_GBps", "agg_spec_GBps", "agg_pct_spec")
# Columns results_frame adds (always recomputed, so a re-render never trusts stale saved values).
DERIVED_COLUMNS = (
    "algbw_GBps",
    "busbw_GBps",
    "algbw_mean_GBps",
    "busbw_mean_GBps",
    "pct_spec_mean",
    "in_place_algbw_mean_GBps",
    "in_place_busbw_mean_GBps",
    "per_gpu_GBps",
    "spec_name",
    "spec_GBps",
    "pct_spec",
    "agg_GBps",
    "agg_spec_GBps",
    "pct_agg_spec",
    *(f"{name}_{suffix}" for name in ("nvlink", "scaleout") for suffix in CLASS_SUFFIXES),
    "skew_cost",
    "skew_bw_loss_pct",
)
# Per-rank columns rank_frame adds: {class}_{send,recv}_GBps from {class}_{sent,recv}_bytes.
RANK_CLASSES = ("link", "nvlink", "scaleout")
RANK_DERIVED_COLUMNS = tuple(f"{c}_{d}_GBps" for c in RANK_CLASSES for d in ("send", "recv"))

_REQUIRED_COLUMNS = ("size_bytes", "time_us_p50", "max_send_link_bytes", "max_recv_link_bytes")


def fabric_rows(frame: pd.DataFrame) -> pd.Series:
    """Per row, whether its times are a GPU fabric's: its backend's class says so (``gpu_fabric``: nccl,
    nvshmem, the dispatcher adapters) and it is not emulated. gloo, shmem-emu, mock and sim rows (and rows
    of a backend this install does not know) are a host's or a model's."""
    from commbench.backends import loaded_backends

    fabric = {name for name, backend in loaded_backends() if backend.gpu_fabric and not backend.emulated}
    if "backend" not in frame.columns:
        return pd.Series(False, index=frame.index, dtype=bool)
    return frame["backend"].astype(str).isin(fabric) & ~emulated_rows(frame)


def emulated_rows(frame: pd.DataFrame) -> pd.Series:
    """Per row, whether it comes from an emulated backend (mock, sim, shmem-emu): the ``emulated`` bool of
    the harness's rows, which a folder read back holds as a bool too (``report.folder.reading``)."""
    if "emulated" not in frame.columns:
        return pd.Series(False, index=frame.index, dtype=bool)
    return frame["emulated"].eq(True)


def gbps(num_bytes: pd.Series, time_us: pd.Series) -> pd.Series:
    """Bytes moved in ``time_us`` microseconds, in GB/s (1e9 B/s): bytes / (time_us * 1e3); NaN where the
    time is not positive. Every bandwidth of the report is this one formula."""
    time = time_us.astype(float).where(time_us.astype(float) > 0)
    return num_bytes.astype(float) / (time * 1e3)


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    """A column as floats; all-NaN where the rows lack it (older results, balanced rows of old versions)."""
    if column not in frame.columns:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def _as_frame(rows: Iterable[dict[str, Any]] | pd.DataFrame, derived: Iterable[str]) -> pd.DataFrame:
    frame = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame = frame.drop(columns=[c for c in derived if c in frame.columns])
    if "knobs" in frame.columns:  # a frame's knobs are their file text ("k=v k=v"), as results.csv holds them
        frame["knobs"] = [knobs_text(knobs) for knobs in frame["knobs"]]
    return frame


def results_frame(
    rows: Iterable[dict[str, Any]] | pd.DataFrame, spec: SystemSpec | None = None
) -> pd.DataFrame:
    """Harness result rows as a DataFrame plus ``DERIVED_COLUMNS`` (see CONVENTIONS), in GB/s (1e9 B/s),
    against ``spec`` (None: the catalogue's default spec, as ``--spec``'s default)."""
    spec = spec if spec is not None else load_spec()
    frame = _as_frame(rows, DERIVED_COLUMNS)
    if frame.empty:
        for column in DERIVED_COLUMNS:
            frame[column] = pd.Series(dtype=object if column == "spec_name" else float)
        return frame
    missing = [c for c in _REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise UsageError(f"result rows lack column(s) {', '.join(missing)}; not a commbench results file?")
    time_us = _numeric(frame, "time_us_p50")  # text in a hand-edited CSV is NaN, not a crash
    world = _numeric(frame, "world_size")
    domain_aggregate = spec.aggregate_GBps_per_direction(world)
    frame["algbw_GBps"] = gbps(_numeric(frame, "size_bytes"), time_us)
    bottleneck_link_bytes = np.maximum(
        _numeric(frame, "max_send_link_bytes"), _numeric(frame, "max_recv_link_bytes")
    )
    frame["busbw_GBps"] = gbps(bottleneck_link_bytes, time_us)
    # nccl-tests' time is the mean over its timed iterations: the nccl-tests table and JSON use these.
    mean_us = _numeric(frame, "time_us_mean")
    frame["algbw_mean_GBps"] = gbps(_numeric(frame, "size_bytes"), mean_us)
    frame["busbw_mean_GBps"] = gbps(bottleneck_link_bytes, mean_us)
    # The balanced sweep's in-place run (nccl-tests' in-place columns), from its mean time; NaN where none.
    in_place_us = _numeric(frame, "in_place_time_us_mean")
    frame["in_place_algbw_mean_GBps"] = gbps(_numeric(frame, "size_bytes"), in_place_us)
    frame["in_place_busbw_mean_GBps"] = gbps(bottleneck_link_bytes, in_place_us)
    frame["per_gpu_GBps"] = frame["busbw_GBps"]
    frame["spec_name"] = spec.name
    frame["spec_GBps"] = float(spec.nvlink_GBps_per_direction)
    frame["pct_spec"] = 100.0 * frame["per_gpu_GBps"] / frame["spec_GBps"]
    frame["pct_spec_mean"] = 100.0 * frame["busbw_mean_GBps"] / frame["spec_GBps"]
    frame["agg_GBps"] = gbps(_numeric(frame, "link_bytes"), time_us)
    frame["agg_spec_GBps"] = domain_aggregate
    frame["pct_agg_spec"] = 100.0 * frame["agg_GBps"] / frame["agg_spec_GBps"]
    per_gpu_spec = {"nvlink": spec.nvlink_GBps_per_direction, "scaleout": spec.nic_GBps_per_direction}
    aggregate_spec = {
        "nvlink": domain_aggregate,
        "scaleout": spec.nic_GBps_per_direction * world,
    }
    for name in ("nvlink", "scaleout"):
        columns = _class_columns(
            _numeric(frame, f"{name}_bytes"),
            _numeric(frame, f"{name}_bottleneck_bytes"),
            time_us,
            per_gpu_spec[name],
            aggregate_spec[name],
        )
        for suffix, values in zip(CLASS_SUFFIXES, columns, strict=True):
            frame[f"{name}_{suffix}"] = values
    frame["skew_cost"], frame["skew_bw_loss_pct"] = _skew_cost(frame)
    return frame


def _class_columns(
    carried: pd.Series,
    bottleneck: pd.Series,
    time_us: pd.Series,
    per_gpu_spec: float,
    aggregate_spec: pd.Series,
) -> tuple[pd.Series, ...]:
    """One link class's columns, in CLASS_SUFFIXES order. A spec figure is NaN where its achieved figure is
    (no time, or rows without the class's bytes); percentages are NaN where the class carries nothing (no
    claim about a link that was not used)."""
    achieved = gbps(bottleneck, time_us)
    aggregate = gbps(carried, time_us)
    per_gpu = pd.Series(float(per_gpu_spec), index=carried.index).where(achieved.notna())
    agg_spec = aggregate_spec.astype(float).where(aggregate.notna())
    pct = (100.0 * achieved / per_gpu).where((carried > 0) & (per_gpu > 0))
    agg_pct = (100.0 * aggregate / agg_spec).where((carried > 0) & (agg_spec > 0))
    return achieved, per_gpu, pct, aggregate, agg_spec, agg_pct


def _skew_cost(frame: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(skew_cost, skew_bw_loss_pct) from the uniform reference the harness timed (rows that have one):
    time / uniform_ref time, and 100 x (1 - (total bytes / time) / (uniform_ref bytes / uniform_ref time))."""
    time_us = _numeric(frame, "time_us_p50")
    uniform_us = _numeric(frame, "uniform_ref_time_us_p50")
    uniform_bytes = _numeric(frame, "uniform_ref_total_bytes")
    valid = (time_us > 0) & (uniform_us > 0) & (uniform_bytes > 0)
    skewed_bw = _numeric(frame, "total_bytes") / time_us
    uniform_bw = uniform_bytes / uniform_us
    return (time_us / uniform_us).where(valid), (100.0 * (1.0 - skewed_bw / uniform_bw)).where(valid)


def rank_frame(rank_rows: Iterable[dict[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Harness rank rows as a DataFrame plus ``{link,nvlink,scaleout}_{send,recv}_GBps``: the rank's bytes of
    the class sent (received) / the phase time (``phase_time_us_p50``), one direction; placed after the
    byte columns, for the classes the rows have."""
    frame = _as_frame(rank_rows, RANK_DERIVED_COLUMNS)
    sources = [f"{c}_{side}_bytes" for c in RANK_CLASSES for side in ("sent", "recv")]
    present = [(s, d) for s, d in zip(sources, RANK_DERIVED_COLUMNS, strict=True) if s in frame.columns]
    if not present:
        return frame
    time_us = _numeric(frame, "phase_time_us_p50")
    at = max(frame.columns.get_loc(source) for source, _ in present) + 1
    for offset, (source, derived) in enumerate(present):
        frame.insert(at + offset, derived, gbps(_numeric(frame, source), time_us))
    return frame


def balanced_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The balanced all-to-all rows (phase "alltoall": the nccl-tests-comparable sweep) of ``frame``."""
    if frame.empty or "phase" not in frame.columns:
        return frame.iloc[0:0]
    return frame[frame["phase"].astype(str) == "alltoall"]


def average_bus_bandwidth(frame: pd.DataFrame) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean of every busbw (from the mean time) of the balanced
    all-to-all rows ALONE (MoE phases are not averaged in), out-of-place (``busbw_mean_GBps``) and in-place
    (``in_place_busbw_mean_GBps``, where it ran), as nccl-tests averages both; NaN without a finite value."""
    rows = balanced_rows(frame)
    columns = [c for c in ("busbw_mean_GBps", "in_place_busbw_mean_GBps") if c in rows.columns]
    if rows.empty or not columns:
        return math.nan
    values = np.concatenate([rows[c].astype(float).to_numpy() for c in columns])
    values = values[np.isfinite(values)]
    return float(values.mean()) if len(values) else math.nan


PAIR_DERIVED_COLUMNS = ("GBps", "spec_GBps", "pct_spec")


def pair_frame(pair_rows: Iterable[dict[str, Any]] | pd.DataFrame, spec: SystemSpec) -> pd.DataFrame:
    """Pairwise link test rows (pairs.csv: src, dst, test, size_bytes, time_us, link_class, ...) plus the
    direction's GB/s (size / time: one message's bytes, one way), the spec it is compared with (NVLink per
    direction for an nvlink pair, the NIC line rate per direction for a scaleout pair; NaN without a spec)
    and %spec. A latency row's GB/s is computed the same way and means little (8-byte messages)."""
    frame = pd.DataFrame(list(pair_rows)) if not isinstance(pair_rows, pd.DataFrame) else pair_rows.copy()
    frame = frame.drop(columns=[c for c in PAIR_DERIVED_COLUMNS if c in frame.columns])
    if frame.empty:
        return frame
    frame["GBps"] = gbps(_numeric(frame, "size_bytes"), _numeric(frame, "time_us"))
    per_class = {"nvlink": spec.nvlink_GBps_per_direction, "scaleout": spec.nic_GBps_per_direction}
    classes = frame["link_class"].astype(str) if "link_class" in frame.columns else pd.Series("", frame.index)
    frame["spec_GBps"] = classes.map(lambda name: float(per_class.get(name, math.nan))).astype(float)
    frame["pct_spec"] = 100.0 * frame["GBps"] / frame["spec_GBps"].where(frame["spec_GBps"] > 0)
    return frame
