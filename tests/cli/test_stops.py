"""Every stop of every launching command leaves the same files: ``run``, ``suite --quick``, ``suite --soak``,
``profile`` and ``run --pattern pairwise`` (and ``./run_suite.sh``), each stopped as a terminal, a scheduler
or the out-of-memory killer would stop it, on real 2-rank (pairwise: 3-rank) gloo runs of the CLI.

A stop after the first case wrote its rows: the exit code 128 + N (SIGKILL: the launcher cannot report, its
shell sees -9), verdict.json INCOMPLETE with the reason naming the stop, junit.xml, summary.md and
report.html saying INCOMPLETE, the ``commbench verdict:`` line last on stdout, every process of the run gone
(a killed launcher's ranks within ``--timeout`` + 10 s) and no scratch file left (the run's TMPDIR empty,
nothing of its launch in /dev/shm). A stop before any case finished leaves no report folder. A run killed
whole (launcher and ranks at once: nothing of it can write) leaves its rows, and ``commbench report DIR``
then writes the INCOMPLETE verdict and the pages from them.

The cells run a few at a time in one module fixture (only the selected ones), each waiting for its own
moment (a line on stderr, the first row in results.csv or pairs.csv) rather than a fixed time; the planted
``--inject-delay`` sleeps keep every case long beside that moment without burning the CPUs. Deadlines are
generous: they catch a hang, not a slow host.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.run.processes import (
    REPO,
    Lines,
    check_report_files,
    kill_marked,
    marked_processes,
    new_mark,
    run_env,
    seconds_until_gone,
)

TIMEOUT_S = 20  # --timeout: a killed launcher's ranks must be gone within TIMEOUT_S + 10 s
GLOO = ["--backend", "gloo", "--world-size", "2", "--timeout", str(TIMEOUT_S), "--warmup", "1"]
# 10 timed iterations of >= 100 ms each (rank 1 sleeps before every timed call): each case takes >= 1 s, so
# a stop lands inside the run, long before its end, and a stop before the first row lands before it.
SLOW = ["--iters", "10", "--inject-delay", "1:100000"]
BALANCED = ["--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "256K", "--step-factor", "4"]
QUICK = ["suite", "--quick", "--max-bytes", "16K", "--tokens", "32", "--skew", "uniform"]
# Three ranks: three rounds of one pair each (two ranks have one round only); each round's sends sleep.
PAIR_DELAYS = ["--pair-bytes", "1K"]
PAIR_DELAYS += ["--inject-delay", "0-1:50000", "--inject-delay", "1-2:50000", "--inject-delay", "2-0:50000"]
COMMANDS = {
    "run": ["run", *BALANCED, *GLOO, *SLOW],
    "suite": [*QUICK, *GLOO, *SLOW],
    "suite-soak": [*QUICK, "--soak", "10m", "--no-pairwise", *GLOO, *SLOW],
    "profile": ["profile", *BALANCED, *GLOO, *SLOW],
    "pairwise": ["run", "--pattern", "pairwise", *GLOO, "--world-size", "3", "--iters", "3", *PAIR_DELAYS],
}
# How each stop comes: (signal, to the launcher's process group (True) or to the launcher alone).
STOPS = {
    "ctrl-c": (signal.SIGINT, True),  # a terminal's Ctrl-C: the whole foreground process group
    "sigterm": (signal.SIGTERM, False),  # kill PID, a scheduler's time limit, systemd, docker stop
    "hangup": (signal.SIGHUP, True),  # a closed terminal or ssh session: the job's process group
    "killed": (signal.SIGKILL, False),  # the launcher killed without a word (OOM killer, kill -9 PID)
}
FIRST_ROW, NO_ROW, WHOLE = "first-row", "no-row", "killed-whole"
STARTUP_S = 300  # ranks importing torch on a busy 2-core machine, a few launches at once
GONE_S = 60.0  # a stopped launch's processes gone (the launcher kills what is left after ~11 s)
PARALLEL = 4  # launches at once: each mostly sleeps (the planted delays) once started


@dataclass(frozen=True)
class Cell:
    command: str
    stop: str
    when: str

    @property
    def id(self) -> str:
        return f"{self.command}-{self.stop}-{self.when}"


@dataclass
class Stopped:
    """What one stopped launch left: its exit code, output, report folder and leftovers."""

    cell: Cell
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    out: Path = Path()
    launcher_pid: int = 0
    gone_s: float | None = None
    left: dict[int, str] = field(default_factory=dict)  # processes still running after GONE_S
    scratch: list[str] = field(default_factory=list)  # temporary files and folders left behind
    left_files: list[str] = field(default_factory=list)  # the report folder's files after the stop
    report: subprocess.CompletedProcess | None = None  # `commbench report DIR` after a whole kill
    problem: str = ""  # the stop could not be placed (the launch failed or ended first)


FIRST_ROW_CELLS = [Cell(command, stop, FIRST_ROW) for command in COMMANDS for stop in STOPS]
# Before the first row: every command once and every stop once (one path for all: the cells share it).
NO_ROW_CELLS = [
    Cell(command, stop, NO_ROW)
    for command, stop in zip(COMMANDS, ["ctrl-c", "sigterm", "hangup", "killed", "sigterm"], strict=True)
]
WHOLE_CELLS = [Cell("suite", "kill-group", WHOLE)]
SCRIPT_CELL = Cell("run_suite.sh", "ctrl-c", FIRST_ROW)
ALL_CELLS = [*FIRST_ROW_CELLS, *NO_ROW_CELLS, *WHOLE_CELLS, SCRIPT_CELL]


def _first_rows(out: Path) -> bool:
    """A finished case's rows are on disk: results.csv (or, for the pairwise test alone, pairs.csv) has a
    header and a row."""
    for name in ("results.csv", "pairs.csv"):
        try:
            if (out / name).read_text().count("\n") >= 2:
                return True
        except OSError:
            continue
    return False


def _launch_ids(mark: str) -> set[str]:
    """The launch ids of the run's spawned ranks: their scratch files carry it. A rank is started with its
    launch's matplotlib folder, ``MPLCONFIGDIR=/dev/shm/commbench-mpl-<launch id>-<random>`` (its launch id
    variable is set later, in the rank: /proc shows the environment a process started with)."""
    ids = set()
    for pid in marked_processes(mark):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                for item in handle.read().split(b"\0"):
                    name = os.path.basename(item.decode(errors="replace").partition("=")[2])
                    if item.startswith(b"MPLCONFIGDIR=") and name.startswith("commbench-mpl-"):
                        ids.add(name.split("-")[2])
        except OSError:
            continue
    return ids


def _scratch_left(tmpdir: Path, launch_ids: set[str]) -> list[str]:
    """What the run left in its own TMPDIR (everything there is the run's), and /dev/shm entries of its
    launches."""
    left = sorted(path.name for path in tmpdir.iterdir())
    if os.path.isdir("/dev/shm"):
        left += sorted(f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if any(i in n for i in launch_ids))
    return left


IN_VENV = sys.prefix != sys.base_prefix  # ./run_suite.sh is given the tests' own venv to set up


def _argv(cell: Cell, out: Path) -> list[str]:
    # A stop before the first row: 50 timed iterations (>= 5 s) to the first row, the stop long before it.
    later = ["--iters", "50"] if cell.when == NO_ROW else []  # the last --iters given counts
    if cell.command == "run_suite.sh":  # exec's `commbench suite --world-size 4 --backend gloo "$@"`
        return ["bash", str(REPO / "run_suite.sh"), *COMMANDS["suite"][1:], "--out", str(out)]
    return [sys.executable, "-m", "commbench", *COMMANDS[cell.command], *later, "--out", str(out)]


def _stop(launcher: subprocess.Popen, cell: Cell, mark: str) -> None:
    if cell.when == WHOLE:  # as the OOM killer or a lost node: every process of the run at once (the
        os.killpg(launcher.pid, signal.SIGKILL)  # ranks run in sessions of their own, as torchrun's do)
        kill_marked(mark)
        return
    signum, group = STOPS[cell.stop]
    if group:
        os.killpg(launcher.pid, signum)
    else:
        launcher.send_signal(signum)


def run_cell(cell: Cell, root: Path) -> Stopped:
    """Start the cell's command in its own session, stop it at its moment, wait for every process of it to
    go; the whole picture of what it left."""
    root.mkdir(parents=True)
    mark = new_mark()
    out = root / "report"
    # No writable matplotlib config folder (not even for root: a path under a device file), so that the
    # launch makes its own scratch one (commbench-mpl-<launch id>-*), which must go with the launch.
    env = run_env(root, mark, XDG_CONFIG_HOME="/dev/null/no-config", MPLCONFIGDIR="")
    if cell.command == "run_suite.sh":
        env["COMMBENCH_VENV"] = sys.prefix  # the python running the tests (its own venv), set up already
    launcher = subprocess.Popen(
        _argv(cell, out),
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell job has
    )
    stdout, stderr = Lines(launcher.stdout), Lines(launcher.stderr)
    result = Stopped(cell, out=out, launcher_pid=launcher.pid)
    launch_ids: set[str] = set()
    try:
        deadline = time.monotonic() + STARTUP_S
        if cell.when == NO_ROW:  # rank 0 has written meta.json (it names the topology next), no row yet
            ready = stderr.wait_for("commbench: topology:", STARTUP_S)
        else:
            while not (ready := _first_rows(out)) and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        launch_ids = _launch_ids(mark)
        if not ready or launcher.poll() is not None:
            result.problem = f"no moment to stop at (exit {launcher.poll()}): {stderr.text(5)[-3000:]}"
            return result
        if cell.when == NO_ROW and _first_rows(out):
            result.problem = "a row was written before the stop"
            return result
        _stop(launcher, cell, mark)
        result.gone_s = seconds_until_gone(mark, GONE_S)
        result.left = marked_processes(mark)
        result.returncode = launcher.wait(30)
    finally:
        kill_marked(mark)
        launcher.wait(30)
    result.stdout, result.stderr = stdout.text(), stderr.text()
    if not launch_ids:
        result.problem = "no launch id found: the ranks were not started with their matplotlib folder"
    result.scratch = _scratch_left(root / "tmpdir", launch_ids)
    result.left_files = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if cell.when == WHOLE and out.is_dir():
        for name in ("COMMBENCH_TEST_RUN", "XDG_CONFIG_HOME"):
            env.pop(name)
        command = [sys.executable, "-m", "commbench", "report", str(out)]
        result.report = subprocess.run(
            command, cwd=root, env=env, capture_output=True, text=True, timeout=300
        )
    return result


@pytest.fixture(scope="module")
def stopped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Stopped]:
    """The selected cells of this module, run a few at a time, by cell id."""
    wanted = {
        item.callspec.params["cell"].id
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "cell" in item.callspec.params
    }
    cells = [cell for cell in ALL_CELLS if cell.id in wanted and (IN_VENV or cell != SCRIPT_CELL)]
    root = tmp_path_factory.mktemp("stops")
    lock = threading.Lock()
    done: dict[str, Stopped] = {}

    def one(cell: Cell) -> None:
        started = time.monotonic()
        result = run_cell(cell, root / cell.id)
        with lock:
            done[cell.id] = result
        spent = time.monotonic() - started
        print(f"{cell.id}: exit {result.returncode}, {spent:.0f} s, gone after {result.gone_s} s")

    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(one, cells))
    return done


def _verdict_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("commbench verdict:")]


def _check_processes_and_scratch(result: Stopped, gone_within_s: float) -> None:
    assert not result.left, f"still running {GONE_S:g} s after the stop: {result.left}"
    assert result.gone_s is not None and result.gone_s <= gone_within_s, result.gone_s
    assert result.scratch == [], result.scratch


def _check_incomplete_folder(out: Path, reason: str, marked: bool = True) -> dict:
    """The folder of a stopped run: whole files, meta.json (when ``marked``) and verdict.json INCOMPLETE
    naming ``reason``, junit.xml, and the pages saying INCOMPLETE."""
    check_report_files(out)
    meta = json.loads((out / "meta.json").read_text())
    if marked:
        assert meta.get("status") == "incomplete", meta.get("status")
        assert reason in meta["incomplete_reason"], meta["incomplete_reason"]
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["status"] == "INCOMPLETE", verdict["status"]
    assert reason in verdict["reason"], verdict["reason"]
    assert verdict["run"]["state"] != "complete", verdict["run"]
    suites = ElementTree.parse(out / "junit.xml").getroot()
    assert suites.tag == "testsuites" and len(suites) >= 1
    for page in ("summary.md", "report.html"):
        assert "INCOMPLETE" in (out / page).read_text(), page
    return verdict


def _stop_reason(cell: Cell, result: Stopped) -> str:
    if cell.stop == "killed":
        return f"the launcher (pid {result.launcher_pid}) is gone"
    return f"stopped by {STOPS[cell.stop][0].name}"


@pytest.mark.parametrize("cell", [*FIRST_ROW_CELLS, SCRIPT_CELL], ids=lambda cell: cell.id)
def test_a_stop_after_the_first_case_leaves_an_incomplete_verdict_and_its_pages(
    stopped: dict[str, Stopped], cell: Cell
) -> None:
    if cell == SCRIPT_CELL and not IN_VENV:
        pytest.skip("./run_suite.sh sets up a venv: the tests run outside one")
    result = stopped[cell.id]
    assert not result.problem, result.problem
    signum = STOPS[cell.stop][0]
    expected = -signal.SIGKILL if cell.stop == "killed" else 128 + signum
    assert result.returncode == expected, (result.returncode, result.stderr[-3000:])
    reason = _stop_reason(cell, result)
    verdict = _check_incomplete_folder(result.out, reason)
    assert verdict["exit_code"] == 128 + (signal.SIGTERM if cell.stop == "killed" else signum)
    # The verdict line is the console's last, naming the folder (a killed launcher's rank 0 prints it).
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("commbench verdict: INCOMPLETE"), lines[-3:]
    assert lines[-1].endswith(f"report: {result.out}") and len(_verdict_lines(result.stdout)) == 1
    assert reason in lines[-1]
    messages = [line for line in result.stderr.splitlines() if line.startswith("commbench")]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if cell.stop != "killed":
        assert messages[-1].startswith(f"commbench: {reason}; all "), messages[-3:]
        assert f"what finished is in {result.out} (marked INCOMPLETE)" in messages[-1]
    _check_processes_and_scratch(result, TIMEOUT_S + 10.0)


@pytest.mark.parametrize("cell", NO_ROW_CELLS, ids=lambda cell: cell.id)
def test_a_stop_before_any_case_finished_leaves_no_folder(stopped: dict[str, Stopped], cell: Cell) -> None:
    result = stopped[cell.id]
    assert not result.problem, result.problem
    signum = STOPS[cell.stop][0]
    expected = -signal.SIGKILL if cell.stop == "killed" else 128 + signum
    assert result.returncode == expected, (result.returncode, result.stderr[-3000:])
    assert not result.out.exists(), sorted(p.name for p in result.out.iterdir())
    assert _verdict_lines(result.stdout) == [], result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    messages = [line for line in result.stderr.splitlines() if line.startswith("commbench")]
    assert "nothing finished" in messages[-1], messages[-3:]
    if cell.stop != "killed":
        assert messages[-1].startswith(f"commbench: {_stop_reason(cell, result)}; all "), messages[-3:]
    _check_processes_and_scratch(result, TIMEOUT_S + 10.0)


@pytest.mark.parametrize("cell", WHOLE_CELLS, ids=lambda cell: cell.id)
def test_a_run_killed_whole_keeps_its_rows_and_report_finishes_it(
    stopped: dict[str, Stopped], cell: Cell
) -> None:
    result = stopped[cell.id]
    assert not result.problem, result.problem
    assert result.returncode == -signal.SIGKILL
    assert result.gone_s is not None and not result.left
    # Nothing of the run could write after SIGKILL: the rows it had appended are whole, no verdict yet...
    names = set(result.left_files)
    assert {"meta.json", "results.csv"} <= names and "verdict.json" not in names, names
    # ...and `commbench report DIR` finishes the folder: INCOMPLETE, the verdict, junit.xml and the pages
    # (meta.json, which a re-render never rewrites, keeps no INCOMPLETE mark: the verdict says it).
    report = result.report
    assert report is not None and report.returncode == 0, report.stderr[-2000:] if report else None
    verdict = _check_incomplete_folder(result.out, "ended without finishing its report", marked=False)
    assert verdict["run"]["state"] == "incomplete"
    assert report.stdout.strip().splitlines()[-1].startswith("commbench verdict: INCOMPLETE")
    # What no process of the launch was left to remove: its scratch files, named after it (here its
    # matplotlib folder and multiprocessing's, the fork server's socket; a shared-memory backend's heaps too),
    # nothing else (removed here, as a user would).
    assert sorted(name.split("-")[1] for name in result.scratch) == ["mp", "mpl"], result.scratch
    for name in result.scratch:
        shutil.rmtree(name, ignore_errors=True)
