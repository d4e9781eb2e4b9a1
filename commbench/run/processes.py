"""Local processes of a launch: their kernel state and names, the parent-death signal, the launch's scratch
files and folders, and the fork server the ranks are forked from.

A launch's ranks are forked by multiprocessing's fork server ("forkserver"), a fresh one per launch started
with the first rank (so it inherits that launch's environment, output and blocked stop signals), which
imported torch and commbench once: each rank would otherwise import torch itself, all of them at once on
the same cores. Each rank closes its copy of the server's "alive" pipe, so the server exits with the
launcher and the rank, whose parent it is, then gets its parent-death signal. multiprocessing's own
temporary folder (the server's socket) is one of the launch's scratch folders, removed with them even when
the launcher is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

LAUNCH_ID_VARIABLE = "COMMBENCH_LAUNCH_ID"  # set in spawned ranks: names their scratch files
_FORK_SERVER_STOP_S = 5.0


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, t, Z, ...), None if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


STATE_WORDS = {
    "T": "stopped by a signal (state T: SIGSTOP, SIGTSTP or Ctrl-Z)",
    "t": "stopped by a debugger (state t)",
    "D": "in uninterruptible sleep (state D: a hung device, driver or file system)",
    "Z": "exited, not yet reaped (state Z)",
}


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Linux: ask the kernel to send ``signum`` to this process when its parent exits (PR_SET_PDEATHSIG)."""
    libc = _libc()
    return bool(libc is not None and libc.prctl(1, int(signum), 0, 0, 0) == 0)  # 1 = PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """Linux: the name ps/top show for this process (15 bytes at most), e.g. "commbench-r2"."""
    libc = _libc()
    if libc is not None:
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # 15 = PR_SET_NAME


def scratch_name(kind: str) -> str:
    """A scratch file name for a rank of this launch, ``commbench-<kind>-<launch id>-<random>``: the
    launcher removes whatever a stopped run left under that launch id (``remove_scratch``)."""
    launch_id = os.environ.get(LAUNCH_ID_VARIABLE, "solo")
    return f"commbench-{kind}-{launch_id}-{os.urandom(8).hex()}"


def matplotlib_dir_for(launch_id: str, environ: dict[str, str] | None = None) -> str | None:
    """A scratch folder of this launch for matplotlib's config and cache when its own (MPLCONFIGDIR, else
    $XDG_CONFIG_HOME or ~/.config, /matplotlib) cannot be written: matplotlib would make a temp folder per
    process and remove it at exit, which a rank leaving through os._exit never reaches. None (nothing to
    do) when it can be written; the folder goes with the launch's scratch (``remove_scratch``)."""
    env = os.environ if environ is None else environ
    if env.get("MPLCONFIGDIR"):
        return None
    home = os.path.expanduser("~")
    config = os.path.join(env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"), "matplotlib")
    probe = config
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the folder matplotlib would create it in
    if os.access(probe, os.W_OK | os.X_OK):
        return None
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"commbench-mpl-{launch_id}-{os.urandom(8).hex()}")
    os.mkdir(path, 0o700)
    return path


def remove_scratch(launch_id: str) -> None:
    """Remove the scratch files and folders of launch ``launch_id`` (/dev/shm and the temp folder)."""
    for folder in {"/dev/shm", tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(folder, f"commbench-*-{launch_id}-*")):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def process_gone(pid: int) -> bool:
    """True when ``pid`` (on this host) has exited: absent, or a zombie not yet reaped."""
    return process_state(pid) in (None, "Z", "X")


# What the fork server imports once before it forks the ranks (with the entry's own module): each rank would
# otherwise import torch itself, all of them at once on the same cores (4 ranks on 2 cores: 5.5 s, not 2.7 s).
_PRELOAD = (
    "torch", "torch.distributed", "commbench.run.launcher", "commbench.cli.main", "commbench.cli.worker",
)  # fmt: skip


def fork_server_context(entry: Callable[..., Any]) -> Any:
    """multiprocessing's "forkserver" context with a fresh fork server for this launch (started at the first
    rank's start, so it inherits this launch's environment, output and blocked stop signals), preloading
    torch and commbench; "spawn" where there is no fork server."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    stop_fork_server()  # one left by an earlier launch of this process holds that launch's environment
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*_PRELOAD, getattr(entry, "__module__", "") or "commbench"])
    return context


def stop_fork_server() -> None:
    """Stop this process's fork server if one runs (it exits once its ranks are gone)."""
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is None:
        return
    stopping = threading.Thread(target=stop, name="commbench-fork-server-stop", daemon=True)
    stopping.start()
    stopping.join(_FORK_SERVER_STOP_S)  # a rank stuck in the kernel keeps it: it is left to exit later


def leave_the_fork_server() -> None:
    """A rank forked by the fork server closes its copy of the server's "alive" pipe: the server then exits
    with the launcher, and this rank, whose parent it is, gets its parent-death signal at once."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


class MultiprocessingScratch:
    """multiprocessing's temporary folder (the fork server's socket) for one launch, named as the launch's
    scratch (``remove_scratch``), so that it goes even when the launcher is killed (the ranks remove what a
    dead launcher left); in /dev/shm where there is one (a socket path must stay under 108 bytes)."""

    def __init__(self, launch_id: str) -> None:
        from multiprocessing import process

        self._config = process.current_process()._config  # where multiprocessing.util keeps its tempdir
        self._previous = self._config.get("tempdir")
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(base, f"commbench-mp-{launch_id}-{os.urandom(4).hex()}")
        os.mkdir(self.path, 0o700)
        self._config["tempdir"] = self.path

    def close(self) -> None:
        if self._previous is None:
            self._config.pop("tempdir", None)
        else:
            self._config["tempdir"] = self._previous
