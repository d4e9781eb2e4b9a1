"""NCCL error handling: the TORCH_NCCL_* settings that make a timed-out or failed NCCL collective a commbench
error (one line naming the rank and the peer, exit 4) instead of torch aborting the process (SIGABRT).

What torch does (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp/.cpp, torch 2.8+): a watchdog thread
finds a collective that failed or ran past the process group's timeout, waits 4 x
TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (default 15 s: time for a flight-recorder dump), then acts on
TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 nothing, 1 abort the communicators and the process, 2 abort the
communicators only, 3 (the default) abort the process without cleaning up. Its heartbeat monitor also ends the
process (SIGABRT): TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (default 480) after such a failure when
TORCH_NCCL_DUMP_ON_TIMEOUT is on (the default), or when the watchdog itself is stuck that long
(TORCH_NCCL_ENABLE_MONITORING, default on). TORCH_NCCL_BLOCKING_WAIT=1 runs neither thread: every
collective's wait blocks the host and raises at the timeout.

What commbench sets, each only where the user has not (a value under torch's older name, e.g.
NCCL_ASYNC_ERROR_HANDLING, counts as the user's):
* TORCH_NCCL_ASYNC_ERROR_HANDLING=2: the communicators are aborted and the process lives, so the error
  reaches the rank's next wait or collective as a Python exception (``Comm.guard``: the one-line CommError).
* TORCH_NCCL_DUMP_ON_TIMEOUT=0 and TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1000: no dump files and no kill after
  one; the abort comes 4 s after the timeout instead of 60 s.
* TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: at least commbench's own watchdog bound plus a minute, so that a rank
  stuck for good (where even the abort hangs) is ended by commbench's watchdog, with its line, first.
TORCH_NCCL_BLOCKING_WAIT is left alone: it would make every timed collective wait on the host.

When the user keeps a setting that ends the process on a timeout (ASYNC_ERROR_HANDLING 1 or 3), the process
group's timeout moves past commbench's own watchdog, which then reports first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
WAIT_TIMEOUT_DUMP = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
SETTINGS = (ASYNC_ERROR_HANDLING, BLOCKING_WAIT, DUMP_ON_TIMEOUT, WAIT_TIMEOUT_DUMP, ENABLE_MONITORING,
            HEARTBEAT_TIMEOUT)  # fmt: skip
# Older names torch still reads (ProcessGroupNCCL.hpp), after the TORCH_ ones.
ALIASES = {ASYNC_ERROR_HANDLING: "NCCL_ASYNC_ERROR_HANDLING", BLOCKING_WAIT: "NCCL_BLOCKING_WAIT"}

CLEAN_UP_ONLY = 2  # torch's ErrorHandlingMode: 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp
TORCH_DEFAULT_ERROR_HANDLING = 3
TORCH_DEFAULT_HEARTBEAT_S = 480
DUMP_WAIT_MS = 1000  # the watchdog waits 4 x this after a failure before it acts
# Torch's kill (heartbeat monitor) and a torn-down process group come at least this long after commbench's
# own watchdog would have reported.
MARGIN_S = 60.0
_TRUE = {"1", "true", "yes", "y", "on"}


@dataclass(frozen=True)
class NcclErrorEnv:
    """The NCCL error handling of one run: every setting in effect and who chose it, the process group's
    timeout, and notes on user settings that change what a failure looks like."""

    values: dict[str, str]  # setting (or the older name the user used) -> value in effect
    set_by_commbench: dict[str, str]  # what commbench adds to the environment
    user: tuple[str, ...]  # the settings the user had set (kept as they are)
    process_group_timeout_s: float
    notes: tuple[str, ...] = ()

    def to_meta(self) -> dict[str, Any]:
        """For a report's meta.json: values, who set them, the process group timeout, notes."""
        return {
            "values": dict(self.values),
            "set_by_commbench": sorted(self.set_by_commbench),
            "process_group_timeout_s": self.process_group_timeout_s,
            "notes": list(self.notes),
        }


def _int(text: str | None, default: int) -> int | None:
    """``text`` as an integer (``default`` when unset), None when it is not one."""
    if text is None:
        return default
    try:
        return int(text.strip())
    except ValueError:
        return None


def nccl_error_env(environ: Mapping[str, str], timeout_s: float, watchdog_s: float) -> NcclErrorEnv:
    """The NCCL settings for a run with collective timeout ``timeout_s`` whose own watchdog (commbench's:
    the launcher's, or the rank's under torchrun) ends a rank after ``watchdog_s`` without progress.

    Pure: ``environ`` is only read. The user's settings are kept; commbench's fill the rest (module doc)."""
    # Under both names, torch takes the TORCH_ one: read the older name first so that it is overwritten.
    names = [(name, key) for name in SETTINGS for key in (ALIASES.get(name), name) if key and key in environ]
    user = {name: environ[key] for name, key in names}
    user_keys = tuple(key for _, key in names)
    ours: dict[str, str] = {}
    notes: list[str] = []
    if ASYNC_ERROR_HANDLING not in user:
        ours[ASYNC_ERROR_HANDLING] = str(CLEAN_UP_ONLY)
    if DUMP_ON_TIMEOUT not in user:
        ours[DUMP_ON_TIMEOUT] = "0"
    dumping = user.get(DUMP_ON_TIMEOUT, "0").strip().lower() in _TRUE
    if WAIT_TIMEOUT_DUMP not in user and not dumping:
        ours[WAIT_TIMEOUT_DUMP] = str(DUMP_WAIT_MS)
    needed_s = math.ceil(watchdog_s + MARGIN_S)
    if HEARTBEAT_TIMEOUT not in user:
        ours[HEARTBEAT_TIMEOUT] = str(max(TORCH_DEFAULT_HEARTBEAT_S, needed_s))
    else:
        heartbeat = _int(user[HEARTBEAT_TIMEOUT], TORCH_DEFAULT_HEARTBEAT_S)
        if heartbeat is None or heartbeat < needed_s:
            notes.append(
                f"{HEARTBEAT_TIMEOUT}={user[HEARTBEAT_TIMEOUT]} (set by the user): torch may end a stuck "
                f"rank (SIGABRT) before commbench's watchdog ({watchdog_s:g} s) names it; use at least "
                f"{needed_s}"
            )
    blocking = user.get(BLOCKING_WAIT, "0").strip().lower() in _TRUE
    if blocking:
        notes.append(
            f"{BLOCKING_WAIT} (set by the user): every collective waits on the host, so timed iterations "
            "include host waits between launches"
        )
    mode = _int(user.get(ASYNC_ERROR_HANDLING), CLEAN_UP_ONLY)
    group_timeout_s = float(timeout_s)
    if mode is None:
        notes.append(f"{ASYNC_ERROR_HANDLING}={user[ASYNC_ERROR_HANDLING]} (set by the user): not an integer")
    elif mode in (1, 3) and not blocking:
        group_timeout_s = float(math.ceil(watchdog_s + MARGIN_S))
        notes.append(
            f"{ASYNC_ERROR_HANDLING}={mode} (set by the user) ends a rank whose collective times out: NCCL's "
            f"timeout is {group_timeout_s:g} s, after commbench's watchdog ({watchdog_s:g} s), which reports "
            "first; a peer's network error still ends the rank at once (SIGABRT)"
        )
    values = {**{key: environ[key] for key in user_keys}, **ours}
    return NcclErrorEnv(values, ours, user_keys, group_timeout_s, tuple(notes))


_APPLIED: NcclErrorEnv | None = None


def apply_nccl_error_env(
    timeout_s: float, watchdog_s: float, environ: MutableMapping[str, str] | None = None
) -> NcclErrorEnv:
    """Put commbench's NCCL settings (``nccl_error_env``) into this process's environment (``environ``:
    os.environ), before the NCCL process group is created (torch reads them then). Returns what is in
    effect, also kept for ``applied``."""
    global _APPLIED
    target = os.environ if environ is None else environ
    chosen = nccl_error_env(target, timeout_s, watchdog_s)
    target.update(chosen.set_by_commbench)
    _APPLIED = chosen
    return chosen


def applied() -> NcclErrorEnv | None:
    """The NCCL settings this process applied last (None: no NCCL process group was made here)."""
    return _APPLIED
