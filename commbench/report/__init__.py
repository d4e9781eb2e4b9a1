"""Report stage: bandwidth math, the stdout table and the files of a report folder.

A report folder holds ``meta.json`` (arguments, environment, spec), ``results.csv`` and ``ranks.csv``
(appended after every phase, so a crash loses nothing finished) and, once the run ends, ``results.parquet``,
``results.json`` (nccl-tests-like), ``summary.md`` and ``report.html``. ``render_report`` rebuilds the last
four from the first three (``commbench report DIR``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import UsageError
from commbench.traffic.links import class_bandwidth_columns


@dataclass(frozen=True)
class BandwidthSpec:
    """A hardware bandwidth figure to compare achieved numbers with.

    ``per_gpu_GBps_per_direction`` is one GPU's NVLink, one direction (NVLink 5: 1.8 TB/s bidirectional =
    900 GB/s each way); ``aggregate_GBps_bidirectional`` is the whole domain of ``gpus_per_domain`` GPUs, both
    directions summed; ``nic_GBps_per_direction`` is one GPU's scale-out NIC line rate, one direction
    (ConnectX-8 800 Gb/s = 100 GB/s).
    """

    name: str = "NVLink 5 (GB200/GB300 NVL72)"
    per_gpu_GBps_per_direction: float = 900.0
    gpus_per_domain: int = 72
    aggregate_GBps_bidirectional: float = 130000.0
    nic_GBps_per_direction: float = 100.0

    def aggregate_GBps_per_direction(self, world_size: int) -> float:
        """The domain's one-direction aggregate, scaled to the ``world_size`` GPUs a job uses."""
        return self.aggregate_GBps_bidirectional * world_size / self.gpus_per_domain / 2.0

    def scaleout_aggregate_GBps_per_direction(self, world_size: int) -> float:
        """Every rank's NIC, one direction."""
        return self.nic_GBps_per_direction * world_size

    def describe(self) -> str:
        return (
            f"{self.name}: NVLink {self.per_gpu_GBps_per_direction:g} GB/s per GPU per direction "
            f"({2 * self.per_gpu_GBps_per_direction:g} GB/s bidirectional); NVLink-domain aggregate "
            f"{self.aggregate_GBps_bidirectional:g} GB/s bidirectional for {self.gpus_per_domain} GPUs "
            f"= {self.aggregate_GBps_bidirectional / 2:g} GB/s per direction, scaled by ranks / "
            f"{self.gpus_per_domain}; scale-out NIC {self.nic_GBps_per_direction:g} GB/s "
            f"({8 * self.nic_GBps_per_direction:g} Gb/s) per GPU per direction"
        )

    @classmethod
    def from_system(cls, system: Any) -> BandwidthSpec:
        """From a ``commbench.inputs.specs.SystemSpec`` (the ``--spec`` catalogue)."""
        return cls(
            name=str(system.name),
            per_gpu_GBps_per_direction=float(system.nvlink_GBps_per_direction),
            gpus_per_domain=int(system.gpus_per_domain),
            aggregate_GBps_bidirectional=float(system.domain_aggregate_GBps_bidirectional),
            nic_GBps_per_direction=float(system.nic_GBps_per_direction),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> BandwidthSpec:
        """Inverse of ``dataclasses.asdict``; unknown keys (from newer versions) are ignored."""
        if not data:
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


DEFAULT_SPEC = BandwidthSpec()

# Every convention a reader needs to interpret the numbers; shown in summary.md, report.html and results.json.
CONVENTIONS = """\
Conventions
- Bytes are payload only: token rows, FP8 scales included; routing metadata and the counts exchange are not
  counted (the counts exchange is inside the timed dispatch). Dispatch rows are FP8 (hidden bytes + one fp32
  scale per scale block) or BF16 (2 x hidden bytes); combine rows are BF16 (2 x hidden bytes).
- send_mode=token (DeepEP normal kernels): a token is sent once to each destination rank that holds at least
  one of its selected experts (de-duplicated per destination rank). send_mode=selection: one row per
  (token, expert) selection. Dropped selections (mask ratio, capacity) send nothing.
- size(B): the bottleneck rank's max(bytes sent, bytes received), self traffic (a rank to itself) INCLUDED.
  For the balanced all-to-all, size = bytes each rank sends in total (nccl-tests alltoall size).
- time(us): the p50 over timed iterations of the per-iteration maximum across ranks; min and p99 are given
  too. Warm-up iterations are not timed.
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
- Per-rank rows (ranks.csv): bytes sent and received per class; *_GBps = those bytes / the phase time (p50
  of the per-iteration max across ranks), one direction.
- Imbalance cost: right after an MoE job's phases, the same launch runs dispatch (counts exchange included)
  and combine (weighted reduction included) again through the same code path on a balanced layout of the
  same rows: same total rows, row sizes, tokens per rank and send mode, every (src, dst) pair (self
  included) total / world^2 rows (the remainder one row per pair), so every rank sends and receives the same
  rows; both are verified. skew_cost = time / balanced time (1 = skew costs nothing); skew_bw_loss_pct =
  100 x (1 - (total bytes / time) / (balanced bytes / balanced time)). Uniform routing is random, so it shows
  the cost of statistical imbalance alone.
- GB = 1e9 bytes; GB/s = 1e9 bytes per second; time in microseconds.
- #wrong: mismatched bytes after dispatch and the balanced all-to-all, mismatched output elements after
  combine (float64 reference, tolerance 1e-4 x sum |w x| + 1e-6); 0 = data verified.
- maxvio = (max expert load - mean) / mean over experts; expert_cv = std / mean of expert loads;
  expert_max_mean = max / mean.
- Backends marked "emulated" do not measure the real interconnect (mock, simulators, CPU emulators): their
  times and bandwidths are not hardware figures."""

# Columns results_frame adds (always recomputed, so a re-render never trusts stale saved values).
DERIVED_COLUMNS = (
    "algbw_GBps",
    "busbw_GBps",
    "per_gpu_GBps",
    "spec_name",
    "spec_GBps",
    "pct_spec",
    "agg_GBps",
    "agg_spec_GBps",
    "pct_agg_spec",
    *(
        f"{name}_{suffix}"
        for name in ("nvlink", "scaleout")
        for suffix in ("GBps", "spec_GBps", "pct_spec", "agg_GBps", "agg_spec_GBps", "agg_pct_spec")
    ),
    "skew_cost",
    "skew_bw_loss_pct",
)

_REQUIRED_COLUMNS = ("size_bytes", "time_us_p50", "max_send_link_bytes", "max_recv_link_bytes")


def _bytes_per_us_to_GBps(num_bytes: pd.Series, time_us: pd.Series) -> pd.Series:
    """bytes / (time_us * 1e-6 s) / 1e9 = bytes / (time_us * 1e3); NaN where the time is not positive."""
    time = time_us.astype(float).where(time_us.astype(float) > 0)
    return num_bytes.astype(float) / (time * 1e3)


def results_frame(
    rows: Iterable[dict[str, Any]] | pd.DataFrame, spec: BandwidthSpec | None = None
) -> pd.DataFrame:
    """Harness result rows as a DataFrame with bandwidth columns (see CONVENTIONS), in GB/s (1e9 B/s)."""
    spec = spec or DEFAULT_SPEC
    frame = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame = frame.drop(columns=[c for c in DERIVED_COLUMNS if c in frame.columns])
    if frame.empty:
        for column in DERIVED_COLUMNS:
            frame[column] = pd.Series(dtype=object if column == "spec_name" else float)
        return frame
    missing = [c for c in _REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise UsageError(f"result rows lack column(s) {', '.join(missing)}; not a commbench results file?")
    time_us = frame["time_us_p50"]
    frame["algbw_GBps"] = _bytes_per_us_to_GBps(frame["size_bytes"], time_us)
    bottleneck_link_bytes = np.maximum(
        frame["max_send_link_bytes"].astype(float), frame["max_recv_link_bytes"].astype(float)
    )
    frame["busbw_GBps"] = _bytes_per_us_to_GBps(bottleneck_link_bytes, time_us)
    frame["per_gpu_GBps"] = frame["busbw_GBps"]
    frame["spec_name"] = spec.name
    frame["spec_GBps"] = float(spec.per_gpu_GBps_per_direction)
    frame["pct_spec"] = 100.0 * frame["per_gpu_GBps"] / frame["spec_GBps"]
    if "link_bytes" in frame.columns:
        frame["agg_GBps"] = _bytes_per_us_to_GBps(frame["link_bytes"], time_us)
    else:
        frame["agg_GBps"] = np.nan
    if "world_size" in frame.columns:
        frame["agg_spec_GBps"] = [spec.aggregate_GBps_per_direction(int(n)) for n in frame["world_size"]]
    else:
        frame["agg_spec_GBps"] = np.nan
    frame["pct_agg_spec"] = 100.0 * frame["agg_GBps"] / frame["agg_spec_GBps"]
    _add_link_class_columns(frame, spec)
    _add_skew_cost_columns(frame)
    return frame


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    """A column as floats; all-NaN where the rows lack it (older results, balanced rows of old versions)."""
    if column not in frame.columns:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def _add_link_class_columns(frame: pd.DataFrame, spec: BandwidthSpec) -> None:
    """Per link class bandwidths from the harness's byte columns, against ``spec``."""
    time_s = _numeric(frame, "time_us_p50") * 1e-6
    world = _numeric(frame, "world_size")
    per_gpu = {"nvlink": spec.per_gpu_GBps_per_direction, "scaleout": spec.nic_GBps_per_direction}
    aggregate = {
        "nvlink": spec.aggregate_GBps_bidirectional / 2.0 * world / spec.gpus_per_domain,
        "scaleout": spec.nic_GBps_per_direction * world,
    }
    for name in ("nvlink", "scaleout"):
        columns = class_bandwidth_columns(
            name,
            _numeric(frame, f"{name}_bytes").to_numpy(),
            _numeric(frame, f"{name}_bottleneck_bytes").to_numpy(),
            time_s.to_numpy(),
            np.full(len(frame), per_gpu[name]),
            aggregate[name].to_numpy(),
        )
        for column, values in columns.items():
            frame[column] = np.asarray(values, dtype=float)


def _add_skew_cost_columns(frame: pd.DataFrame) -> None:
    """skew_cost and skew_bw_loss_pct from the balanced reference the harness timed (rows that have one)."""
    time_us = _numeric(frame, "time_us_p50")
    balanced_us = _numeric(frame, "balanced_time_us_p50")
    valid = (time_us > 0) & (balanced_us > 0) & (_numeric(frame, "balanced_total_bytes") > 0)
    frame["skew_cost"] = (time_us / balanced_us).where(valid)
    skewed_bw = _numeric(frame, "total_bytes") / time_us
    balanced_bw = _numeric(frame, "balanced_total_bytes") / balanced_us
    frame["skew_bw_loss_pct"] = (100.0 * (1.0 - skewed_bw / balanced_bw)).where(valid)


def average_bus_bandwidth(frame: pd.DataFrame) -> float:
    """Mean busbw over rows (nccl-tests' "Avg bus bandwidth"); NaN without finite values."""
    if frame.empty or "busbw_GBps" not in frame.columns:
        return math.nan
    values = frame["busbw_GBps"].astype(float)
    values = values[np.isfinite(values)]
    return float(values.mean()) if len(values) else math.nan


# ----------------------------------------------------------------------------------------------------------
# Formatting helpers


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _fmt_int(value: Any) -> str:
    return "-" if _is_missing(value) else str(int(value))


def _fmt_float(digits: int) -> Callable[[Any], str]:
    def fmt(value: Any) -> str:
        return "-" if _is_missing(value) else f"{float(value):.{digits}f}"

    return fmt


def _fmt_text(value: Any) -> str:
    return "-" if _is_missing(value) or value == "" else str(value)


def _fmt_size(value: Any) -> str:
    """Bytes with a binary-unit hint, e.g. "1048576 (1 MiB)"."""
    if _is_missing(value):
        return "-"
    size = int(value)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size} ({size / scale:.3g} {unit})"
    return str(size)


_fmt_time = _fmt_float(1)


def format_bandwidth(value: Any) -> str:
    """GB/s with 2 decimals (as nccl-tests), 3 significant digits below 1 GB/s (CPU and small sizes)."""
    if _is_missing(value):
        return "-"
    value = float(value)
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


_fmt_bw = format_bandwidth


def _fmt_pct(value: Any) -> str:
    """Percent with 3 significant digits below 100 (CPU runs reach tiny fractions of an NVLink spec)."""
    if _is_missing(value):
        return "-"
    value = float(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


# Knob sweeps: rows carry the backend's knobs as one "knobs" cell ("chunk_rows=4 signal=chunk ..."); the
# tables and plots show a "knobs" column with the knobs whose values differ between rows, and nothing when
# every row ran with the same setting.
KNOB_SETTING_COLUMN = "knob_setting"
_KNOB_SPLIT = re.compile(r"\s+(?=[A-Za-z_][\w.-]*=)")


def parse_knobs(text: Any) -> dict[str, str]:
    """The ``knobs`` cell as a dict: "chunk_rows=4 signal=chunk" -> {"chunk_rows": "4", "signal": "chunk"}."""
    if _is_missing(text) or not str(text).strip():
        return {}
    pairs = (part.partition("=") for part in _KNOB_SPLIT.split(str(text).strip()))
    return {key: value for key, _, value in pairs}


def varying_knobs(frame: pd.DataFrame) -> pd.Series | None:
    """Per row, "key=value ..." of the knobs whose values differ between the rows (a sweep's setting);
    None when the rows have no ``knobs`` column or all share one setting."""
    if frame.empty or "knobs" not in frame.columns:
        return None
    parsed = [parse_knobs(text) for text in frame["knobs"]]
    keys = dict.fromkeys(key for knobs in parsed for key in knobs)
    varying = [key for key in keys if len({knobs.get(key) for knobs in parsed}) > 1]
    if not varying:
        return None
    cells = [" ".join(f"{key}={knobs[key]}" for key in varying if key in knobs) for knobs in parsed]
    return pd.Series(cells, index=frame.index, dtype=object)


def with_knob_setting(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` plus the display column ``knob_setting`` (``varying_knobs``) when knobs vary."""
    setting = varying_knobs(frame)
    if setting is None:
        return frame
    out = frame.copy()
    out[KNOB_SETTING_COLUMN] = setting
    return out


# (column, header, formatter) for the per-pattern tables of summary.md and report.html.
_BALANCED_TABLE = (
    ("backend", "backend", _fmt_text),
    (KNOB_SETTING_COLUMN, "knobs", _fmt_text),
    ("size_bytes", "size(B)", _fmt_size),
    ("time_us_p50", "time p50(us)", _fmt_time),
    ("time_us_min", "min(us)", _fmt_time),
    ("time_us_p99", "p99(us)", _fmt_time),
    ("algbw_GBps", "algbw(GB/s)", _fmt_bw),
    ("busbw_GBps", "busbw(GB/s)", _fmt_bw),
    ("pct_spec", "%spec", _fmt_pct),
    ("wrong", "#wrong", _fmt_int),
)
_MOE_TABLE = (
    ("backend", "backend", _fmt_text),
    (KNOB_SETTING_COLUMN, "knobs", _fmt_text),
    ("skew", "skew", _fmt_text),
    ("send_mode", "send mode", _fmt_text),
    ("tokens_per_rank", "tokens/rank", _fmt_int),
    ("phase", "phase", _fmt_text),
    ("size_bytes", "size(B)", _fmt_size),
    ("time_us_p50", "time p50(us)", _fmt_time),
    ("time_us_min", "min(us)", _fmt_time),
    ("time_us_p99", "p99(us)", _fmt_time),
    ("algbw_GBps", "algbw(GB/s)", _fmt_bw),
    ("busbw_GBps", "busbw(GB/s)", _fmt_bw),
    ("pct_spec", "%spec", _fmt_pct),
    ("agg_GBps", "agg(GB/s)", _fmt_bw),
    ("pct_agg_spec", "%agg", _fmt_pct),
    ("maxvio", "maxvio", _fmt_float(3)),
    ("wrong", "#wrong", _fmt_int),
)


def _any_emulated(frame: pd.DataFrame) -> bool:
    """Whether any row comes from an emulated backend (bools may come back from CSV as text)."""
    if "emulated" not in frame.columns:
        return False
    return bool(frame["emulated"].astype(str).str.lower().isin(["true", "1"]).any())


def _is_balanced(group: pd.DataFrame) -> bool:
    return "phase" in group.columns and bool((group["phase"] == "alltoall").all())


def _table_cells(group: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    spec = _BALANCED_TABLE if _is_balanced(group) else _MOE_TABLE
    columns = [(col, header, fmt) for col, header, fmt in spec if col in group.columns]
    headers = [header for _, header, _ in columns]
    body = [[fmt(record[col]) for col, _, fmt in columns] for record in group.to_dict("records")]
    return headers, body


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; cells that look numeric are right-aligned."""

    def numeric(text: str) -> bool:
        try:
            float(text.split(" ")[0])
        except ValueError:
            return text == "-"
        return True

    right = [all(numeric(row[i]) for row in body) if body else False for i in range(len(headers))]
    widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule_cells = [("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right, strict=True)]
    rule = "|" + "|".join(rule_cells) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in body)])


def _html_table(headers: Sequence[str], body: Sequence[Sequence[str]], left: bool = False) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    td = '<td style="text-align:left">' if left else "<td>"
    rows = "".join("<tr>" + "".join(f"{td}{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in body)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}</tbody>\n</table>"


def _pattern_groups(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One table per pattern name, in order of first appearance (run order)."""
    if frame.empty:
        return []
    if "pattern" not in frame.columns:
        return [("results", frame)]
    names = list(dict.fromkeys(frame["pattern"].astype(str)))
    return [(name, frame[frame["pattern"].astype(str) == name]) for name in names]


def format_table(frame: pd.DataFrame) -> str:
    """A compact nccl-tests-style table for stdout, with an "Avg bus bandwidth" footer."""
    columns = (  # (column, header, formatter, minimum width); the first three are left-aligned text
        ("pattern", "pattern", _fmt_text, 12),
        ("skew", "skew", _fmt_text, 10),
        ("phase", "phase", _fmt_text, 8),
        ("size_bytes", "size(B)", _fmt_int, 10),
        ("time_us_p50", "time(us)", _fmt_time, 9),
        ("algbw_GBps", "algbw(GB/s)", _fmt_bw, 11),
        ("busbw_GBps", "busbw(GB/s)", _fmt_bw, 11),
        ("pct_spec", "%spec", _fmt_pct, 6),
        ("wrong", "#wrong", _fmt_int, 6),
    )
    setting = varying_knobs(frame)
    if setting is not None:  # a sweep: the setting of each row, last (left-aligned text)
        frame = frame.assign(**{KNOB_SETTING_COLUMN: setting})
        columns = (*columns, (KNOB_SETTING_COLUMN, "knobs", _fmt_text, 5))
    text_columns = {0, 1, 2, len(columns) - 1} if setting is not None else {0, 1, 2}
    lines = []
    if not frame.empty:
        first = frame.iloc[0]
        backends = ", ".join(dict.fromkeys(frame["backend"].astype(str))) if "backend" in frame else "?"
        emulated = _any_emulated(frame)
        world = _fmt_int(first.get("world_size"))
        lines.append(
            f"# backend: {backends}{' (EMULATED timings)' if emulated else ''}; ranks: {world}; "
            f"spec: {_fmt_text(first.get('spec_name'))} {_fmt_text(first.get('spec_GBps'))} GB/s per GPU "
            "per direction"
        )
        lines.append("# time = p50 over iterations of the max across ranks; GB = 1e9 B; see summary.md")
    headers = [title for _, title, _, _ in columns]
    body = [[fmt(record.get(col)) for col, _, fmt, _ in columns] for record in frame.to_dict("records")]
    widths = [
        max([minimum, len(headers[i])] + [len(row[i]) for row in body])
        for i, (*_, minimum) in enumerate(columns)
    ]

    def line(prefix: str, cells: list[str]) -> str:
        aligned = [
            text.ljust(w) if i in text_columns else text.rjust(w)
            for i, (text, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return prefix + " ".join(aligned).rstrip()

    lines.append(line("# ", headers))
    lines.extend(line("  ", row) for row in body)
    avg = average_bus_bandwidth(frame)
    lines.append(f"# Avg bus bandwidth    : {_fmt_bw(avg)} GB/s")
    if "wrong" in frame.columns and not frame.empty:
        total_wrong = int(pd.to_numeric(frame["wrong"], errors="coerce").fillna(0).sum())
        verdict = "" if total_wrong == 0 else "  (DATA MISMATCH)"
        lines.append(f"# Total #wrong         : {total_wrong}{verdict}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Report folder


def prepare_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """Create ``out_dir``; refuse (UsageError, nothing touched) if it exists and is not an empty folder."""
    path = Path(out_dir)
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"output path {str(path)!r} exists and is not a folder; pass a new --out folder")
        if any(path.iterdir()):
            raise UsageError(
                f"output folder {str(path)!r} already exists and is not empty; pass a new --out folder "
                "(commbench never overwrites a report)"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create output folder {str(path)!r}: {exc.strerror or exc}") from exc
    return path


class _CsvAppender:
    """Appends records to a CSV, header once; rewrites the file only when later records add columns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        self.records: list[dict[str, Any]] = []

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        new_columns = [c for c in dict.fromkeys(k for r in records for k in r) if c not in self.columns]
        self.records.extend(records)
        if new_columns and self.columns:
            # A later phase brought new columns (e.g. backend knobs): rewrite everything with the wider
            # header, atomically, so the file is always a valid CSV.
            self.columns.extend(new_columns)
            tmp = self.path.with_suffix(".csv.tmp")
            self._write(tmp, self.records, header=True, mode="w")
            os.replace(tmp, self.path)
            return
        first = not self.columns
        self.columns.extend(new_columns)
        self._write(self.path, records, header=first, mode="w" if first else "a")

    def _write(self, path: Path, records: list[dict[str, Any]], header: bool, mode: str) -> None:
        frame = pd.DataFrame(records).reindex(columns=self.columns)
        with open(path, mode, newline="") as handle:
            frame.to_csv(handle, header=header, index=False)
            handle.flush()
            os.fsync(handle.fileno())


class ReportWriter:
    """Writes one report folder: CSVs appended as phases finish, the rest in ``finalize``.

    ``meta`` is saved as meta.json at once (typically {"args": ..., "env": ...}); ``spec`` defaults to
    ``meta["spec"]`` or DEFAULT_SPEC.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], meta: dict[str, Any], spec: BandwidthSpec | None = None
    ) -> None:
        self.out_dir = prepare_out_dir(out_dir)
        self.spec = spec or BandwidthSpec.from_dict(meta.get("spec"))
        self.meta = {**meta, "spec": asdict(self.spec)}
        (self.out_dir / "meta.json").write_text(json.dumps(_jsonable(self.meta), indent=2) + "\n")
        self._results = _CsvAppender(self.out_dir / "results.csv")
        self._ranks = _CsvAppender(self.out_dir / "ranks.csv")

    def add(self, rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]] | None = None) -> None:
        """Append finished rows (with their bandwidth columns) to results.csv and ranks.csv."""
        if rows:
            framed = results_frame(rows, self.spec)
            self._results.append([_plain_record(r) for r in framed.to_dict("records")])
        if rank_rows:
            self._ranks.append([_plain_record(r) for r in rank_rows])

    def finalize(self) -> pd.DataFrame:
        """Write results.parquet, results.json, summary.md and report.html; return the results frame."""
        frame = results_frame(pd.DataFrame(self._results.records, columns=self._results.columns), self.spec)
        ranks = pd.DataFrame(self._ranks.records, columns=self._ranks.columns)
        _write_outputs(self.out_dir, frame, ranks, self.meta, self.spec)
        return frame


def render_report(out_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """Re-render parquet/json/summary/html of a report folder from results.csv (+ ranks.csv, meta.json)."""
    path = Path(out_dir)
    results_csv = path / "results.csv"
    if not results_csv.is_file():
        raise UsageError(f"{str(results_csv)!r} not found; pass a report folder written by 'commbench run'")
    meta: dict[str, Any] = {}
    meta_path = path / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read {str(meta_path)!r}: {exc}; fix or delete it") from exc
    try:
        results = pd.read_csv(results_csv)
    except (OSError, ValueError) as exc:  # pandas raises ValueError subclasses on malformed CSV
        raise UsageError(f"cannot read {str(results_csv)!r}: {exc}") from exc
    ranks_csv = path / "ranks.csv"
    try:
        ranks = pd.read_csv(ranks_csv) if ranks_csv.is_file() else pd.DataFrame()
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {str(ranks_csv)!r}: {exc}") from exc
    spec = BandwidthSpec.from_dict(meta.get("spec"))
    frame = results_frame(results, spec)
    _write_outputs(path, frame, ranks, meta, spec)
    return frame


def _write_outputs(
    out_dir: Path, frame: pd.DataFrame, ranks: pd.DataFrame, meta: dict[str, Any], spec: BandwidthSpec
) -> None:
    _parquet_safe(frame).to_parquet(out_dir / "results.parquet", index=False)
    (out_dir / "results.json").write_text(json.dumps(results_json(frame, meta, spec), indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(frame, meta, spec))
    (out_dir / "report.html").write_text(report_html(frame, ranks, meta, spec))


def _parquet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Object columns holding mixed types (e.g. backend knobs) become strings, which parquet can store."""
    out = frame.copy()
    for column in out.columns:
        if out[column].dtype == object:
            kinds = {type(v) for v in out[column] if not _is_missing(v)}
            if len(kinds) > 1 or (kinds and not kinds <= {str, bool}):
                out[column] = [None if _is_missing(v) else str(v) for v in out[column]]
    return out


def _plain(value: Any) -> Any:
    """numpy scalars -> Python; NaN -> None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain_record(record: dict[str, Any]) -> dict[str, Any]:
    return {key: _plain(value) for key, value in record.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    value = _plain(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def results_json(frame: pd.DataFrame, meta: dict[str, Any], spec: BandwidthSpec) -> dict[str, Any]:
    """nccl-tests-like JSON: args, env, results[] (size, time, alg_bw, bus_bw, wrong), average bus bw.

    Each result also carries nccl-tests' own ``-J`` layout (``out_of_place`` {time, alg_bw, bus_bw, nwrong},
    ``in_place`` null: commbench runs one out-of-place exchange), so a parser of nccl-tests JSON reads it.
    """
    env = meta.get("env") or {}
    results = []
    for record in frame.to_dict("records"):
        row = _plain_record(record)
        figures = {
            "time": row.get("time_us_p50"),
            "alg_bw": row.get("algbw_GBps"),
            "bus_bw": row.get("busbw_GBps"),
        }
        results.append(
            {
                "size": row.get("size_bytes"),
                **figures,
                "wrong": row.get("wrong"),
                "out_of_place": {**figures, "nwrong": row.get("wrong")},
                "in_place": None,
                **row,
            }
        )
    avg = average_bus_bandwidth(frame)
    return _jsonable(
        {
            "args": meta.get("args", {}),
            "env": env,
            "nccl_version": (env.get("versions") or {}).get("nccl"),
            "devices": env.get("devices", []),
            "spec": asdict(spec),
            "units": {"size": "bytes", "time": "us", "alg_bw": "GB/s (1e9 B/s)", "bus_bw": "GB/s (1e9 B/s)"},
            "conventions": CONVENTIONS,
            "results": results,
            "average_bus_bandwidth": None if math.isnan(avg) else avg,
        }
    )


def _environment_lines(meta: dict[str, Any]) -> list[tuple[str, str]]:
    env = meta.get("env") or {}
    versions = env.get("versions") or {}
    devices = env.get("devices") or []
    device_text = ", ".join(f"{d.get('index')}: {d.get('name', d.get('error', '?'))}" for d in devices)
    nvml = env.get("nvml") or {}
    items = [
        ("command", env.get("command") or " ".join(meta.get("argv", []))),
        ("time (UTC)", env.get("time_utc")),
        ("host", env.get("hostname")),
        ("platform", env.get("platform")),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)),
        ("devices", device_text or "no CUDA devices"),
        ("driver", nvml.get("driver_version")),
        ("env vars", " ".join(f"{k}={v}" for k, v in (env.get("env_vars") or {}).items()) or "none set"),
    ]
    args = meta.get("args") or {}
    if args:
        items.append(("arguments", ", ".join(f"{k}={v}" for k, v in args.items())))
    return [(k, str(v)) for k, v in items if v not in (None, "")]


def _fmt_neck(rank_column: str, dir_column: str) -> Callable[[dict[str, Any]], str]:
    def fmt(record: dict[str, Any]) -> str:
        rank = record.get(rank_column)
        if _is_missing(rank) or int(rank) < 0:
            return "-"
        return f"{int(rank)} {_fmt_text(record.get(dir_column))}"

    return fmt


def _column(column: str, fmt: Callable[[Any], str]) -> Callable[[dict[str, Any]], str]:
    return lambda record: fmt(record.get(column))


# (header, cell) of the per-link-class table; every bandwidth is one direction.
_LINK_CLASS_TABLE: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("pattern", _column("pattern", _fmt_text)),
    ("skew", _column("skew", _fmt_text)),
    ("phase", _column("phase", _fmt_text)),
    ("size(B)", _column("size_bytes", _fmt_int)),
    ("algbw self incl.(GB/s)", _column("algbw_GBps", _fmt_bw)),
    ("link bw self excl.(GB/s)", _column("busbw_GBps", _fmt_bw)),
    ("self(B)", _column("self_bytes", _fmt_int)),
    ("NVLink(B)", _column("nvlink_bytes", _fmt_int)),
    ("scale-out(B)", _column("scaleout_bytes", _fmt_int)),
    ("NVLink/GPU(GB/s)", _column("nvlink_GBps", _fmt_bw)),
    ("NVLink neck", _fmt_neck("nvlink_bottleneck_rank", "nvlink_bottleneck_dir")),
    ("%NVLink spec", _column("nvlink_pct_spec", _fmt_pct)),
    ("NVLink agg(GB/s)", _column("nvlink_agg_GBps", _fmt_bw)),
    ("%NVLink agg", _column("nvlink_agg_pct_spec", _fmt_pct)),
    ("scale-out/GPU(GB/s)", _column("scaleout_GBps", _fmt_bw)),
    ("scale-out neck", _fmt_neck("scaleout_bottleneck_rank", "scaleout_bottleneck_dir")),
    ("%NIC spec", _column("scaleout_pct_spec", _fmt_pct)),
    ("scale-out agg(GB/s)", _column("scaleout_agg_GBps", _fmt_bw)),
    ("%NIC agg", _column("scaleout_agg_pct_spec", _fmt_pct)),
)

_SKEW_COST_TABLE: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("pattern", _column("pattern", _fmt_text)),
    ("skew", _column("skew", _fmt_text)),
    ("phase", _column("phase", _fmt_text)),
    ("maxvio", _column("maxvio", _fmt_float(3))),
    ("total(B)", _column("total_bytes", _fmt_int)),
    ("time p50(us)", _column("time_us_p50", _fmt_time)),
    ("balanced p50(us)", _column("balanced_time_us_p50", _fmt_time)),
    ("skew cost(x)", _column("skew_cost", _fmt_float(2))),
    ("bw loss(%)", _column("skew_bw_loss_pct", _fmt_float(1))),
)


def _with_knob_cells(
    table: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...], frame: pd.DataFrame
) -> tuple[tuple[str, Callable[[dict[str, Any]], str]], ...]:
    """``table`` with a "knobs" column after "phase" when ``frame`` has a knob setting column."""
    if KNOB_SETTING_COLUMN not in frame.columns:
        return table
    at = [header for header, _ in table].index("phase") + 1
    return (*table[:at], ("knobs", _column(KNOB_SETTING_COLUMN, _fmt_text)), *table[at:])


def link_class_table(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]] | None:
    """Per-link-class bytes and bandwidths of every result row; None for rows without link-class columns."""
    if frame.empty or "nvlink_bytes" not in frame.columns:
        return None
    records = frame.to_dict("records")
    table = _with_knob_cells(_LINK_CLASS_TABLE, frame)
    return [h for h, _ in table], [[cell(r) for _, cell in table] for r in records]


def skew_cost_table(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]] | None:
    """The "what skew costs" table: MoE rows that carry a balanced reference time."""
    if frame.empty or "balanced_time_us_p50" not in frame.columns:
        return None
    rows = frame[pd.to_numeric(frame["balanced_time_us_p50"], errors="coerce").notna()]
    if rows.empty:
        return None
    records = rows.to_dict("records")
    table = _with_knob_cells(_SKEW_COST_TABLE, frame)
    return [h for h, _ in table], [[cell(r) for _, cell in table] for r in records]


def link_class_legend(spec: BandwidthSpec) -> str:
    """Which convention each column of the per-link-class table uses."""
    return (
        "All bandwidths are one direction, GB = 1e9 B. algbw self incl. = size / time (what the layer sees); "
        "link bw self excl. = the bottleneck rank's link bytes / time (busbw). NVLink/GPU and scale-out/GPU "
        "= the class's bottleneck rank (neck: rank and direction) bytes / time, against the per-GPU spec per "
        f"direction (NVLink {spec.per_gpu_GBps_per_direction:g} GB/s, NIC {spec.nic_GBps_per_direction:g} "
        "GB/s); agg = all bytes of the class / time, against the aggregate per direction scaled to the ranks "
        "used (NVLink: domain aggregate / 2 x ranks / "
        f"{spec.gpus_per_domain}; scale-out: ranks x {spec.nic_GBps_per_direction:g} GB/s)."
    )


def topology_text(frame: pd.DataFrame, meta: dict[str, Any]) -> str | None:
    """The run's NVLink-domain layout and how it was found (meta.json, else the result rows)."""
    topology = meta.get("topology") or {}
    if topology.get("description"):
        return str(topology["description"])
    if frame.empty or "num_domains" not in frame.columns:
        return None
    first = frame.iloc[0]
    return (
        f"{_fmt_int(first.get('world_size'))} ranks in {_fmt_int(first.get('num_domains'))} NVLink domain(s) "
        f"of up to {_fmt_int(first.get('ranks_per_domain'))} ranks; found by "
        f"{_fmt_text(first.get('layout_source'))}"
    )


SKEW_COST_NOTE = (
    "skew cost = time / time of the same phase (same code path: packing, counts exchange, weighted "
    "reduction) on a balanced layout of the same rows, every rank pair total / world^2 rows, timed right "
    "after in the same launch (1 = skew costs nothing); bw loss = bandwidth lost against that balanced "
    "layout."
)


def summary_markdown(frame: pd.DataFrame, meta: dict[str, Any], spec: BandwidthSpec) -> str:
    frame = with_knob_setting(frame)
    parts = ["# commbench report", ""]
    if _any_emulated(frame):
        parts += ["**Emulated backend: times and bandwidths below are not hardware measurements.**", ""]
    parts += ["## Conventions", "", "```", CONVENTIONS, "```", "", f"Spec: {spec.describe()}.", ""]
    topology = topology_text(frame, meta)
    if topology:
        parts += [f"Topology: {topology}.", ""]
    parts += ["## Environment", ""]
    parts += [f"- {key}: `{value}`" for key, value in _environment_lines(meta)]
    parts.append("")
    parts += ["## Results", ""]
    for name, group in _pattern_groups(frame):
        parts += [f"### {name}", "", markdown_table(*_table_cells(group)), ""]
    avg = average_bus_bandwidth(frame)
    parts += [f"Avg bus bandwidth: {_fmt_bw(avg)} GB/s", ""]
    links = link_class_table(frame)
    if links:
        parts += ["## By link class", "", link_class_legend(spec), "", markdown_table(*links), ""]
    costs = skew_cost_table(frame)
    if costs:
        parts += ["## What skew costs", "", SKEW_COST_NOTE, "", markdown_table(*costs), ""]
    while parts and parts[-1] == "":
        parts.pop()
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib's object API, no pyplot: no global state, no display backend needed)


def _figure_png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _plot_balanced(frame: pd.DataFrame, spec: BandwidthSpec) -> str | None:
    from matplotlib.figure import Figure

    balanced = frame[frame["phase"] == "alltoall"] if "phase" in frame else frame.iloc[0:0]
    balanced = balanced[np.isfinite(balanced["busbw_GBps"].astype(float))] if not balanced.empty else balanced
    if balanced.empty:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.add_subplot()
    keys = ["backend", KNOB_SETTING_COLUMN] if KNOB_SETTING_COLUMN in balanced.columns else ["backend"]
    for key, group in balanced.groupby(keys, sort=False):
        name = " ".join(str(part) for part in key) if isinstance(key, tuple) else str(key)
        group = group.sort_values("size_bytes")
        axes.plot(group["size_bytes"], group["busbw_GBps"], marker="o", label=f"{name} busbw")
        axes.plot(group["size_bytes"], group["algbw_GBps"], marker=".", ls=":", label=f"{name} algbw")
    axes.axhline(spec.per_gpu_GBps_per_direction, color="red", linestyle="--", label=f"spec {spec.name}")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("size: bytes each rank sends (B)")
    axes.set_ylabel("GB/s (1e9 B/s), one direction")
    axes.set_title("Balanced all-to-all: bus bandwidth vs size")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    return _figure_png(figure)


def _case_label(record: dict[str, Any]) -> str:
    parts = [_fmt_text(record.get("pattern"))]
    if record.get("phase") == "alltoall":
        parts.append("peak " + _fmt_size(record.get("size_bytes")).split(" (")[-1].rstrip(")"))
    else:
        parts.append(_fmt_text(record.get("skew")))
    parts.append(_fmt_text(record.get("phase")))
    if not _is_missing(record.get(KNOB_SETTING_COLUMN)):
        parts.append(str(record[KNOB_SETTING_COLUMN]))
    return "\n".join(parts)


def _plot_per_gpu_vs_spec(frame: pd.DataFrame, spec: BandwidthSpec) -> str | None:
    from matplotlib.figure import Figure

    if frame.empty:
        return None
    # One bar per MoE row, plus the balanced sweep's peak busbw per backend (the best-case reference).
    moe = frame[frame["phase"] != "alltoall"] if "phase" in frame else frame
    balanced = frame[frame["phase"] == "alltoall"] if "phase" in frame else frame.iloc[0:0]
    balanced = balanced[np.isfinite(balanced["busbw_GBps"].astype(float))] if not balanced.empty else balanced
    if not balanced.empty:
        keys = ["backend", KNOB_SETTING_COLUMN] if KNOB_SETTING_COLUMN in balanced.columns else ["backend"]
        balanced = balanced.sort_values("busbw_GBps").groupby(keys, sort=False).tail(1)
    cases = pd.concat([balanced, moe])
    cases = cases[np.isfinite(cases["per_gpu_GBps"].astype(float))]
    if cases.empty:
        return None
    records = cases.to_dict("records")
    figure = Figure(figsize=(max(6.0, 0.9 * len(records) + 2), 4.8))
    axes = figure.add_subplot()
    positions = np.arange(len(records))
    values = cases["per_gpu_GBps"].astype(float).to_numpy()
    bars = axes.bar(positions, values, color="tab:blue")
    for bar, record in zip(bars, records, strict=True):
        axes.annotate(
            f"{record['pct_spec']:.2g}%",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="x-small",
        )
    axes.axhline(spec.per_gpu_GBps_per_direction, color="red", linestyle="--", label=f"spec {spec.name}")
    axes.set_yscale("log")
    axes.set_xticks(positions, [_case_label(r) for r in records], fontsize="x-small")
    axes.set_ylabel("per-GPU GB/s, one direction")
    axes.set_title("Achieved per-GPU bandwidth (busbw) vs spec, labels: % of spec")
    axes.grid(True, axis="y", which="both", alpha=0.3)
    axes.legend(fontsize="small")
    return _figure_png(figure)


def _rank_case_title(values: dict[str, Any]) -> str:
    """e.g. "deepseek-v3, skew zipf:1.2, token mode, 512 tokens/rank" (missing parts left out)."""
    parts = [_fmt_text(values.get("pattern"))]
    if not _is_missing(values.get("skew")):
        parts.append(f"skew {values['skew']}")
    if not _is_missing(values.get("send_mode")):
        parts.append(f"{values['send_mode']} mode")
    if not _is_missing(values.get("tokens_per_rank")):
        parts.append(f"{int(values['tokens_per_rank'])} tokens/rank")
    if not _is_missing(values.get(KNOB_SETTING_COLUMN)):
        parts.append(str(values[KNOB_SETTING_COLUMN]))
    return ", ".join(parts)


_RANK_CASE_KEYS = ("pattern", "skew", "send_mode", "tokens_per_rank", "size_bytes", KNOB_SETTING_COLUMN)
_MAX_RANK_PLOTS = 12


def _plot_ranks(ranks: pd.DataFrame) -> list[tuple[str, str]]:
    """Per-rank sent/received bytes of each MoE case (where skew shows as one hot rank)."""
    from matplotlib.figure import Figure

    needed = {"rank", "phase", "sent_bytes", "recv_bytes"}
    if ranks.empty or not needed <= set(ranks.columns):
        return []
    moe = ranks[ranks["phase"] != "alltoall"]
    keys = [k for k in _RANK_CASE_KEYS if k in moe.columns]
    if moe.empty:
        return []
    plots = []
    grouped = moe.groupby(keys, sort=False, dropna=False) if keys else [((), moe)]
    for key, case in list(grouped)[:_MAX_RANK_PLOTS]:
        values = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        title = _rank_case_title(values)
        phases = list(dict.fromkeys(case["phase"]))
        figure = Figure(figsize=(4.5 * len(phases) + 1, 3.5), layout="constrained")
        for index, phase in enumerate(phases, start=1):
            axes = figure.add_subplot(1, len(phases), index)
            data = case[case["phase"] == phase].sort_values("rank")
            positions = np.arange(len(data))
            axes.bar(positions - 0.2, data["sent_bytes"] / 1e6, width=0.4, label="sent")
            axes.bar(positions + 0.2, data["recv_bytes"] / 1e6, width=0.4, label="received")
            axes.set_xticks(positions, [str(r) for r in data["rank"]], fontsize="x-small")
            axes.set_xlabel("rank")
            axes.set_ylabel("MB (1e6 B), self included")
            axes.set_title(phase)
            axes.legend(fontsize="x-small")
        figure.suptitle(title)
        plots.append((title, _figure_png(figure)))
    return plots


_PNG_URL = "data:image/png;base64,"
_HTML_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: 1em; white-space: pre-wrap; }
.warning { color: #a00; font-weight: bold; }
img { max-width: 100%; }
"""


def report_html(frame: pd.DataFrame, ranks: pd.DataFrame, meta: dict[str, Any], spec: BandwidthSpec) -> str:
    """A self-contained HTML page: conventions, environment, tables and plots (PNG embedded as base64)."""
    esc = html.escape
    frame = with_knob_setting(frame)
    ranks = with_knob_setting(ranks)
    body = ["<h1>commbench report</h1>"]
    if _any_emulated(frame):
        body.append('<p class="warning">Emulated backend: times and bandwidths are not hardware figures.</p>')
    body += [
        "<h2>Conventions</h2>",
        f"<pre>{esc(CONVENTIONS)}</pre>",
        f"<p>Spec: {esc(spec.describe())}.</p>",
    ]
    topology = topology_text(frame, meta)
    if topology:
        body.append(f"<p>Topology: {esc(topology)}.</p>")
    body += ["<h2>Environment</h2>", _html_table(["item", "value"], _environment_lines(meta), left=True)]
    body.append("<h2>Results</h2>")
    for name, group in _pattern_groups(frame):
        body += [f"<h3>{esc(name)}</h3>", _html_table(*_table_cells(group))]
    avg = average_bus_bandwidth(frame)
    body.append(f"<p>Avg bus bandwidth: {_fmt_bw(avg)} GB/s</p>")
    links = link_class_table(frame)
    if links:
        body += ["<h2>By link class</h2>", f"<p>{esc(link_class_legend(spec))}</p>", _html_table(*links)]
    costs = skew_cost_table(frame)
    if costs:
        body += ["<h2>What skew costs</h2>", f"<p>{esc(SKEW_COST_NOTE)}</p>", _html_table(*costs)]
    body.append("<h2>Plots</h2>")
    for title, png in (
        ("Balanced all-to-all: bus bandwidth vs size", _plot_balanced(frame, spec)),
        ("Achieved per-GPU bandwidth vs spec", _plot_per_gpu_vs_spec(frame, spec)),
    ):
        if png:
            body.append(f'<h3>{esc(title)}</h3><img alt="{esc(title)}" src="{_PNG_URL}{png}">')
    for title, png in _plot_ranks(ranks):
        body.append(f'<h3>Per-rank bytes: {esc(title)}</h3><img alt="{esc(title)}" src="{_PNG_URL}{png}">')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>commbench report</title>'
        f"<style>{_HTML_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
