"""How a spawned rank tells the launcher how it ended: over a pipe the launcher made for it (never a file by
path), its error as plain data (kind, type, message, exit code, signal, traceback text) rebuilt in the
launcher into commbench's own error types; and the temp folder refused where another user could swap files.

No file in a shared folder is ever read back as code: each rank's pipe is created by the launcher before the
rank starts and inherited by that rank alone, and the error arrives as a dict of strings and numbers. Only
rank 0's return value (None for a CLI launch; rows in the tests that drive ranks directly) rides the same
private pipe as a Python object.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from commbench.errors import CommbenchError, StoppedError, UsageError

MAX_TEXT = 64 * 1024  # an error's message or traceback in the outcome: a screen's worth is enough


class RankFailure(Exception):
    """A rank's error that is not one of commbench's own (a bug, a library's error), rebuilt from its data:
    ``type_name`` is the original exception type ("ImportError"), the message its text."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


def error_data(exc: BaseException, text: str) -> dict[str, Any]:
    """A rank's error as data: its type and the names of its bases (to rebuild the nearest known type),
    message, exit code, signal number and traceback text, each clipped."""
    return {
        "kind": "error",
        "type": type(exc).__name__,
        "bases": [klass.__name__ for klass in type(exc).__mro__],
        "message": str(exc)[:MAX_TEXT],
        "exit_code": int(getattr(exc, "exit_code", 1) or 1),
        "signum": getattr(exc, "signum", None),
        "traceback": text[-MAX_TEXT:],
    }


def _known_errors() -> dict[str, type[CommbenchError]]:
    found: dict[str, type[CommbenchError]] = {}
    pending: list[type[CommbenchError]] = [CommbenchError]
    while pending:
        klass = pending.pop()
        found.setdefault(klass.__name__, klass)
        pending.extend(klass.__subclasses__())
    return found


def rebuild_error(data: dict[str, Any]) -> BaseException:
    """The exception a rank's ``error_data`` describes: commbench's own type (the first of its bases this
    process knows), with its message, exit code and signal; anything else a ``RankFailure``."""
    message = str(data.get("message", ""))
    known = _known_errors()
    klass = next((known[name] for name in data.get("bases") or [] if name in known), None)
    if klass is None:
        return RankFailure(str(data.get("type", "Exception")), message)
    if issubclass(klass, StoppedError):
        signum = data.get("signum")
        return klass(int(signum) if isinstance(signum, int) else 15, message)
    error = klass.__new__(klass)
    Exception.__init__(error, message)
    code = data.get("exit_code")
    if isinstance(code, int) and code != klass.exit_code:
        error.exit_code = code
    return error


@dataclass
class OutcomeReader:
    """The launcher's end of one rank's pipe, drained by a thread as the rank runs (a large result must
    not block the rank in its send): ``outcome`` is ("ok", result, "") or ("error", exception, traceback),
    None while nothing (or nothing whole) arrived."""

    connection: Any
    outcome: tuple[str, Any, str] | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> OutcomeReader:
        self._thread = threading.Thread(target=self._read, name="commbench-outcome", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            message = self.connection.recv()
        except Exception:  # noqa: BLE001 - the rank died before (or while) sending: no outcome
            return
        if isinstance(message, dict) and message.get("kind") == "error":
            self.outcome = ("error", rebuild_error(message), str(message.get("traceback", "")))
        elif isinstance(message, tuple) and len(message) == 2 and message[0] == "ok":
            self.outcome = ("ok", message[1], "")

    def finish(self, wait_s: float = 2.0) -> tuple[str, Any, str] | None:
        """The outcome, after the rank's process is gone (its end of the pipe closed)."""
        if self._thread is not None:
            self._thread.join(wait_s)
        with contextlib.suppress(OSError):
            self.connection.close()
        return self.outcome


def send_outcome(connection: Any, rank: int, result: Any, error: BaseException | None, text: str) -> None:
    """A rank's end: its result or its error as data, once. A result that cannot be sent is sent as an
    error saying so; when nothing can be sent the rank says so on stderr (the launcher then reports it as
    ended without a result)."""
    message: Any = ("ok", result) if error is None else error_data(error, text)
    try:
        connection.send(message)
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be sent: say so instead
        try:
            fallback = error_data(RuntimeError(f"rank {rank} could not send its outcome: {exc}"), text)
            connection.send(fallback)
        except Exception as again:  # noqa: BLE001 - the launcher is gone: stderr is all that is left
            with contextlib.suppress(Exception):
                print(f"commbench: rank {rank} could not report its outcome: {again}", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            connection.close()


def check_temp_dir(folder: str | None = None) -> None:
    """UsageError when the temp folder (TMPDIR) can be written by other users and is not sticky: anyone
    could then remove or replace the files commbench keeps there while a run is live."""
    path = folder or tempfile.gettempdir()
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UsageError(
            f"the temp folder {path} cannot be used ({exc.strerror}); set TMPDIR to one"
        ) from exc
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UsageError(
            f"the temp folder {path} can be written by every user and is not sticky, so another user could "
            "swap commbench's files there; set TMPDIR to a folder of your own (or chmod +t it)"
        )


def format_exception(exc: BaseException) -> str:
    """The traceback text of ``exc`` (the one being handled)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
