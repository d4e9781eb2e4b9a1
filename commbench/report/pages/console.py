"""What a run prints on stdout: the balanced all-to-all as nccl-tests' alltoall_perf prints it, then MoE rows.

``results_table`` prints, for the balanced all-to-all rows, what ``alltoall_perf`` prints (NVIDIA/nccl-tests
v2.19.6 src/util.cu: the "# nccl-tests version" line, the run-parameter line, "# Using devices" with one
line per rank, the two-row column header, one row per size with out-of-place and in-place groups, the
"Out of bounds values" and "Avg bus bandwidth" footer), with nccl-tests' time (the mean over the timed
iterations) and its bandwidths; commbench's timing and check modes are said in "#" comment lines. The first
line is nccl-tests' (its version is the format's, the parenthesis says it is commbench), so that parsers
keyed on it read it. Rows are printed with nccl-tests' printf formats (writeBenchmarkLinePreamble and
writeBenchmarkLineBody): a size's in-place group holds the in-place run's time and bandwidths and, as in
nccl-tests' alltoall, "N/A" for #wrong (not checked: its result is undefined), so a row ends at column 117
as nccl-tests' does; a backend without an in-place run prints N/A in every in-place cell, and a group that
was not checked (mock, sim) prints #wrong as nccl-tests without validation does. The MoE phases get
commbench's own table below it (time mean, p50, p99; bandwidths from p50). Trailing blanks are stripped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from commbench.hardware.probes import bus_id_text, pci_tuple
from commbench.inputs.specs import NO_SPEC_NAME
from commbench.plain import is_missing
from commbench.report.frame import average_bus_bandwidth, balanced_rows
from commbench.report.knobs import KNOB_SETTING_COLUMN, with_knob_setting
from commbench.report.pages.modes import TIMING_TIME, check_text, timing_how, timing_modes, with_timing
from commbench.report.pages.tables import (
    REPEAT,
    TIMING,
    any_emulated,
    column,
    column_table,
    fmt_int,
    fmt_pct,
    fmt_text,
    fmt_time,
    fmt_wrong,
    format_bandwidth,
    timing_shown,
)
from commbench.run.config_meta import meta_values

PROGRAM = "commbench balanced alltoall"  # nccl-tests prints its program name ("alltoall_perf") here
# The nccl-tests release whose output format the stdout table and results.json follow (src/util.cu read at
# NVIDIA/nccl-tests v2.19.6, commit a0b82b2); its first line names it, as nccl-tests names its own version.
NCCL_TESTS_VERSION = "2.19.6"
# commbench moves bytes: one element is one byte, so count and #wrong are in bytes.
TYPE_NAME = "uint8"
REDOP = "none"
ROOT = -1
# nccl-tests' time for each timing mode: its mean over the timed iterations.
_BALANCED_TIME = {
    "iteration": "the mean over the timed iterations of each iteration's max across ranks (nccl-tests' time)",
    "window": "the max across ranks of window / iterations (nccl-tests' time, whose default -a 1 averages "
    "the ranks instead)",
    "graph": "the max across ranks of window / (replays x calls per CUDA graph) (nccl-tests' time with -G)",
}
_GROUP_TIMES = ("time", "algbw", "busbw", "#wrong")
_GROUP_UNITS = ("(us)", "(GB/s)", "(GB/s)", "")
_GROUP_WIDTHS = (7, 6, 6, 6)


def results_table(frame: pd.DataFrame, meta: Mapping[str, Any] | None = None) -> str:
    """What a run prints on stdout for a ``results_frame``: the balanced rows in nccl-tests' layout, then
    the MoE rows' table; either alone when the run has only one kind. ``meta`` is the report's meta.json
    content (arguments, topology); None reads ``frame.attrs["meta"]`` (a re-rendered folder), else the
    header takes what the rows say."""
    if meta is None:
        meta = frame.attrs.get("meta") or {}
    balanced = balanced_rows(frame)
    moe = frame[~frame.index.isin(balanced.index)] if not balanced.empty else frame
    parts = []
    if not balanced.empty:
        parts.append(nccl_tests_table(balanced, meta))
    if not moe.empty or balanced.empty:
        parts.append(moe_table(moe))
    return "\n#\n".join(parts)


# ----------------------------------------------------------------------------------------------------------
# The balanced all-to-all, as nccl-tests' alltoall_perf prints it


def nccl_float(value: Any, width: int) -> str:
    """A figure in ``width`` characters as nccl-tests writes it (getFloatStr): 2 decimals, else 1, else 0,
    else exponent form; "nan" for a missing figure (what printf writes for NaN)."""
    number = float("nan") if is_missing(value) else float(value)
    for spec in (".2f", ".1f", ".0f"):
        text = f"{number:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{number:{width}{'.1e' if width >= 7 else '.0e'}}"[:width]


def _group(time_us: Any, algbw: Any, busbw: Any, wrong: Any) -> str:
    """One out-of-place or in-place group as nccl-tests' writeBenchmarkLineBody prints it: "  %7s  %6s  %6s
    %6g" (time, algbw, busbw, #wrong), or "    N/A" in place of "  %6g" where nothing was checked (its
    reportErrors 0: nccl-tests' in-place alltoall, or no validation)."""
    figures = f"  {nccl_float(time_us, 7)}  {nccl_float(algbw, 6)}  {nccl_float(busbw, 6)}"
    return figures + ("    N/A" if is_missing(wrong) else f"  {float(wrong):6g}")


def _group_header(cells: Sequence[str]) -> str:
    return "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, _GROUP_WIDTHS, strict=True))


COLUMN_HEADER = (
    f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place                       in-place",
    f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  "
    f"{_group_header(_GROUP_TIMES)}  {_group_header(_GROUP_TIMES)}",
    f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  "
    f"{_group_header(_GROUP_UNITS)}  {_group_header(_GROUP_UNITS)}".rstrip(),
)
# A group that did not run (a backend without an in-place all-to-all): N/A in nccl-tests' columns.
_NOT_RUN = f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}    N/A"


def per_peer_count(record: Mapping[str, Any]) -> int:
    """nccl-tests' count of a balanced row: the uint8 elements (bytes) each rank sends to each peer, size /
    ranks (all of size when the row does not say its ranks)."""
    size = int(record["size_bytes"])
    world = record.get("world_size")
    return size // int(world) if not is_missing(world) and int(world) > 0 else size


def ran_in_place(record: Mapping[str, Any]) -> bool:
    """Whether a balanced row has an in-place time (its backend ran the in-place all-to-all)."""
    return not is_missing(record.get("in_place_time_us_mean"))


def nccl_tests_row(record: Mapping[str, Any]) -> str:
    """One size as nccl-tests prints it ("%12li  %12li  %8s  %6s  %6s", then two groups): size, count (uint8
    elements to each peer), type, redop, root, the out-of-place group (time = the mean, algbw, busbw,
    #wrong), then the in-place group (its time and bandwidths, #wrong N/A: never checked), N/A where the
    backend has no in-place run."""
    size = int(record["size_bytes"])
    preamble = f"{size:12d}  {per_peer_count(record):12d}  {TYPE_NAME:>8}  {REDOP:>6}  {ROOT:6d}"
    out_of_place = _group(
        record.get("time_us_mean"),
        record.get("algbw_mean_GBps"),
        record.get("busbw_mean_GBps"),
        record.get("wrong"),
    )
    in_place = _NOT_RUN
    if ran_in_place(record):
        in_place = _group(
            record["in_place_time_us_mean"],
            record.get("in_place_algbw_mean_GBps"),
            record.get("in_place_busbw_mean_GBps"),
            None,
        )
    return preamble + out_of_place + in_place


def _number(value: Any) -> str:
    """An argument as nccl-tests prints it: whole numbers without a fraction, "?" when unknown."""
    if is_missing(value) or value == "":
        return "?"
    number = float(value)
    return str(int(number)) if number.is_integer() else f"{number:g}"


def _step_factor(args: Mapping[str, Any], sizes: list[int]) -> Any:
    """The sweep's step factor: the argument, else the constant ratio of consecutive sizes, else None."""
    if args.get("step_factor") is not None:
        return args["step_factor"]
    if len(sizes) < 2:
        return 1 if sizes else None
    ratios = [b / a for a, b in zip(sizes, sizes[1:], strict=False) if a > 0]
    return ratios[0] if ratios and max(ratios) - min(ratios) < 1e-9 * max(ratios) else None


def _row_value(frame: pd.DataFrame, name: str) -> Any:
    """A value every row shares (e.g. ``iters``), or None."""
    if name not in frame.columns:
        return None
    values = {v for v in frame[name] if not is_missing(v)}
    return values.pop() if len(values) == 1 else None


def _whole(value: Any) -> Any:
    """A number as nccl-tests' JSON writes its integers (size_t, int): an int when it is whole; None stays."""
    if is_missing(value):
        return None
    number = float(value)
    return int(number) if number.is_integer() else number


def json_bool(value: bool) -> str:
    """A flag as nccl-tests' JSON writes one (jsonBool): the string "true" or "false"."""
    return "true" if value else "false"


def sweep_config(frame: pd.DataFrame, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The balanced sweep's parameters under nccl-tests' JSON ``config`` names and types (src/util.cu
    writeDeviceReport): one process per rank with one GPU (nthreads 1, ngpus 1), no aggregation, no CUDA
    graph, no parallel init; the sizes, step factor and iterations from meta.json's arguments, else the rows
    (None where neither says), integers where whole; validation 1 when a row was verified;
    blocking_collectives "true" where the host waited for every timed call (-z 1: iteration timing; a window
    with --blocking 1); per_iter_timing "false" (no per-iteration lists are written); ``devices`` from the
    rank places (``rank_records``); then commbench's own timing and check modes."""
    args = meta_values(dict(meta))  # the options and plan (meta.json of earlier versions: its args)
    sizes = sorted({int(size) for size in frame["size_bytes"]}) if "size_bytes" in frame else []
    checks = [str(c) for c in dict.fromkeys(frame["check"]) if not is_missing(c)] if "check" in frame else []
    timings = timing_modes(frame)
    waited = {"iteration", "window"} if args.get("blocking") == 1 else {"iteration"}  # each call (-z 1)
    return {
        "nthreads": 1,
        "ngpus": 1,
        "minimum_bytes": _whole(args.get("min_bytes", sizes[0] if sizes else None)),
        "maximum_bytes": _whole(args.get("max_bytes", sizes[-1] if sizes else None)),
        "step_factor": _whole(_step_factor(args, sizes)),
        "warmup_iters": _whole(args.get("warmup", _row_value(frame, "warmup"))),
        "iterations": _whole(args.get("iters", _row_value(frame, "iters"))),
        "aggregated_iterations": 1,
        "validation": int("wrong" in frame.columns and bool(frame["wrong"].notna().any())),
        "graph": _whole(args.get("iters", _row_value(frame, "iters"))) if args.get("cuda_graph") else 0,  # -G
        "blocking_collectives": json_bool(bool(timings) and set(timings) <= waited),
        "per_iter_timing": json_bool(False),
        "per_iter_skip": 0,
        "parallel_init": json_bool(False),
        "devices": rank_records(meta),
        "timing": timings,
        "check": checks,
    }


def parameter_line(config: Mapping[str, Any]) -> str:
    """nccl-tests' "# nThread 1 nGpus 1 minBytes ..." line of a ``sweep_config``."""
    return (
        f"# nThread 1 nGpus 1 minBytes {_number(config['minimum_bytes'])} maxBytes "
        f"{_number(config['maximum_bytes'])} step: {_number(config['step_factor'])}(factor) warmup iters: "
        f"{_number(config['warmup_iters'])} iters: {_number(config['iterations'])} agg iters: 1 "
        f"validation: {config['validation']} graph: {_number(config.get('graph', 0))} unalign: 0"
    )


def bus_id_cell(bus_id: Any) -> str | None:
    """A recorded PCI bus id ("00000000:19:00.0" from NVML, "0000:19:00" ...) as nccl-tests prints it
    (``hardware.probes.bus_id_text``); what is not a bus id as recorded; None for none."""
    text = "" if is_missing(bus_id) else str(bus_id).strip()
    if not text:
        return None
    pci = pci_tuple(text)
    return bus_id_text(pci) if pci is not None else text


def rank_records(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's place (meta.json's topology) under nccl-tests' JSON device names: rank, group, pid,
    hostname, device (CUDA ordinal, -1 for a CPU rank), device_hex, device_info; None where not recorded
    (folders written before ranks reported their pid and device)."""
    places = (meta.get("topology") or {}).get("places") or []
    records = []
    for rank, place in enumerate(places):
        device = place.get("device")
        if device is None and not place.get("gpu_uuid"):
            device = -1  # an older folder's CPU rank: no GPU reported
        pid = place.get("pid")
        records.append(
            {
                "rank": rank,
                "group": 0,
                "pid": pid if isinstance(pid, int) and pid > 0 else None,
                "hostname": place.get("host") or None,
                "device": device if isinstance(device, int) else None,
                "device_hex": "cpu" if device == -1 else bus_id_cell(place.get("bus_id")),
                "device_info": place.get("gpu_name") or ("CPU" if device == -1 else None),
            }
        )
    return records


def rank_lines(meta: Mapping[str, Any]) -> list[str]:
    """ "#  Rank  0 Group  0 Pid  12345 on   hostname device  0 [0000:19:00] NVIDIA H200" per rank
    (``rank_records``; "?" for what was not recorded)."""
    records = rank_records(meta)
    if not records:
        return ["#  (rank places not recorded in this report)"]

    def shown(value: Any, width: int) -> str:
        return f"{'?' if value is None else value:>{width}}"

    return [
        f"#  Rank {r['rank']:2d} Group {r['group']:2d} Pid {shown(r['pid'], 6)} on "
        f"{shown(r['hostname'], 10)} device {shown(r['device'], 2)} [{shown(r['device_hex'], 0)}] "
        f"{shown(r['device_info'], 0)}"
        for r in records
    ]


def out_of_bounds_count(frame: pd.DataFrame) -> int | None:
    """The verified rows with #wrong > 0 (nccl-tests' "Out of bounds values" counts failed checks); None
    when no row was verified (check off, or a backend that moves no data)."""
    if frame.empty or "wrong" not in frame.columns:
        return None
    wrong = pd.to_numeric(frame["wrong"], errors="coerce").dropna()
    return None if wrong.empty else int((wrong > 0).sum())


def out_of_bounds_line(frame: pd.DataFrame) -> str:
    """nccl-tests' "# Out of bounds values : 0 OK" (a count and FAILED when rows were wrong; n/a when no row
    was verified)."""
    failed = out_of_bounds_count(frame)
    if failed is None:
        return f"# {'Out of bounds values':<20} : n/a (nothing verified)"
    return f"# {'Out of bounds values':<20} : {failed} {'FAILED' if failed else 'OK'}"


def total_wrong_text(frame: pd.DataFrame) -> str:
    """The sum of #wrong over the rows that were verified; "n/a" when none was (no data moved)."""
    values = pd.to_numeric(frame["wrong"], errors="coerce")
    verified = values.dropna()
    if verified.empty:
        return "n/a (no data moved)"
    total = int(verified.sum())
    unverified = int(values.isna().sum())
    note = f" ({unverified} rows n/a: no data moved)" if unverified else ""
    return f"{total}{note}{'  (DATA MISMATCH)' if total else ''}"


def _mode_lines(frame: pd.DataFrame, times: Mapping[str, str], blocking: int | None = None) -> list[str]:
    """ "# timing: ..." (with the time it gives; a window's with the run's --blocking) and "# check: ..."."""
    lines = []
    for mode in timing_modes(frame):
        how = timing_how(frame, mode, blocking)
        lines += [f"# timing: {mode}{f' ({how})' if how else ''}", f"# time = {times.get(mode, '?')}"]
    checked = check_text(frame)
    if checked:
        lines.append(f"# check: {checked}")
    return lines


def nccl_version_code(version: Any) -> int | None:
    """NCCL's version code (NCCL_VERSION_CODE, what nccl-tests prints and writes) of a version text: 2.27.3
    -> 22703 (major x 10000 + minor x 100 + patch from 2.9 on, x 1000 + minor x 100 + patch before); None
    for none or a text that is not one."""
    parts = str(version).split(".") if not is_missing(version) and version != "" else []
    try:
        major, minor, patch = (int(part) for part in (parts + ["0", "0"])[:3])
    except ValueError:
        return None
    if not parts:
        return None
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def _first_line(meta: Mapping[str, Any]) -> str:
    """nccl-tests' "# nccl-tests version V nccl-headers=N nccl-library=N": V is the format's release, the
    parenthesis (where nccl-tests 2.20 prints its build) says commbench wrote it; both codes are the NCCL
    torch loaded (torch reports one, the library), 0 without NCCL (a CPU build of torch)."""
    version = meta.get("commbench_version") or (meta.get("env") or {}).get("versions", {}).get("commbench")
    nccl = nccl_version_code(((meta.get("env") or {}).get("versions") or {}).get("nccl")) or 0
    commbench = f"commbench {version}" if version else "commbench"
    return (
        f"# nccl-tests version {NCCL_TESTS_VERSION} (output format only: this is {commbench}, not "
        f"nccl-tests) nccl-headers={nccl} nccl-library={nccl}"
    )


def _run_line(frame: pd.DataFrame, meta: Mapping[str, Any]) -> str:
    """commbench's own run line: backend (emulated or not), ranks, torch and NCCL versions."""
    env_versions = (meta.get("env") or {}).get("versions") or {}
    versions = " ".join(f"{k} {v}" for k, v in env_versions.items() if k in ("torch", "nccl") and v)
    backends = ", ".join(dict.fromkeys(frame["backend"].astype(str))) if "backend" in frame else "?"
    emulated = " (EMULATED: not GPU fabric figures)" if any_emulated(frame) else ""
    return (
        f"# commbench: backend {backends}{emulated}; {fmt_int(_row_value(frame, 'world_size'))} ranks"
        f"{f'; {versions}' if versions else ''}; nccl-tests alltoall_perf layout"
    )


def in_place_lines(frame: pd.DataFrame) -> list[str]:
    """What the in-place columns hold: the in-place run (where the rows have one) and the backends that have
    none (N/A)."""
    records = frame.to_dict("records")
    ran = [r for r in records if ran_in_place(r)]
    lines = []
    if ran:
        lines += [
            "# in-place: the same exchange with one buffer as its input and output (nccl-tests' in-place",
            "#   alltoall), timed the same way right after; #wrong N/A: its result is undefined (a row may",
            "#   be overwritten before it is sent), so it is not checked, as nccl-tests does not check it",
        ]
    without = {str(r.get("backend", "?")): r.get("backend_name") for r in records if not ran_in_place(r)}
    for label, name in without.items():
        lines.append(f"# in-place: N/A for {label}: {_why_not_in_place(name)}")
    return lines


def _why_not_in_place(backend_name: Any) -> str:
    """Why a backend's rows have no in-place run, from its class's own ``in_place`` (loaded lazily)."""
    from commbench.backends import ENTRIES, load_backend

    if isinstance(backend_name, str) and backend_name in ENTRIES:
        backend_class, _ = load_backend(backend_name)
        if getattr(backend_class, "in_place", False):
            return "not in this report: written before commbench ran it"
    return "its backend has no in-place call"


_SETTING_NAMES = {KNOB_SETTING_COLUMN: "knobs"}


def _settings(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The balanced rows split by what tells sweeps apart (backend, knob setting, timing mode), each with
    its label ("" for a single sweep)."""
    frame = with_timing(with_knob_setting(frame))
    keys = [
        key
        for key in ("backend", KNOB_SETTING_COLUMN, "timing")
        if key in frame.columns and frame[key].astype(str).nunique() > 1
    ]
    if not keys:
        return [("", frame)]
    settings = []
    for values, group in frame.groupby(keys, sort=False, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        label = "; ".join(f"{_SETTING_NAMES.get(k, k)} {v}" for k, v in zip(keys, values, strict=True))
        settings.append((label, group))
    return settings


def nccl_tests_table(frame: pd.DataFrame, meta: Mapping[str, Any]) -> str:
    """The balanced all-to-all rows as nccl-tests' alltoall_perf prints them (see the module docstring);
    one column header and footer per sweep when the rows hold several (backends, knob settings, timings)."""
    config = sweep_config(frame, meta)
    lines = [_first_line(meta), f"# Collective test starting: {PROGRAM}", parameter_line(config)]
    lines.append(_run_line(frame, meta))
    lines += _mode_lines(frame, _BALANCED_TIME, meta_values(dict(meta)).get("blocking"))
    lines += [
        "# size = bytes each rank sends; count = uint8 elements (bytes) to each peer; algbw = size / time;",
        "# busbw = algbw x (n-1)/n; GB = 1e9 B",
        *in_place_lines(frame),
        "#",
        "# Using devices",
        *rank_lines(meta),
    ]
    for label, group in _settings(frame):
        lines.append("#")
        if label:
            lines.append(f"# sweep: {label}")
        lines += [*COLUMN_HEADER, *(nccl_tests_row(r) for r in group.to_dict("records"))]
        lines += [
            out_of_bounds_line(group),
            f"# {'Avg bus bandwidth':<20} : {average_bus_bandwidth(group):g}",
        ]
    if "wrong" in frame.columns:  # commbench's addition: the bytes behind "Out of bounds values"
        lines.append(f"# {'Total #wrong':<20} : {total_wrong_text(frame)}")
    lines += ["#", f"# Collective test concluded: {PROGRAM}"]
    return "\n".join(line.rstrip() for line in lines)


# ----------------------------------------------------------------------------------------------------------
# The MoE phases: commbench's table


# Fixed minimum widths so consecutive runs line up.
_MOE_COLUMNS = (
    column("pattern", "pattern", fmt_text, 12),
    column("skew", "skew", fmt_text, 10),
    column("phase", "phase", fmt_text, 8),
    REPEAT,  # where a case was measured several times: three rows of one case are told apart
    column("size_bytes", "size(B)", fmt_int, 10),
    column("time_us_mean", "mean(us)", fmt_time, 9),
    column("time_us_p50", "p50(us)", fmt_time, 9),
    column("time_us_p99", "p99(us)", fmt_time, 9),
    column("algbw_GBps", "algbw(GB/s)", format_bandwidth, 11),
    column("busbw_GBps", "busbw(GB/s)", format_bandwidth, 11),
    column("pct_spec", "%spec", fmt_pct, 6),
    column("wrong", "#wrong", fmt_wrong, 6),
    TIMING,  # where the rows mix timing modes
    column(KNOB_SETTING_COLUMN, "knobs", fmt_text, 5),  # a sweep's setting of each row, last
)


def moe_table(frame: pd.DataFrame) -> str:
    """The MoE phases' table: mean, p50 and p99 (each its own column, named in the header); algbw, busbw and
    %spec from p50; the repeat where a case ran several times; the timing and check modes; the total
    #wrong."""
    frame = timing_shown(with_knob_setting(frame))
    lines = []
    if not frame.empty:
        first = frame.iloc[0]
        backends = ", ".join(dict.fromkeys(frame["backend"].astype(str))) if "backend" in frame else "?"
        emulated = " (EMULATED: not GPU fabric figures)" if any_emulated(frame) else ""
        spec_name = fmt_text(first.get("spec_name"))
        spec_text = (
            "none (no %spec)"
            if spec_name == NO_SPEC_NAME
            else f"{spec_name} {fmt_text(first.get('spec_GBps'))} GB/s per GPU per direction"
        )
        lines.append(
            f"# MoE phases: backend {backends}{emulated}; ranks: {fmt_int(first.get('world_size'))}; "
            f"spec: {spec_text}"
        )
        lines += _mode_lines(frame, TIMING_TIME)
        lines.append(
            "# one statistic per column over the timed iterations, max over ranks: mean(us), p50(us), "
            "p99(us); algbw, busbw and %spec from p50(us); GB = 1e9 B; see summary.md"
        )
    shown = [c for c in _MOE_COLUMNS if c.source in frame.columns]
    lines.append(
        column_table(shown, frame).text(
            min_widths=[c.min_width for c in shown],
            header_prefix="# ",
            row_prefix="  ",
            separator=" ",
        )
    )
    if "wrong" in frame.columns and not frame.empty:
        lines.append(f"# {'Total #wrong':<20} : {total_wrong_text(frame)}")
    return "\n".join(lines)
