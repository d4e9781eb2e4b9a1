"""The files of a report folder: the folder claimed, CSVs appended as phases finish, and ``render_folder``,
the one path that renders its pages from the files.

A report folder holds ``meta.json`` (arguments, environment, spec), ``results.csv`` and ``ranks.csv``
(appended after every phase, so a crash loses nothing finished), the profiler's and the pairwise test's
tables beside them and, once rendered, ``results.parquet``, ``results.json`` (nccl-tests-like),
``summary.md`` and ``report.html`` (+ ``verdict.json`` and ``junit.xml`` when judged). ``render_folder``
reads every file back checked (``report.folder.reading.read_folder``) and renders the pages from what it
read, whoever calls it: ``ReportWriter.finalize`` at the end of a run, ``commbench report DIR``, and the
launcher for a run whose rank 0 is gone. In memory a row's knobs are a dict; in every file they are one
"k=v k=v" text cell (``plain.knobs_text``).

Every file is written atomically and CSV rows are appended whole (``report.folder.claim``); a write that
fails (full disk, file-size limit) is a one-line ``ReportWriteError`` (exit 2) and leaves only whole files.
Every file is checked and every page built in memory before the first is written, so a folder that is
refused is left exactly as it was; results.csv, ranks.csv and meta.json are never written by a render
(meta.json only gets ``status: "incomplete"`` and ``incomplete_reason`` when a stopped run is finished:
``render_folder(DIR, incomplete=REASON)``), and summary.md, report.html and results.json then say INCOMPLETE
at the top.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from commbench.errors import UsageError
from commbench.inputs.specs import NO_SPEC_NAME, SystemSpec, load_spec, no_spec, spec_from_dict
from commbench.inputs.userfiles import clip
from commbench.plain import is_missing, knobs_text, plain
from commbench.report.folder.claim import (
    CsvAppender,
    OutDirClaim,
    ReportWriteError,
    check_claim,
    claim_out_dir,
    csv_text,
    write_atomic,
)
from commbench.report.folder.reading import (
    EXTRA_APPENDED,
    EXTRA_WHOLE,
    RESULT_COLUMNS,
    ExtraTables,
    incomplete_reason,
    read_folder,
    read_rows,
    read_saved_verdict,
)
from commbench.report.folder.stopped import discard_unfinished
from commbench.report.frame import (
    CONVENTIONS,
    balanced_rows,
    rank_frame,
    results_frame,
)
from commbench.report.interop.nccl_tests_json import (
    config_field,
    footer_fields,
    header_fields,
    result_fields,
)
from commbench.report.judge.junit import write_junit
from commbench.report.judge.verdict import Verdict, write_verdict_json
from commbench.report.pages.sections import report_html, summary_markdown
from commbench.run.config_meta import meta_values

# Judges a finished (or stopped) run: (results frame, rank frame, meta) -> its Verdict (cli.acceptance).
Judge = Callable[[pd.DataFrame, pd.DataFrame, dict[str, Any]], Verdict]

INCOMPLETE_REASON_CHARS = 300  # a reason is one line (e.g. "stopped by SIGTERM after 3 of 8 cases")
# What ``commbench report`` says of a launch's folder that has neither a verdict nor an INCOMPLETE mark: no
# process of the run got to finish it (all killed at once), unless the run is still going.
UNFINISHED_REASON = (
    "the run ended without finishing its report (its processes were killed: SIGKILL, the out-of-memory "
    "killer, a lost node), or it is still running"
)


def spec_figures(spec: SystemSpec) -> dict[str, Any]:
    """The figures the report compares with, as meta.json's and results.json's ``spec``."""
    return {
        "name": str(spec.name),
        "per_gpu_GBps_per_direction": float(spec.nvlink_GBps_per_direction),
        "gpus_per_domain": int(spec.gpus_per_domain),
        "aggregate_GBps_bidirectional": float(spec.domain_aggregate_GBps_bidirectional),
        "nic_GBps_per_direction": float(spec.nic_GBps_per_direction),
    }


def spec_meta(spec: SystemSpec) -> dict[str, Any]:
    """meta.json's ``spec`` (the compared figures) and ``system_spec`` (the whole spec, its one-line text)."""
    return {
        "spec": spec_figures(spec),
        "system_spec": {**asdict(spec), "description_line": spec.describe()},
    }


def spec_from_meta(meta: Mapping[str, Any], where: str = "meta.json") -> SystemSpec:
    """The spec a report folder was written against: meta.json's ``system_spec``, else its ``spec`` figures
    (folders of older versions), else the catalogue's default spec."""
    saved = meta.get("system_spec")
    if isinstance(saved, Mapping) and saved.get("name") == NO_SPEC_NAME:  # a run with no spec (CPU)
        return no_spec(str(saved.get("description") or ""))
    if isinstance(saved, Mapping):
        return spec_from_dict(saved, where)
    figures = meta.get("spec")
    if isinstance(figures, Mapping):
        nic = figures.get("nic_GBps_per_direction")
        saved = {
            "name": figures.get("name"),
            "gpus_per_domain": figures.get("gpus_per_domain"),
            "nvlink_GBps_per_direction": figures.get("per_gpu_GBps_per_direction"),
            "nic_Gbps_per_direction": 8 * nic if isinstance(nic, (int, float)) else nic,
            "aggregate_GBps_bidirectional": figures.get("aggregate_GBps_bidirectional"),
        }
        return spec_from_dict(saved, where)
    return load_spec()


def file_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` as the files hold it: ``knobs`` as text (a results frame has it so already; rows built by
    hand may still hold dicts)."""
    if "knobs" not in frame.columns:
        return frame
    return frame.assign(knobs=[knobs_text(knobs) for knobs in frame["knobs"]])


def file_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``frame`` for a CSV or JSON file: knobs as text, plain Python values, None for NaN."""
    return [plain(record) for record in file_frame(frame).to_dict("records")]


class ReportWriter:
    """Writes one report folder: CSVs appended as phases finish, the pages rendered from them in ``finalize``.

    ``meta`` is saved as meta.json at once (typically {"config": ..., "plan": ..., "env": ...}) with the
    spec's ``spec`` and ``system_spec`` entries; ``spec`` None takes the spec ``meta`` names
    (``spec_from_meta``). ``claim`` is the token of a claim made before launching (``claim_out_dir`` in the
    launcher); None claims the folder now; ``resume``: the interrupted run's rows stay and new ones are
    appended after them. After a failed write (ReportWriteError, raised once) the writer writes nothing
    more: the folder keeps the whole files it had.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        meta: dict[str, Any],
        spec: SystemSpec | None = None,
        claim: str | None = None,
        resume: bool = False,
    ) -> None:
        self.spec = spec if spec is not None else spec_from_meta(meta)
        own_claim: OutDirClaim | None = None
        if resume and claim is None:
            raise ValueError("resume needs the claim of the run taking the folder over")
        if claim is None:
            own_claim = claim_out_dir(out_dir)
            self.out_dir = own_claim.path
        else:
            self.out_dir = check_claim(out_dir, claim)
        self.meta = {**meta, **spec_meta(self.spec)}
        self._failed: ReportWriteError | None = None
        try:
            self._write(self.out_dir / "meta.json", json.dumps(plain(self.meta), indent=2) + "\n")
        except ReportWriteError:
            if own_claim is not None:
                own_claim.release_if_unused()
            raise
        self._results = CsvAppender(self.out_dir / "results.csv")
        self._ranks = CsvAppender(self.out_dir / "ranks.csv")
        self._appenders: dict[str, CsvAppender] = {}
        if resume:  # --resume: the interrupted run's rows stay, new ones are appended after them
            self._results.continue_file()
            self._ranks.continue_file()

    def _guarded(self, write: Any, *args: Any) -> Any:
        """Run one write; the first failure is remembered, and every later write refused with it."""
        if self._failed is not None:
            raise self._failed
        try:
            return write(*args)
        except ReportWriteError as exc:
            self._failed = exc
            raise

    def _write(self, path: Path, data: bytes | str) -> None:
        self._guarded(write_atomic, path, data)

    def add(self, rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]] | None = None) -> pd.DataFrame:
        """Append finished rows to results.csv (with their bandwidth columns) and ranks.csv (with the
        per-rank GB/s), whole rows only; returns the rows' ``results_frame`` (the progress line reads its
        figures from it: one frame per row, not two)."""
        frame = results_frame(rows, self.spec)
        if rows:
            self._guarded(self._results.append, file_records(frame))
        if rank_rows:
            self._guarded(self._ranks.append, file_records(rank_frame(rank_rows)))
        return frame

    def append_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Append whole rows to one of the profiler's long tables (``EXTRA_APPENDED``: profile.csv,
        arrivals.csv, peers.csv) as phases finish; the pages show them."""
        if not rows:
            return
        if name not in EXTRA_APPENDED:
            raise ValueError(f"{name} is not one of the appended tables ({', '.join(EXTRA_APPENDED)})")
        appender = self._appenders.get(name)
        if appender is None:
            appender = self._appenders[name] = CsvAppender(self.out_dir / name)
        self._guarded(appender.append, file_records(pd.DataFrame(rows)))

    def write_file(self, name: str, text: str) -> None:
        """One more whole file in the folder (trace.json), written atomically."""
        self._write(self.out_dir / name, text)

    def set_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Write one of the tables beside results.csv whole (``EXTRA_WHOLE``: pairs.csv, the pairwise link
        test; health.csv, GPU health), replacing an earlier one; the pages show it."""
        if name not in EXTRA_WHOLE:
            raise ValueError(f"{name} is not one of the whole tables ({', '.join(EXTRA_WHOLE)})")
        frame = pd.DataFrame(rows)
        self._write(self.out_dir / name, csv_text(file_records(frame), list(frame.columns), header=True))

    def finalize(
        self, incomplete: str | None = None, judge: Judge | None = None, discard: OutDirClaim | None = None
    ) -> pd.DataFrame | None:
        """Render the folder (``render_folder``: results.parquet, results.json, the verdict of ``judge``,
        summary.md and report.html from the files written); return the results frame (``attrs["verdict"]``:
        the verdict, ``attrs["meta"]``: meta.json).

        ``incomplete``: the run was stopped (a signal, a failure) and this is why, in one line: meta.json gets
        ``status: "incomplete"`` and ``incomplete_reason``, and the pages say INCOMPLETE at the top
        (``mark_incomplete``; with ``discard``, a stop that finished nothing leaves no folder: None). After
        a failed write nothing is written (the rows on disk are still returned)."""
        if self._failed is not None:
            frame = results_frame(_rows_on_disk(self.out_dir), self.spec)
            frame.attrs["meta"] = self.meta  # the stdout table's header reads it (report.console)
            return frame
        if incomplete is None:
            frame = self._guarded(lambda: render_folder(self.out_dir, judge=judge))
        else:
            frame = self._guarded(lambda: mark_incomplete(self.out_dir, incomplete, judge, discard))
        if frame is not None:
            self.meta = frame.attrs["meta"]
        return frame


def _rows_on_disk(out_dir: Path) -> pd.DataFrame:
    """The whole rows results.csv holds (none when it is missing or cannot be read)."""
    try:
        return read_rows(out_dir / "results.csv", RESULT_COLUMNS)
    except (UsageError, OSError):
        return pd.DataFrame()


def render_folder(
    out_dir: str | os.PathLike[str],
    *,
    judge: Judge | None = None,
    incomplete: str | None = None,
    unfinished_judge: Callable[[dict[str, Any]], Judge | None] | None = None,
) -> pd.DataFrame:
    """Render a report folder from its files: results.parquet, results.json, summary.md and report.html
    (+ verdict.json and junit.xml from ``judge``'s verdict; without a judge the folder's own verdict.json is
    shown again, never rewritten; a stopped run finished without a judge shows none). The one rendering
    path: the end of a run, ``commbench report DIR`` and a stopped run.

    ``incomplete``: the run was stopped and this is why (one line): meta.json gets ``status: "incomplete"``
    and ``incomplete_reason`` (the only write to meta.json), and the pages say INCOMPLETE at the top; a
    stopped run may have no results.csv yet. Every file is checked (``read_folder``) and every page built in
    memory before the first is written, so a folder that is refused (UsageError naming the file) is left
    exactly as it was. Returns the results frame: ``attrs["meta"]`` (meta.json as rendered),
    ``attrs["verdict"]`` and ``attrs["incomplete"]`` (the reason of a stopped run, else None).

    ``unfinished_judge`` (a re-render: ``commbench report``): a launch's folder that has neither a verdict
    nor an INCOMPLETE mark was left by a run no process of which could finish it (killed whole): it is shown
    INCOMPLETE (``UNFINISHED_REASON``; meta.json is not rewritten) and judged by ``unfinished_judge(meta)``,
    whose verdict.json and junit.xml are written (the folder had none)."""
    path = Path(out_dir)
    folder = read_folder(path, stopped=incomplete is not None)
    meta = folder.meta
    if incomplete is not None:
        meta = {**meta, "status": "incomplete", "incomplete_reason": _one_line_reason(incomplete)}
    elif unfinished_judge is not None and folder.verdict is None and _ended_unfinished(meta):
        meta = {**meta, "status": "incomplete", "incomplete_reason": UNFINISHED_REASON}
        judge = judge or unfinished_judge(meta)
    spec = spec_from_meta(meta, str(path / "meta.json"))
    frame = results_frame(folder.results, spec)
    frame.attrs["meta"] = meta  # the stdout table's header reads it (report.console)
    ranks = rank_frame(folder.ranks)
    if judge is not None:
        verdict: Verdict | None = judge(frame, ranks, meta)
    else:  # a re-render shows the folder's own verdict; a stopped run finished unjudged has none
        verdict = folder.verdict if incomplete is None else None
    pages = report_pages(frame, ranks, meta, spec, verdict, folder.extras, new_verdict=judge is not None)
    if incomplete is not None:
        write_atomic(path / "meta.json", json.dumps(plain(meta), indent=2) + "\n")
    write_pages(path, pages)
    frame.attrs["incomplete"] = incomplete_reason(meta)
    frame.attrs["verdict"] = verdict  # after rendering: parquet stores attrs as JSON
    return frame


def render_report(
    out_dir: str | os.PathLike[str], unfinished_judge: Callable[[dict[str, Any]], Judge | None] | None = None
) -> pd.DataFrame:
    """``commbench report DIR``: ``render_folder(DIR)`` (the folder's own verdict shown again; a run killed
    whole judged by ``unfinished_judge``)."""
    return render_folder(out_dir, unfinished_judge=unfinished_judge)


def _ended_unfinished(meta: Mapping[str, Any]) -> bool:
    """meta.json of a launch (it records what the verdict judges by) that was never finished: no INCOMPLETE
    mark (the folder has no verdict either: the caller checks)."""
    return isinstance(meta.get("acceptance"), Mapping) and meta.get("status") != "incomplete"


def mark_incomplete(
    out_dir: str | os.PathLike[str],
    reason: str,
    judge: Judge | None = None,
    discard: OutDirClaim | None = None,
) -> pd.DataFrame | None:
    """The one end of a stopped (or failed) run's folder, whoever finishes it (rank 0's ``finalize``, or the
    launcher when rank 0 was killed first): ``render_folder(DIR, judge=judge, incomplete=reason)``; or, with
    ``discard`` (the claim of a stopped run's own new folder) and nothing finished, no folder at all
    (``discard_unfinished``). None when nothing was rendered (discarded, or rank 0 never wrote meta.json)."""
    if discard is not None and discard_unfinished(discard):
        return None
    if not (Path(out_dir) / "meta.json").exists():
        return None
    return render_folder(out_dir, judge=judge, incomplete=reason)


def _one_line_reason(reason: str) -> str:
    return clip(" ".join(str(reason).split()), INCOMPLETE_REASON_CHARS) or "stopped"


@dataclass(frozen=True)
class ReportPages:
    """The rendered files of a report folder, each as its bytes or text."""

    parquet: bytes
    results_json: str
    summary_md: str
    report_html: str
    verdict: Verdict | None = None
    new_verdict: bool = True  # False: the folder's own verdict.json, shown again (never rewritten)


def report_pages(
    frame: pd.DataFrame,
    ranks: pd.DataFrame,
    meta: dict[str, Any],
    spec: SystemSpec,
    verdict: Verdict | None = None,
    extras: ExtraTables | None = None,
    new_verdict: bool = True,
) -> ReportPages:
    """results.parquet, results.json, summary.md and report.html of a run, rendered in memory; the pages
    open with ``verdict`` (None: "no verdict", INCOMPLETE)."""
    buffer = io.BytesIO()
    table = _parquet_safe(file_frame(frame))
    table.attrs = {}  # pandas stores attrs in the file: the frame's attrs (meta, verdict) are not data
    table.to_parquet(buffer, index=False)
    return ReportPages(
        parquet=buffer.getvalue(),
        results_json=json.dumps(results_json(frame, meta, spec), indent=2) + "\n",
        summary_md=summary_markdown(frame, meta, spec, verdict, extras),
        report_html=report_html(frame, ranks, meta, spec, verdict, extras),
        verdict=verdict,
        new_verdict=new_verdict,
    )


def write_pages(out_dir: Path, pages: ReportPages) -> None:
    """The rendered pages, each written atomically; verdict.json and junit.xml with them when the pages
    carry a new verdict (a re-render keeps the folder's own)."""
    write_atomic(out_dir / "results.parquet", pages.parquet)
    write_atomic(out_dir / "results.json", pages.results_json)
    if pages.verdict is not None and pages.new_verdict:
        write_verdict_json(out_dir, pages.verdict)
        write_junit(out_dir, pages.verdict)
    write_atomic(out_dir / "summary.md", pages.summary_md)
    write_atomic(out_dir / "report.html", pages.report_html)


saved_verdict = read_saved_verdict  # the facade's name


def _parquet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Object columns holding mixed types (e.g. backend knobs) become strings, which parquet can store."""
    out = frame.copy()
    for column in out.columns:
        if out[column].dtype == object:
            kinds = {type(v) for v in out[column] if not is_missing(v)}
            if len(kinds) > 1 or (kinds and not kinds <= {str, bool}):
                out[column] = [None if is_missing(v) else str(v) for v in out[column]]
    return out


def results_json(frame: pd.DataFrame, meta: Mapping[str, Any], spec: SystemSpec) -> dict[str, Any]:
    """nccl-tests' ``-J`` document (``report.interop.nccl_tests_json``: its fields, in its order, with its
    types), then commbench's own fields.

    nccl-tests': version, start_time, args (the command line), env (the communication variables), nccl_version
    (its code), config (the balanced sweep, ``console.sweep_config``; null without one), results, then
    out_of_bounds, average_bus_bandwidth (over the balanced rows alone, in-place runs averaged in) and
    errors. Each result holds nccl-tests' size, count, type, redop, root (balanced rows), out_of_place
    {time, alg_bw, bus_bw, nwrong} with nccl-tests' time (the mean over the timed iterations,
    ``time_us_mean``) and the bandwidths from it, in_place the same for the in-place run (null where it did
    not run), actual_iterations and experiment_name; then commbench's time, alg_bw, bus_bw and wrong (the
    out-of-place figures, flat) and every column of the row. commbench's own: commbench_options (the options
    and plan), commbench_env (meta.json's env), devices (its CUDA devices), spec, units, conventions, and a
    stopped run's status and incomplete_reason.
    """
    env = meta.get("env") or {}
    balanced = balanced_rows(frame)
    results = []
    for row in file_records(frame):
        results.append(
            {
                **result_fields(row),
                "time": row.get("time_us_mean"),
                "alg_bw": row.get("algbw_mean_GBps"),
                "bus_bw": row.get("busbw_mean_GBps"),
                "wrong": row.get("wrong"),
                **row,
            }
        )
    status = _status(meta)
    errors = [status["incomplete_reason"]] if "incomplete_reason" in status else []
    document = {
        **header_fields(meta),
        "config": config_field(balanced, meta),
        "results": results,
        **footer_fields(balanced, errors),
        "commbench_options": meta_values(meta),
        "commbench_env": env,
        "devices": env.get("devices", []),
        "spec": spec_figures(spec),
        "units": {"size": "bytes", "time": "us", "alg_bw": "GB/s (1e9 B/s)", "bus_bw": "GB/s (1e9 B/s)"},
        "conventions": CONVENTIONS,
        **status,
    }
    return plain(document)  # nccl-tests' NaN figures are already the text "nan", which plain() keeps


def _status(meta: Mapping[str, Any]) -> dict[str, Any]:
    """results.json's ``status`` and ``incomplete_reason``, for a stopped run only."""
    reason = incomplete_reason(meta)
    return {} if reason is None else {"status": "incomplete", "incomplete_reason": reason}
