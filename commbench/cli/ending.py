"""How a launch that did not finish ends, the same for every command (``run``, ``profile``, ``suite``, the
pairwise test) and every stop (SIGINT, SIGTERM, SIGHUP, a killed launcher), wherever it ends: in the
launcher, in rank 0 under torchrun, or in a spawned rank 0 whose launcher is gone.

The folder: what finished is kept and rendered INCOMPLETE with the reason (verdict.json, junit.xml,
summary.md, report.html: ``report.folder.writer.mark_incomplete``); a stop before any case finished leaves
no folder. The console: the stop (or error) line on stderr, then the verdict line last on stdout; the exit
code is the error's (128 + N for signal N).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from commbench.errors import StoppedError, VerificationError, error_line, first_line

if TYPE_CHECKING:
    from commbench.cli.acceptance import Acceptance
    from commbench.report import OutDirClaim

NOTHING_KEPT = "nothing finished: no report folder is left"


def incomplete_reason(exc: BaseException) -> str | None:
    """Why a run that ended with ``exc`` left an incomplete report (one line), or None when the report is
    as complete as the run meant it to be (wrong data: the failing job's rows say so, and the run stops)."""
    if isinstance(exc, VerificationError):
        return None
    if isinstance(exc, StoppedError):  # "stopped by SIGTERM", "the launcher (pid 12) is gone"
        return exc.reason
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by SIGINT"
    return first_line(exc) or type(exc).__name__


def is_stop(exc: BaseException) -> bool:
    """The run was told to stop (a signal, Ctrl-C, its launcher gone), rather than failed."""
    return isinstance(exc, (StoppedError, KeyboardInterrupt))


def discard_claim(claim: OutDirClaim | None, exc: BaseException, resume: bool) -> OutDirClaim | None:
    """The claim whose folder a stop that finished nothing may remove: a stop's, of a folder this run
    claimed new (never a resumed one, nor after a failure, whose verdict says why)."""
    return claim if is_stop(exc) and not resume else None


def judge_for(acceptance: Acceptance | None, error: BaseException | None) -> Any:
    """The report's judge for a run that ended with ``error`` (None: it finished), or None."""
    if acceptance is None:
        return None
    from commbench.cli.acceptance import make_judge
    from commbench.report.judge.verdict import run_status_from_error

    return make_judge(acceptance, run_status_from_error(error))


def finish_partial_report(
    out_dir: str,
    claim: OutDirClaim | None,
    exc: BaseException,
    acceptance: Acceptance | None = None,
    resume: bool = False,
) -> str | None:
    """After a failed or stopped launch, in the launcher (or rank 0 under torchrun): release a report folder
    nothing was written to, else make sure it says INCOMPLETE (here if rank 0 was killed before it could say
    so, or knew less). Returns what the stop line says of the folder (where what finished is, or
    ``NOTHING_KEPT``), or None."""
    from commbench.report import ReportWriteError, mark_incomplete, render_folder

    nothing = NOTHING_KEPT if is_stop(exc) else None
    if claim is not None and claim.release_if_unused():
        return nothing
    meta_path = Path(out_dir) / "meta.json"
    if not meta_path.is_file():  # never written, or removed by rank 0: a stop that finished nothing
        return nothing
    reason = incomplete_reason(exc)
    if reason is None:  # wrong data: the rows say so; the verdict must be there even if rank 0 was cut short
        if not (Path(out_dir) / "verdict.json").is_file():
            try:
                render_folder(out_dir, judge=judge_for(acceptance, exc))
            except Exception as error:  # noqa: BLE001 - never mask the error that ended the run
                click.echo(f"commbench: could not write the verdict of the run: {error}", err=True)
        return None
    try:
        meta = json.loads(meta_path.read_text())
        # Rank 0 did not get to it, or knew less (it was stopped because another rank failed).
        saved = str(meta.get("incomplete_reason", ""))[:200]  # the report clips a long reason
        if meta.get("status") != "incomplete" or saved != " ".join(reason.split())[:200]:
            discard = discard_claim(claim, exc, resume)
            if mark_incomplete(out_dir, reason, judge_for(acceptance, exc), discard) is None:
                return nothing
    except ReportWriteError:  # the full disk that ended the run: its one error line says so already
        return None
    except Exception as error:  # noqa: BLE001 - never mask the error that ended the run
        click.echo(f"commbench: could not mark the partial report incomplete: {error}", err=True)
        return None
    return kept_line(out_dir)


def kept_line(out_dir: str) -> str:
    return f"what finished is in {out_dir} (marked INCOMPLETE)"


def stopped_error(exc: BaseException, kept: str | None) -> BaseException:
    """The error a stop ends the command with, its line saying what was kept: "stopped by SIGINT; all 4 ranks
    were stopped; what finished is in DIR (marked INCOMPLETE)"."""
    if not kept or not is_stop(exc):
        return exc
    signum = exc.signum if isinstance(exc, StoppedError) else 2
    return StoppedError(signum, f"{first_line(exc) or incomplete_reason(exc)}; {kept}")


def verdict_last(out_dir: str, error: BaseException | None) -> int | None:
    """The console's last lines: after an error its line (stderr), then the verdict with the report path
    (stdout). Returns the exit code (the verdict's, or the error's), or None when an error has no verdict
    (nothing was judged: its line is left to the command's error handling)."""
    from commbench.errors import CommbenchError
    from commbench.report import saved_verdict
    from commbench.report.judge.verdict import console_line

    try:
        verdict = saved_verdict(out_dir) if Path(out_dir).is_dir() else None
    except CommbenchError:
        verdict = None
    if error is None:
        if verdict is None:
            click.echo(f"commbench: report written to {out_dir}")
            return 0
        click.echo(console_line(verdict, out_dir))
        return verdict.exit_code
    if verdict is None:
        return None
    code, message = error_line(error)
    click.echo(message, err=True)
    click.echo(console_line(verdict, out_dir))
    return code


def orphan_last_lines(out_dir: str, error: BaseException, kept: str | None) -> None:
    """A spawned rank 0 whose launcher is gone (killed) says what the launcher would have: the stop line and
    the verdict line, on the same console (the launcher's stdout and stderr, inherited)."""
    if isinstance(error, StoppedError):  # "the launcher (pid 12) is gone", without "rank 0: "
        error = StoppedError(error.signum, error.reason)
    error = stopped_error(error, kept)
    try:
        if verdict_last(out_dir, error) is None:
            click.echo(error_line(error)[1], err=True)
    except OSError:  # the terminal is gone too (SIGHUP)
        pass
