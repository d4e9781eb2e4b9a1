"""The acceptance verdict: named checks (PASS/WARN/FAIL/SKIP) from a run's results, limits and spec.

``build_verdict`` turns the results frame (``commbench.report.frame.results_frame``), the ``Limits``, the
spec (None for a CPU run), the rank-spread outcomes (``report.judge.outliers``) and how the run ended
(``RunStatus``) into ``Element``s, one per check, in groups:

- ``run``: completion (no timeout, no dead rank); ``data``: #wrong == 0; ``harness``: every row timed;
- ``balanced``: each balanced all-to-all row against its size range's floor or latency ceiling;
- ``moe``: each dispatch / combine row against its phase's floor;
- ``spread``: each case's rank outliers (FAIL only when confirmed by reruns);
- from other modules, through ``extra``: ``pairwise`` (``report.pairs``: each ordered pair against its
  link class), ``preflight`` and ``health`` (``report.preflight``: GPUs before the run, counters after),
  ``soak`` (``report.soak``: drift over a --soak run), ``baseline`` (``report.compare``).

A CPU run (no spec) judges data, completion, harness and spread; bandwidth checks SKIP "CPU run: no GPU
spec". Emulated rows (mock, sim) SKIP their bandwidth checks too.

Overall status: FAIL if any element FAILs; else INCOMPLETE if the run did not finish; else WARN if any
element WARNs; else PASS. Exit code, first that applies: 4 a rank died or a collective timed out; 3 wrong
data; 128 + N stopped by signal N (as every commbench command); 2 could not run; 1 FAIL; 0 PASS or WARN.
``verdict.json`` (schema ``commbench.verdict/1``): status, exit code, reason, counts, run state, spec and
how it was chosen, the limits, every element.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from commbench.errors import (
    CommbenchError,
    CommError,
    StoppedError,
    UsageError,
    VerificationError,
)
from commbench.inputs.limits import Floor, Limits
from commbench.inputs.specs import SystemSpec
from commbench.inputs.userfiles import load_json
from commbench.plain import is_missing, plain
from commbench.report.folder.claim import write_atomic
from commbench.report.judge.outliers import SpreadOutcome
from commbench.run.case import Case, size_text

SCHEMA = "commbench.verdict/1"
VERDICT_FILE = "verdict.json"
MAX_VERDICT_BYTES = 16 << 20  # one element per check: a few KiB per case
STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
OVERALL = ("PASS", "WARN", "FAIL", "INCOMPLETE")
FAULT_STATES = ("timed_out", "rank_died")  # the run ended because the fabric or a rank failed: exit 4
RUN_STATES = ("complete", "interrupted", *FAULT_STATES, "wrong_data", "could_not_run", "incomplete")
GROUPS = ("run", "preflight", "data", "harness", "balanced", "moe", "spread", "pairwise", "soak", "health")
CPU_SKIP = "CPU run: no GPU spec"
_LINK_REMEDY = (
    "check `nvidia-smi nvlink -s` (link speeds), `nvidia-smi nvlink -e` (error counters) and `nvidia-smi -q "
    "-d PERFORMANCE` (throttling) on every host; compare with nccl-tests alltoall_perf at this size"
)
_SLOW_RANK_REMEDY = (
    "run the pairwise link test (nccl-tests sendrecv_perf with a healthy GPU); check `nvidia-smi nvlink -s` "
    "and `nvidia-smi nvlink -e` on that host"
)
_CPU_RANK_REMEDY = "on a CPU run a slow rank is this host's scheduling (or --inject-delay): check other load"
_WRONG_REMEDY = (
    "data was corrupted: rerun with --check every to find the iterations; check `nvidia-smi -q -d ECC` and "
    "`dmesg` for Xid errors on the hosts; run nccl-tests alltoall_perf -c 1 on the same GPUs"
)
_HANG_REMEDY = (
    "rerun with TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 to see which rank did not "
    "arrive; check that host's `dmesg` for Xid errors and `nvidia-smi -q -d ECC`"
)


@dataclass(frozen=True)
class Element:
    """One named check. ``limit`` is the threshold the status was decided against (the FAIL one for a
    FAIL, the WARN one otherwise), in ``unit``; ``remedy`` says what to do about a FAIL or WARN."""

    group: str
    name: str
    status: str
    message: str
    measured: float | int | str | None = None
    limit: float | int | str | None = None
    unit: str = ""
    remedy: str = ""


@dataclass(frozen=True)
class RunStatus:
    """How the run ended: ``state`` one of RUN_STATES, ``reason`` one line, ``signum`` for a signal stop."""

    state: str = "complete"
    reason: str = ""
    signum: int | None = None


@dataclass(frozen=True)
class Verdict:
    """The outcome of a run: overall ``status`` (OVERALL), ``exit_code``, ``reason`` and every element."""

    status: str
    exit_code: int
    reason: str
    elements: tuple[Element, ...]
    run: RunStatus = RunStatus()
    spec_name: str | None = None
    spec_how: str = ""
    spec_GBps: float | None = None  # the per-direction NVLink figure fractions are of
    limits: Mapping[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {status: sum(e.status == status for e in self.elements) for status in STATUSES}


def run_status_from_error(error: BaseException | None) -> RunStatus:
    """The RunStatus of a run that ended with ``error`` (None: it finished), by commbench's error types."""
    if error is None:
        return RunStatus()
    # The first line only: a failed rank's error carries its whole traceback after it.
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    text = " ".join(first.split())[:300] or type(error).__name__
    if isinstance(error, StoppedError):
        # "stopped by SIGTERM", or "the launcher (pid 12) is gone": what the report's INCOMPLETE says too.
        return RunStatus("interrupted", error.reason, error.signum)
    if isinstance(error, KeyboardInterrupt):
        return RunStatus("interrupted", "stopped by SIGINT", 2)
    if isinstance(error, CommError):
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        return RunStatus("timed_out" if timed_out else "rank_died", text)
    if isinstance(error, VerificationError):
        return RunStatus("wrong_data", text)
    if isinstance(error, UsageError):
        return RunStatus("could_not_run", text)
    if isinstance(error, CommbenchError):
        return RunStatus("incomplete", text)
    return RunStatus("incomplete", f"unexpected error: {type(error).__name__}: {text}")


def _num(value: float) -> str:
    """A figure as a reader wants it: 410, 41.2, 4.12, 0.0412."""
    if is_missing(value) or not math.isfinite(value):
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def _value(row: Mapping[str, Any], column: str) -> float:
    value = row.get(column)
    try:
        return math.nan if is_missing(value) else float(value)
    except (TypeError, ValueError):
        return math.nan


def _is_true(value: Any) -> bool:
    """A flag of a results row (``emulated``): a bool in the harness's rows and in a folder read back
    (``report.folder.reading``); anything else is not set."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


def _case(row: Mapping[str, Any]) -> str:
    """The element name of a result row's case: its ``Case.label`` ("balanced 16 MiB", "deepseek-v3
    dispatch skew zipf:1.2 512 tok/rank")."""
    return Case.from_row(row).label


def _bandwidth_element(
    group: str, name: str, row: Mapping[str, Any], floor: Floor, spec_GBps: float
) -> Element:
    # Balanced rows: busbw from the mean time, as nccl-tests' (and its published figures); MoE rows: p50.
    busbw = _value(row, "busbw_mean_GBps" if group == "balanced" else "busbw_GBps")
    busbw = _value(row, "busbw_GBps") if math.isnan(busbw) else busbw
    if math.isnan(busbw):
        return Element(group, name, "SKIP", f"{name}: no busbw (no time measured)", unit="GB/s")
    warn, fail = floor.warn_fraction * spec_GBps, floor.fail_fraction * spec_GBps
    status = "FAIL" if busbw < fail else "WARN" if busbw < warn else "PASS"
    fraction = floor.fail_fraction if status == "FAIL" else floor.warn_fraction
    relation = ">=" if status == "PASS" else "<"
    message = f"{name} busbw {_num(busbw)} GB/s {relation} {fraction:g} x {spec_GBps:g} GB/s"
    remedy = "" if status == "PASS" else _LINK_REMEDY
    return Element(
        group, name, status, message, round(busbw, 3), round(fraction * spec_GBps, 3), "GB/s", remedy
    )


def _small_element(name: str, row: Mapping[str, Any], limits: Limits, spec_GBps: float) -> Element:
    time_us = _value(row, "time_us_mean")  # nccl-tests' time: the mean
    time_us = _value(row, "time_us_p50") if math.isnan(time_us) else time_us
    if math.isnan(time_us):
        return Element("balanced", name, "SKIP", f"{name}: no time measured", unit="us")
    link_bytes = max(_value(row, "max_send_link_bytes"), _value(row, "max_recv_link_bytes"))
    world = int(_value(row, "world_size") or 1)
    if math.isnan(link_bytes):  # nccl-tests' balanced bytes per rank over links: size x (n-1)/n
        link_bytes = _value(row, "size_bytes") * (world - 1) / max(world, 1)
    warn_us, fail_us = limits.small_ceilings_us(world, link_bytes, spec_GBps)
    status = "FAIL" if time_us > fail_us else "WARN" if time_us > warn_us else "PASS"
    limit = fail_us if status == "FAIL" else warn_us
    relation = "<=" if status == "PASS" else ">"
    message = (
        f"{name} time {_num(time_us)} us {relation} {_num(limit)} us (latency ceiling for {world} ranks, "
        "bytes at line rate included)"
    )
    remedy = "" if status == "PASS" else "small all-to-alls this slow point at a broken path: " + _LINK_REMEDY
    return Element("balanced", name, status, message, round(time_us, 3), round(limit, 3), "us", remedy)


def _not_judged(row: Mapping[str, Any], name: str, limits: Limits, spec: SystemSpec | None) -> str:
    """Why a row's bandwidth is not judged ("" when it is): a CPU run, an emulated backend, a small MoE."""
    if spec is None or limits.cpu_run:
        return f"{CPU_SKIP}: {name} not judged against a GPU fabric"
    if _is_true(row.get("emulated")):
        return f"{row.get('backend') or 'the backend'} is emulated: {name} is modelled, not measured"
    size, minimum = _value(row, "size_bytes"), limits.value("moe.min_bytes")
    if row.get("phase") != "alltoall" and size < minimum:
        return f"{name}: {size_text(int(size))} < moe.min_bytes {size_text(int(minimum))}, latency-bound"
    return ""


def _row_elements(frame: pd.DataFrame, limits: Limits, spec: SystemSpec | None) -> list[Element]:
    out = []
    spec_GBps = float(spec.nvlink_GBps_per_direction) if spec is not None else 0.0
    for row in frame.to_dict("records"):
        phase, name = row.get("phase"), _case(row)
        if phase not in ("alltoall", "dispatch", "combine"):
            continue
        group = "balanced" if phase == "alltoall" else "moe"
        why = _not_judged(row, name, limits, spec)
        if why:
            out.append(Element(group, name, "SKIP", why))
        elif group == "moe":
            out.append(_bandwidth_element(group, name, row, limits.moe_floor(str(phase)), spec_GBps))
        elif limits.balanced_range(int(_value(row, "size_bytes"))) == "small":
            out.append(_small_element(name, row, limits, spec_GBps))
        else:
            floor = limits.balanced_floor(limits.balanced_range(int(_value(row, "size_bytes"))))
            out.append(_bandwidth_element(group, name, row, floor, spec_GBps))
    return _unique(out)


def _unique(elements: list[Element]) -> list[Element]:
    """Names made unique within their group ("#2", "#3" for repeats of a case)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for element in elements:
        key = (element.group, element.name)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            element = Element(**{**asdict(element), "name": f"{element.name} #{seen[key]}"})
        out.append(element)
    return out


def _data_elements(frame: pd.DataFrame, run: RunStatus) -> list[Element]:
    records = frame.to_dict("records")
    checked = [row for row in records if not is_missing(row.get("wrong"))]
    out = []
    for row in checked:
        wrong = int(row["wrong"])
        if wrong > 0:
            name = f"{_case(row)} #wrong"
            message = f"{_case(row)} #wrong {wrong} (mismatched bytes or elements, summed over ranks)"
            out.append(Element("data", name, "FAIL", message, wrong, 0, "", _WRONG_REMEDY))
    if run.state == "wrong_data" and not out:
        out.append(Element("data", "#wrong", "FAIL", run.reason or "wrong data", None, 0, "", _WRONG_REMEDY))
    if out:
        return out
    if not checked:
        why = "no row was checked (a backend that moves no data, or no row finished)"
        return [Element("data", "#wrong", "SKIP", why, None, 0)]
    unchecked = len(records) - len(checked)
    note = f"; {unchecked} row(s) of backends that move no data not checked" if unchecked else ""
    message = f"#wrong 0 in {len(checked)} checked row(s){note}"
    return [Element("data", "#wrong", "PASS", message, 0, 0)]


def _harness_elements(frame: pd.DataFrame) -> list[Element]:
    records = frame.to_dict("records")
    if not records:
        return [Element("harness", "timings", "SKIP", "no result row to check")]
    for row in records:
        low, mid, high = (_value(row, f"time_us_{k}") for k in ("min", "p50", "p99"))
        ordered = all(math.isnan(v) for v in (low, high)) or (
            (math.isnan(low) or low <= mid * (1 + 1e-9)) and (math.isnan(high) or mid <= high * (1 + 1e-9))
        )
        if not (math.isfinite(mid) and mid > 0) or not ordered:
            message = (
                f"{_case(row)}: times min {_num(low)} / p50 {_num(mid)} / p99 {_num(high)} us are not "
                "finite, positive and ordered"
            )
            remedy = "a commbench bug: report it with the report folder"
            return [Element("harness", "timings", "FAIL", message, mid, None, "us", remedy)]
    message = f"{len(records)} row(s) timed: every time finite, positive, min <= p50 <= p99"
    return [Element("harness", "timings", "PASS", message)]


def _run_element(run: RunStatus, rows: int) -> Element:
    limit = "0 timeouts, 0 dead ranks"
    if run.state == "complete":
        return Element("run", "completion", "PASS", f"the run finished ({rows} result row(s))", rows, limit)
    if run.state in FAULT_STATES:
        what = "a collective timed out" if run.state == "timed_out" else "a rank died"
        message = f"{what}: {run.reason}" if run.reason else what
        return Element("run", "completion", "FAIL", message, rows, limit, "", _HANG_REMEDY)
    if run.state == "wrong_data":
        return Element(
            "run", "completion", "SKIP", "the run stopped after wrong data (see data)", rows, limit
        )
    what = {"interrupted": "stopped", "could_not_run": "could not run"}.get(run.state, "incomplete")
    message = f"not judged: {what}" + (f" ({run.reason})" if run.reason else "") + f" after {rows} row(s)"
    return Element("run", "completion", "SKIP", message, rows, limit)


def _spread_elements(
    outcomes: Sequence[SpreadOutcome], limits: Limits, rank_names: Mapping[int, str], cpu_run: bool
) -> list[Element]:
    rule = limits.spread
    out = []
    for outcome in outcomes:
        spread = outcome.spread
        name = f"{spread.case} {spread.metric}"
        limit = (
            f"> {rule.k_mads:g} scaled MADs and > {rule.min_excess_pct:g}% and > {rule.min_excess_us:g} us"
        )
        if spread.skipped:
            out.append(Element("spread", name, "SKIP", f"{name}: {spread.skipped}", spread.ranks, limit))
            continue
        if not outcome.confirmed:
            message = (
                f"{name}: no rank {limit} above the median ({_num(spread.median)} {spread.unit} over "
                f"{spread.ranks} ranks)"
            )
            out.append(Element("spread", name, "PASS", message, spread.ranks, limit, spread.unit))
            continue
        for item in outcome.confirmed:
            flag = item.flag
            pct = "median 0" if math.isinf(flag.excess_pct) else f"+{flag.excess_pct:.0f}%"
            mads = "MAD 0" if math.isinf(flag.mads) else f"{flag.mads:.1f} MADs"
            who = f"rank {flag.rank}" + (f" ({rank_names[flag.rank]})" if rank_names.get(flag.rank) else "")
            message = (
                f"{who} {spread.metric} {_num(flag.value)} {spread.unit} "
                f"vs median {_num(flag.median)} {spread.unit} ({pct}, {mads}) in {spread.case}; {item.note}"
            )
            remedy = _CPU_RANK_REMEDY if cpu_run else _SLOW_RANK_REMEDY
            out.append(
                Element(
                    "spread", f"{name} rank {flag.rank}", item.status, message, round(flag.value, 3), limit,
                    spread.unit, remedy,
                )
            )  # fmt: skip
    return _unique(out)


def build_verdict(
    frame: pd.DataFrame,
    limits: Limits,
    spec: SystemSpec | None,
    spec_how: str = "",
    run: RunStatus | None = None,
    spreads: Sequence[SpreadOutcome] = (),
    rank_names: Mapping[int, str] | None = None,
    extra: Sequence[Element] = (),
) -> Verdict:
    """The verdict of a run (module docstring). ``frame``: results_frame rows of what finished; ``spec``:
    None for a CPU run; ``spreads``: one outcome per judged case (outliers.confirm); ``rank_names``: rank ->
    "host h2, GPU 1" for messages; ``extra``: elements of other checks (e.g. a baseline group)."""
    run = run or RunStatus()
    if run.state not in RUN_STATES:
        raise ValueError(f"unknown run state {run.state!r}; one of {', '.join(RUN_STATES)}")
    cpu_run = spec is None or limits.cpu_run
    elements = [
        _run_element(run, len(frame)),
        *_data_elements(frame, run),
        *_harness_elements(frame),
        *_row_elements(frame, limits, spec),
        *_spread_elements(spreads, limits, rank_names or {}, cpu_run),
        *extra,
    ]
    return _verdict(elements, run, spec, spec_how, limits)


def _verdict(
    elements: Sequence[Element], run: RunStatus, spec: SystemSpec | None, spec_how: str, limits: Limits
) -> Verdict:
    found = {s: [e for e in elements if e.status == s] for s in STATUSES}
    first = found["FAIL"] or ([] if run.state != "complete" else found["WARN"])
    if first:  # a FAIL; or, in a run that finished, a WARN
        status = first[0].status
        more = f" (+{len(first) - 1} more {status})" if len(first) > 1 else ""
        reason = first[0].message + more
    elif run.state != "complete":
        status, reason = (
            "INCOMPLETE",
            f"{run.state.replace('_', ' ')}: {run.reason or 'the run did not finish'}",
        )
    else:
        judged = len(elements) - len(found["SKIP"])
        cpu = f"; {CPU_SKIP}, bandwidth not judged" if spec is None or limits.cpu_run else ""
        status, reason = "PASS", f"all {judged} judged checks passed{cpu}"
    return Verdict(
        status=status,
        exit_code=_exit_code(elements, run),
        reason=reason,
        elements=tuple(elements),
        run=run,
        spec_name=spec.name if spec is not None else None,
        spec_how=spec_how,
        spec_GBps=float(spec.nvlink_GBps_per_direction) if spec is not None else None,
        limits=limits.to_dict(),
    )


def _exit_code(elements: Sequence[Element], run: RunStatus) -> int:
    if run.state in FAULT_STATES:
        return 4
    if run.state == "wrong_data" or any(e.group == "data" and e.status == "FAIL" for e in elements):
        return 3
    if run.state == "interrupted":
        return 128 + int(run.signum or 2)
    if run.state in ("could_not_run", "incomplete"):
        return 2
    return 1 if any(e.status == "FAIL" for e in elements) else 0


def console_line(verdict: Verdict, report_dir: str | None = None) -> str:
    """The one line the console prints last: "commbench verdict: FAIL (2 FAIL, 1 WARN, 12 PASS, 6 SKIP) -
    <reason>; report: DIR"."""
    counts = verdict.counts()
    tally = ", ".join(f"{counts[s]} {s}" for s in ("FAIL", "WARN", "PASS", "SKIP"))
    where = f"; report: {report_dir}" if report_dir else ""
    return f"commbench verdict: {verdict.status} ({tally}) - {verdict.reason}{where}"


def verdict_dict(verdict: Verdict) -> dict[str, Any]:
    """verdict.json's content (schema ``commbench.verdict/1``), JSON-safe."""
    return plain(
        {
            "schema": SCHEMA,
            "status": verdict.status,
            "exit_code": verdict.exit_code,
            "reason": verdict.reason,
            "counts": verdict.counts(),
            "run": asdict(verdict.run),
            "spec": {
                "name": verdict.spec_name,
                "how_chosen": verdict.spec_how,
                "nvlink_GBps_per_direction": verdict.spec_GBps,
            },
            "limits": dict(verdict.limits),
            "elements": [asdict(element) for element in verdict.elements],
        }
    )


def verdict_from_dict(data: Mapping[str, Any], where: str = VERDICT_FILE) -> Verdict:
    """A Verdict from verdict.json's content; UsageError (one line naming ``where``) for another schema or
    a damaged file."""
    if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
        raise UsageError(f"{where}: schema {found!r} is not {SCHEMA}; re-render the report with this version")
    try:
        spec = data["spec"]
        elements = tuple(Element(**element) for element in data["elements"])
        run = RunStatus(**data["run"])
        verdict = Verdict(
            status=str(data["status"]),
            exit_code=int(data["exit_code"]),
            reason=str(data["reason"]),
            elements=elements,
            run=run,
            spec_name=spec["name"],
            spec_how=spec["how_chosen"],
            spec_GBps=spec["nvlink_GBps_per_direction"],
            limits=dict(data["limits"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(
            f"{where}: damaged verdict ({type(exc).__name__}); render the report again"
        ) from None
    if verdict.status not in OVERALL or any(e.status not in STATUSES for e in elements):
        raise UsageError(f"{where}: unknown status; expected {', '.join(OVERALL)} and {', '.join(STATUSES)}")
    return verdict


def write_verdict_json(out_dir: str | Path, verdict: Verdict) -> Path:
    """verdict.json in ``out_dir``, written atomically; its path."""
    path = Path(out_dir) / VERDICT_FILE
    write_atomic(path, json.dumps(verdict_dict(verdict), indent=2, allow_nan=False) + "\n")
    return path


def read_verdict_json(path: str | Path) -> Verdict:
    """A verdict.json read back, bounded like every file a user may hand over (UsageError when it is not
    one)."""
    hint = "a verdict that cannot be read as JSON is damaged: run the benchmark again"
    data, where = load_json(path, "verdict file", MAX_VERDICT_BYTES, hint)
    return verdict_from_dict(data, where)
