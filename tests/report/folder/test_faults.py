"""Report files survive faults: atomic files, whole CSV rows, a full disk, racing claims, stopped runs."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.errors import UsageError
from commbench.inputs.specs import load_spec
from commbench.report import (
    OutDirTaken,
    ReportWriteError,
    ReportWriter,
    claim_out_dir,
    mark_incomplete,
    render_report,
    write_atomic,
)
from commbench.report.folder.claim import MARKER
from tests.report.folder_checks import assert_folder_readable, assert_whole_csv
from tests.report.rows import all_rank_rows, balanced_row, skewed_rows

HGX = load_spec("hgx-h100")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _full_disk_after(monkeypatch: pytest.MonkeyPatch, allowed: int) -> list[bytes]:
    """os.write writes at most ``allowed`` more bytes in total, then fails as a full disk does."""
    real_write = os.write
    budget = [allowed]
    calls: list[bytes] = []

    def write(fd: int, data: bytes) -> int:
        calls.append(bytes(data))
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done = real_write(fd, bytes(data)[: budget[0]])
        budget[0] -= done
        return done

    monkeypatch.setattr(os, "write", write)
    return calls


# ---------------------------------------------------------------------------------------------------------
# Atomic files and whole rows


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "summary.md"
    write_atomic(target, "old text\n")
    _full_disk_after(monkeypatch, allowed=5)
    with pytest.raises(ReportWriteError) as caught:
        write_atomic(target, "new text that does not fit\n")
    monkeypatch.undo()
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and "summary.md" in message and "No space left" in message
    assert caught.value.exit_code == 2
    assert target.read_text() == "old text\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]


def test_each_append_is_one_write_of_whole_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = ReportWriter(tmp_path / "run", {}, HGX)
    first = [balanced_row(4, 4096, 10.0)]
    writer.add(first, all_rank_rows(first))
    calls = _full_disk_after(monkeypatch, allowed=1 << 30)
    rows = [balanced_row(4, 8192, 12.0), balanced_row(4, 16384, 20.0)]
    writer.add(rows)  # same columns: appended, not rewritten
    monkeypatch.undo()
    assert len(calls) == 1  # one write of both rows
    assert calls[0].endswith(b"\n") and calls[0].count(b"\n") == 2
    assert len(assert_whole_csv(tmp_path / "run" / "results.csv")) == 4  # header + 3 rows


def test_an_append_failing_midway_is_cut_back_to_the_last_whole_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    writer = ReportWriter(out, {}, HGX)
    first = [balanced_row(4, 4096, 10.0), balanced_row(4, 8192, 12.0)]
    writer.add(first, all_rank_rows(first))
    before = (out / "results.csv").read_bytes()
    _full_disk_after(monkeypatch, allowed=100)  # part of the next row fits, then the disk is full
    with pytest.raises(ReportWriteError, match="results.csv"):
        writer.add([balanced_row(4, 16384, 20.0)])
    monkeypatch.undo()
    assert (out / "results.csv").read_bytes() == before  # no cut row
    with pytest.raises(ReportWriteError):  # a writer whose disk failed writes nothing more
        writer.add([balanced_row(4, 32768, 30.0)])
    frame = writer.finalize()  # what a failing launch calls: returns the rows written, writes nothing
    assert frame["size_bytes"].tolist() == [4096, 8192]
    assert assert_folder_readable(out) == {MARKER, "meta.json", "results.csv", "ranks.csv"}


def _limited(limit: int):
    """preexec_fn: a file-size limit of ``limit`` bytes; SIGXFSZ ignored, so a write past it fails (EFBIG)
    as a write to a full disk does (ENOSPC)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _commbench(args: list[str], cwd: Path, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and k != "COMMBENCH_DEBUG"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "commbench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if limit is None else _limited(limit),
    )


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in done.stderr + done.stdout
    return [line for line in done.stderr.splitlines() if line.startswith("commbench: error:")]


BALANCED_RUN = ["run", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "16M", "--backend"]
BALANCED_RUN += ["gloo", "--world-size", "2", "--warmup", "1", "--iters", "2"]
SIZES = [1024 << step for step in range(15)]


@pytest.mark.parametrize(
    ("limit", "fails_in"),
    [
        # meta.json (~5.2 KiB) fits, results.csv (~500 B a row) and ranks.csv run out before 15 phases end
        (6 << 10, "csv"),
        # every CSV fits, report.html (~90 KiB of plots) does not
        (48 << 10, "pages"),
    ],
)
def test_a_full_disk_during_a_run_is_one_line_and_leaves_whole_files(
    tmp_path: Path, limit: int, fails_in: str
) -> None:
    out = tmp_path / "run"
    done = _commbench([*BALANCED_RUN, "--out", str(out)], tmp_path, limit)
    assert done.returncode == 2, done.stderr
    errors = _error_lines(done)
    assert len(errors) == 1 and "cannot write report file" in errors[0], done.stderr
    assert "File too large" in errors[0] and "could not" not in done.stderr  # no second error line
    names = assert_folder_readable(out)
    results = pd.read_csv(out / "results.csv")
    # The rows kept are the phases that finished, in order, each whole.
    assert results["size_bytes"].tolist() == SIZES[: len(results)]
    if fails_in == "csv":
        assert len(results) < len(SIZES), "the limit no longer stops a CSV append: lower it"
        assert not names & {"results.json", "summary.md", "report.html"}
    else:
        assert len(results) == len(SIZES) and "report.html" not in names


def test_a_full_disk_during_report_changes_no_data_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    writer = ReportWriter(out, {"args": {}}, HGX)
    rows = [balanced_row(4, 1024 << step, 10.0 + step) for step in range(6)] + skewed_rows()
    writer.add(rows, all_rank_rows(rows))
    writer.finalize()
    (out / "report.html").unlink()
    data = {name: (out / name).read_bytes() for name in ("meta.json", "results.csv", "ranks.csv")}
    done = _commbench(["report", str(out)], tmp_path, limit=16 << 10)
    assert done.returncode == 2, done.stderr
    errors = _error_lines(done)
    assert len(errors) == 1 and "cannot write report file" in errors[0]
    assert_folder_readable(out)
    assert {name: (out / name).read_bytes() for name in data} == data


# ---------------------------------------------------------------------------------------------------------
# The output folder is claimed exclusively


def _race_claims(target: Path, contenders: int) -> list[object]:
    """``contenders`` threads claim ``target`` at the same moment; each one's claim or error."""
    start = threading.Barrier(contenders)
    outcomes: list[object] = [None] * contenders

    def claim(index: int) -> None:
        start.wait()
        try:
            outcomes[index] = claim_out_dir(target)
        except UsageError as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=claim, args=(index,)) for index in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "existing-empty-folder"])
def test_racing_claims_have_exactly_one_winner(tmp_path: Path, existing: bool) -> None:
    for attempt in range(10):
        target = tmp_path / f"out{attempt}"
        if existing:
            target.mkdir()
        outcomes = _race_claims(target, contenders=8)
        winners = [o for o in outcomes if not isinstance(o, UsageError)]
        losers = [o for o in outcomes if isinstance(o, UsageError)]
        assert len(winners) == 1 and len(losers) == 7
        assert all(isinstance(o, OutDirTaken) and len(str(o).splitlines()) == 1 for o in losers)
        assert sorted(p.name for p in target.iterdir()) == [MARKER]


def test_two_runs_given_the_same_out_one_wins(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    args = ["run", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "2K", "--backend", "gloo"]
    args += ["--world-size", "2", "--warmup", "0", "--iters", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and k != "COMMBENCH_DEBUG"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "commbench", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    results = [(run.returncode, stdout, stderr) for run, (stdout, stderr) in zip(runs, outputs, strict=True)]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser = next(stderr for code, _, stderr in results if code == 2)
    assert len(loser.strip().splitlines()) == 1 and "commbench: error: output folder" in loser
    assert "Traceback" not in loser
    assert_folder_readable(out)
    assert pd.read_csv(out / "results.csv")["size_bytes"].tolist() == [1024, 2048]  # one run's rows only


def test_claim_refuses_files_full_folders_and_a_claimed_folder(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        claim_out_dir(afile)
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine\n")
    with pytest.raises(OutDirTaken, match="not empty"):
        claim_out_dir(full)
    assert [p.name for p in full.iterdir()] == ["notes.txt"]  # the marker was taken back
    claimed = tmp_path / "claimed"
    claim_out_dir(claimed)
    with pytest.raises(OutDirTaken, match=f"delete '{claimed / MARKER}'"):
        claim_out_dir(claimed)
    finished, _ = _finished_folder(tmp_path / "finished")
    with pytest.raises(OutDirTaken, match="not empty"):
        claim_out_dir(finished)


def test_release_undoes_only_an_unused_claim(tmp_path: Path) -> None:
    created = claim_out_dir(tmp_path / "new")
    assert created.release_if_unused() and not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    existing = claim_out_dir(tmp_path / "empty")
    assert existing.release_if_unused() and list((tmp_path / "empty").iterdir()) == []  # left as found
    used = claim_out_dir(tmp_path / "used")
    ReportWriter(used.path, {}, HGX, claim=used.token)
    assert not used.release_if_unused() and (used.path / "meta.json").is_file()


def test_a_writer_needs_the_launchers_claim(tmp_path: Path) -> None:
    claim = claim_out_dir(tmp_path / "run")
    with pytest.raises(OutDirTaken, match="no longer claimed by this run"):
        ReportWriter(claim.path, {}, HGX, claim="not-the-token")
    assert sorted(p.name for p in claim.path.iterdir()) == [MARKER]
    with pytest.raises(OutDirTaken):  # without the token the writer claims itself, and the folder is taken
        ReportWriter(claim.path, {}, HGX)


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "existing-empty-folder"])
def test_a_launch_that_fails_leaves_the_out_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    import commbench.run.dist

    def failing_launch(*_args: object, **_kwargs: object) -> None:
        raise UsageError("no ranks today")

    monkeypatch.setattr(commbench.run.dist, "launch", failing_launch)
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    args = ["run", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "1K", "--backend", "gloo"]
    result = CliRunner().invoke(cli, [*args, "--world-size", "2", "--out", str(out)])
    assert result.exit_code == 2 and "no ranks today" in result.stderr
    assert out.exists() == existing and (not existing or list(out.iterdir()) == [])


# ---------------------------------------------------------------------------------------------------------
# A stopped run: INCOMPLETE


def _finished_folder(out: Path, incomplete: str | None = None) -> tuple[Path, pd.DataFrame]:
    writer = ReportWriter(out, {"args": {"tokens": 64}}, HGX)
    rows = [balanced_row(4, 4096, 10.0), *skewed_rows()]
    writer.add(rows, all_rank_rows(rows))
    return out, writer.finalize(incomplete=incomplete)


def test_a_finished_run_has_no_status_and_no_incomplete_note(tmp_path: Path) -> None:
    out, _ = _finished_folder(tmp_path / "run")
    assert "status" not in json.loads((out / "meta.json").read_text())
    assert "status" not in json.loads((out / "results.json").read_text())
    assert "INCOMPLETE" not in (out / "summary.md").read_text() + (out / "report.html").read_text()
    assert render_report(out).attrs["incomplete"] is None


def test_finalize_incomplete_records_why_and_the_pages_say_so_first(tmp_path: Path) -> None:
    out, frame = _finished_folder(tmp_path / "run", incomplete="stopped by SIGTERM\nafter 3 of 8 cases")
    assert len(frame) == 3
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "incomplete"
    assert meta["incomplete_reason"] == "stopped by SIGTERM after 3 of 8 cases"  # one line
    assert json.loads((out / "results.json").read_text())["status"] == "incomplete"
    summary = (out / "summary.md").read_text().splitlines()
    assert summary[2].startswith("**INCOMPLETE: stopped by SIGTERM after 3 of 8 cases.")
    html_text = (out / "report.html").read_text()
    assert html_text.index("INCOMPLETE: stopped by SIGTERM") < html_text.index("<h2>Conventions</h2>")
    assert_folder_readable(out)

    data = {name: (out / name).read_bytes() for name in ("meta.json", "results.csv", "ranks.csv")}
    result = CliRunner().invoke(cli, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# INCOMPLETE: stopped by SIGTERM after 3 of 8 cases")
    assert "(INCOMPLETE run: stopped by SIGTERM" in result.stdout.splitlines()[-1]
    assert {name: (out / name).read_bytes() for name in data} == data
    assert (out / "summary.md").read_text().splitlines()[2] == summary[2]


def test_a_run_stopped_before_any_phase_is_still_a_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    frame = ReportWriter(out, {"args": {}}, HGX).finalize(incomplete="stopped by SIGINT")
    assert frame.empty and not (out / "results.csv").exists()
    assert "INCOMPLETE: stopped by SIGINT" in (out / "summary.md").read_text()
    result = CliRunner().invoke(cli, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert "INCOMPLETE: stopped by SIGINT" in result.stdout


def test_mark_incomplete_finishes_a_folder_whose_rank_0_was_killed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    writer = ReportWriter(out, {"args": {}}, HGX)
    rows = skewed_rows()
    writer.add(rows, all_rank_rows(rows))  # rank 0 killed here: no finalize
    data = {name: (out / name).read_bytes() for name in ("results.csv", "ranks.csv")}
    frame = mark_incomplete(out, "rank 0 killed by SIGKILL")
    assert frame is not None and len(frame) == 2 and frame.attrs["incomplete"] == "rank 0 killed by SIGKILL"
    assert json.loads((out / "meta.json").read_text())["status"] == "incomplete"
    assert "INCOMPLETE: rank 0 killed by SIGKILL" in (out / "summary.md").read_text()
    assert {name: (out / name).read_bytes() for name in data} == data
    assert_folder_readable(out)
    claimed = claim_out_dir(tmp_path / "nothing-written")
    assert mark_incomplete(claimed.path, "stopped") is None
    assert sorted(p.name for p in claimed.path.iterdir()) == [MARKER]


def test_a_stop_that_finished_nothing_leaves_no_folder_one_with_rows_keeps_them(tmp_path: Path) -> None:
    # A new folder the run claimed: meta.json and the claim removed, the folder and its new parents too.
    claim = claim_out_dir(tmp_path / "new" / "run")
    ReportWriter(claim.path, {"args": {}}, HGX, claim=claim.token)
    assert mark_incomplete(claim.path, "stopped by SIGINT", discard=claim) is None
    assert not (tmp_path / "new").exists()
    # An existing empty folder given with --out is left as it was: empty.
    given = tmp_path / "given"
    given.mkdir()
    claim = claim_out_dir(given)
    ReportWriter(given, {"args": {}}, HGX, claim=claim.token).finalize("stopped by SIGTERM", discard=claim)
    assert given.is_dir() and list(given.iterdir()) == []
    # One finished row: nothing is removed, the folder is finished INCOMPLETE.
    claim = claim_out_dir(tmp_path / "rows")
    writer = ReportWriter(claim.path, {"args": {}}, HGX, claim=claim.token)
    rows = skewed_rows()[:1]
    writer.add(rows, all_rank_rows(rows))
    frame = writer.finalize("stopped by SIGHUP", discard=claim)
    assert frame is not None and len(frame) == 1 and frame.attrs["incomplete"] == "stopped by SIGHUP"
    assert (claim.path / MARKER).exists() and (claim.path / "summary.md").exists()
    # A file the run did not write (someone else's) keeps the folder whole, marked INCOMPLETE.
    claim = claim_out_dir(tmp_path / "foreign")
    ReportWriter(claim.path, {"args": {}}, HGX, claim=claim.token)
    (claim.path / "notes.txt").write_text("mine")
    assert mark_incomplete(claim.path, "stopped by SIGINT", discard=claim) is not None
    assert (claim.path / "notes.txt").read_text() == "mine" and (claim.path / "meta.json").exists()
