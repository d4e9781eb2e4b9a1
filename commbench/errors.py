"""Error types. The CLI turns each into a one-line message and an exit code, never a traceback.

Exit codes: 0 pass, 1 fail (a bug: unexpected error), 2 bad input or could not run, 3 wrong data, 4 a rank
died or timed out, 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP).
"""

import re
import signal


class CommbenchError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(CommbenchError):
    """Bad input from the user: the message names the problem and the fix."""

    exit_code = 2


class VerificationError(CommbenchError):
    """Received data did not match what was sent (nccl-tests' #wrong > 0)."""

    exit_code = 3


class CommError(CommbenchError):
    """A collective timed out or a peer rank died."""

    exit_code = 4


def signal_name(signum: int) -> str:
    """ "SIGTERM" for 15; "signal 64" for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StoppedError(CommbenchError):
    """The run was stopped by a signal (to the launcher or to this rank): exit code 128 + the signal number.

    ``signum`` is the signal; the message says who was stopped and what was kept.
    """

    def __init__(self, signum: int, message: str | None = None) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message or f"stopped by {signal_name(self.signum)}")

    @property
    def reason(self) -> str:
        """Why the run stopped, without who was stopped or what was kept: "stopped by SIGTERM", or "the
        launcher (pid 12) is gone" (a spawned rank told by its parent's death)."""
        text = first_line(self) or f"stopped by {signal_name(self.signum)}"
        return re.sub(r"^rank \d+: ", "", text).split(";")[0].strip()

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        # Pickled from a spawned rank to the launcher: rebuild with the signal, not just the message.
        return (type(self), (self.signum, str(self)))


def first_line(text: object) -> str:
    """The first non-blank line of ``text``, stripped: a failed rank's message carries its whole traceback
    after its first line."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def one_line(text: object) -> str:
    """Every line of ``text`` joined into one."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def error_line(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one stderr line of an error that ends a command (the one place that decides
    both; click's own usage errors are turned into ``UsageError`` by the command group first)."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT, "commbench: interrupted (SIGINT)"
    if isinstance(exc, StoppedError):  # not a failure of the run: it was told to stop
        return exc.exit_code, f"commbench: {one_line(exc)}"
    if isinstance(exc, CommbenchError):
        return exc.exit_code, f"commbench: error: {one_line(exc)}"
    hint = "(set COMMBENCH_DEBUG=1 for the traceback)"
    return 1, f"commbench: error: unexpected {type(exc).__name__}: {first_line(exc)} {hint}"


def debug_enabled() -> bool:
    """COMMBENCH_DEBUG=1 (or true/yes/on): errors keep their tracebacks. "0", "false", "no", "off" and "" do
    not turn it on."""
    import os

    return os.environ.get("COMMBENCH_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
