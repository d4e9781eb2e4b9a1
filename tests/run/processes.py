"""Test helpers for runs started as real processes: find them in /proc by a marker in their environment, wait
until they are gone, start torchrun-style ranks, read their stderr line by line, check a report folder."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

MARK_VARIABLE = "COMMBENCH_TEST_RUN"
REPO = Path(__file__).resolve().parents[2]


def new_mark() -> str:
    return uuid.uuid4().hex


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> name of every live (not zombie) process whose environment carries ``mark``: the launcher, its
    ranks and multiprocessing's resource tracker all inherit it."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle not in handle.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as handle:
                if handle.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{entry}/comm") as handle:
                found[int(entry)] = handle.read().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def seconds_until_gone(mark: str, limit_s: float) -> float | None:
    """Seconds until no process carries ``mark`` (None if some still do after ``limit_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if not marked_processes(mark):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def kill_marked(mark: str) -> None:
    """Clean up after a failed test: SIGKILL whatever still carries ``mark`` (only this test's processes)."""
    for pid in marked_processes(mark):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lines:
    """Collects a process's stderr lines in a thread; ``wait_for(prefix)`` blocks until one starts so."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, prefix: str, timeout_s: float) -> bool:
        with self._seen:
            return self._seen.wait_for(lambda: any(x.startswith(prefix) for x in self.lines), timeout_s)

    def text(self, timeout_s: float = 5.0) -> str:
        self._thread.join(timeout_s)
        return "\n".join(self.lines)

    def messages(self) -> list[str]:
        """The commbench lines (without c10d's own log lines)."""
        return [line for line in self.text().splitlines() if line.startswith("commbench")]


def run_env(tmp_path: Path, mark: str, **extra: str) -> dict[str, str]:
    """The environment of a run under test: marked, with its own TMPDIR."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir(exist_ok=True)
    launch_variables = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch_variables}
    env.update({MARK_VARIABLE: mark, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO), **extra})
    return env


def start_torchrun_style(argv: list[str], world_size: int, env: dict[str, str]) -> list[subprocess.Popen]:
    """``world_size`` rank processes as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), each in its own session, stderr piped."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        rank_env = dict(
            env,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return processes


def check_report_files(out: Path) -> None:
    """Every file of a report folder is whole: CSV rows have the header's fields, JSON parses, no temporary
    file is left."""
    names = sorted(path.name for path in out.iterdir())
    assert not [name for name in names if name.endswith(".tmp")], names
    for path in out.glob("*.csv"):
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
        assert rows, f"{path.name} is empty"
        assert all(len(row) == len(rows[0]) for row in rows[1:]), f"{path.name} has a cut row"
    for path in out.glob("*.json"):
        json.loads(path.read_text())


def commbench_temp_left(tmp_path: Path) -> list[str]:
    """commbench's (and multiprocessing's) temporary folders and files left in the test's TMPDIR."""
    tmpdir = tmp_path / "tmpdir"
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(("commbench-", "pymp-")))
