"""Error types. The CLI turns each into a one-line message and an exit code, never a traceback."""


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
