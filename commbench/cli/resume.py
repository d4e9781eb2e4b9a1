"""``--resume DIR``: continue an interrupted run in its own report folder, skipping the cases it finished.

The folder must be one a run left INCOMPLETE (meta.json ``status: "incomplete"``), written by the same
command with the same config (meta.json's ``config`` compared with this command's, field by field, but for
the options that do not change what a case measures; the first difference is a one-line error). A
balanced size, or an MoE case (both its phases, written together), is
finished when its row is in results.csv; everything else runs again, appended to the same files. The run
that resumes takes the folder over (a new claim marker), so that two resumes of one folder cannot both run.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commbench.errors import UsageError
from commbench.run.config import RunConfig
from commbench.run.config_meta import config_leaves, config_to_meta

if TYPE_CHECKING:
    import pandas as pd

    from commbench.run.jobs import Job


def check_same_run(folder: str, saved: dict[str, Any], config: RunConfig, free: frozenset[str]) -> None:
    """UsageError unless ``saved`` (the folder's meta.json) is an INCOMPLETE run of the same command with the
    same config (every option but those in ``free``, which do not change what a case measures)."""
    if saved.get("status") != "incomplete":
        raise UsageError(
            f"--resume {folder}: that run finished (meta.json has no INCOMPLETE status); nothing to resume, "
            "start a new run with --out"
        )
    if saved.get("subcommand") != config.command:
        raise UsageError(
            f"--resume {folder}: it was written by 'commbench {saved.get('subcommand')}', not 'commbench "
            f"{config.command}'; resume it with the same command"
        )
    if not isinstance(saved.get("config"), dict):
        version = saved.get("commbench_version", "an earlier version")
        raise UsageError(
            f"--resume {folder}: written by commbench {version}, whose meta.json has no config to compare "
            "with; run it again with --out"
        )
    old, new = config_leaves(saved), config_leaves({"config": config_to_meta(config)})
    for key in sorted(set(old) | set(new)):
        if key not in free and key not in old:  # an option added since: the runs' cases may differ
            raise UsageError(
                f"--resume {folder}: the interrupted run was written before the option {key!r} existed; run "
                "it again with --out"
            )
        if key not in free and old.get(key) != new.get(key):
            raise UsageError(
                f"--resume {folder}: the interrupted run had {key}={old.get(key)!r}, this command gives "
                f"{new.get(key)!r}; give the same options as the interrupted run"
            )


def _knobs_match(job: Job, knobs: Any) -> bool:
    from commbench.plain import parse_knobs

    setting = parse_knobs(knobs)
    replicas = job.routing.replicas if job.kind == "moe" else 0  # --replicas: with and without are 2 cases
    if setting.get("replicas", "0") != str(replicas):
        return False
    return all(setting.get(key) == str(value) for key, value in (job.backend_options or {}).items())


def _same_case(job: Job, row: dict[str, Any]) -> bool:
    """Whether a result row was measured by ``job``: its ``Case`` has the job's pattern, repeat and knob
    setting, and for an MoE job its skew, tokens per rank, send mode and model (digest, where the row has
    one)."""
    from commbench.run.case import Case, model_digest

    case = Case.from_row(row)
    if case.pattern != job.name or case.repeat != job.repeat or not _knobs_match(job, case.knobs):
        return False
    if job.kind != "moe":
        return True
    routing = job.routing
    return (
        case.skew == routing.skew.text
        and case.tokens_per_rank in (None, routing.tokens_per_rank)
        and case.send_mode in (None, job.send_mode)
        and case.model_digest in (None, model_digest(routing.model))
    )


def remaining_jobs(jobs: list[Job], results: pd.DataFrame) -> tuple[list[Job], int]:
    """(the jobs left to run, the result rows already finished): balanced jobs cut to their unfinished
    sizes, MoE jobs whose phases are all in ``results`` dropped."""
    rows = results.to_dict("records") if not results.empty else []
    left = []
    for job in jobs:
        mine = [row for row in rows if _same_case(job, row)]
        if job.kind == "balanced":
            done = {int(row["size_bytes"]) for row in mine if row.get("phase") == "alltoall"}
            sizes = [size for size in job.sizes if int(size) not in done]
            if sizes:
                left.append(replace(job, sizes=sizes))
            continue
        skew = job.routing.skew.text
        phases = {row.get("phase") for row in mine if str(row.get("skew")) == skew}
        if not set(job.phases) <= phases:
            left.append(job)
    return left, len(rows)


def resumed_meta(saved: dict[str, Any], finished_rows: int) -> dict[str, Any]:
    """The folder's meta.json for the run that continues it: no INCOMPLETE status (the verdict says how this
    one ends), and a ``resumed`` entry per resume."""
    meta = {key: value for key, value in saved.items() if key not in ("status", "incomplete_reason")}
    history = list(meta.get("resumed") or [])
    history.append(
        {
            "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "rows_kept": finished_rows,
            "previous_reason": saved.get("incomplete_reason"),
        }
    )
    meta["resumed"] = history
    return meta


def read_interrupted(folder: str) -> tuple[dict[str, Any], pd.DataFrame]:
    """(meta, result rows) of the folder to resume, every file checked (UsageError naming a bad one)."""
    from commbench.report import read_report

    if not Path(folder).is_dir():
        raise UsageError(f"--resume {folder}: no such report folder")
    meta, results, _ = read_report(folder)
    return meta, results
