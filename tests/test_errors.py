"""The one error -> (exit code, stderr line) function, and COMMBENCH_DEBUG read as a switch."""

import pickle

import pytest

from commbench.errors import (
    CommError,
    StoppedError,
    UsageError,
    VerificationError,
    debug_enabled,
    error_line,
)


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (UsageError("bad --x\nsecond line"), 2, "commbench: error: bad --x second line"),
        (VerificationError("3 wrong"), 3, "commbench: error: 3 wrong"),
        (CommError("rank 2 died"), 4, "commbench: error: rank 2 died"),
        (StoppedError(15), 143, "commbench: stopped by SIGTERM"),
        (KeyboardInterrupt(), 130, "commbench: interrupted (SIGINT)"),
        (
            ValueError("boom\nTraceback ..."),
            1,
            "commbench: error: unexpected ValueError: boom (set COMMBENCH_DEBUG",
        ),
    ],
)
def test_every_error_is_one_line_and_its_exit_code(error, code, line):
    got_code, got_line = error_line(error)
    assert got_code == code and got_line.startswith(line) and "\n" not in got_line


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("ON", True), ("0", False),
                                           ("false", False), ("no", False), ("", False)])  # fmt: skip
def test_commbench_debug_is_a_switch(monkeypatch, value, on):
    monkeypatch.setenv("COMMBENCH_DEBUG", value)
    assert debug_enabled() is on


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (None, "stopped by SIGTERM"),
        ("stopped by SIGTERM; all 4 ranks were stopped", "stopped by SIGTERM"),
        ("rank 0: the launcher (pid 12) is gone", "the launcher (pid 12) is gone"),
        ("rank 3: stopped by SIGHUP\ntraceback", "stopped by SIGHUP"),
    ],
)
def test_a_stop_names_its_reason_without_who_was_stopped_or_what_was_kept(message, reason):
    error = StoppedError(15, message)
    assert error.reason == reason
    assert pickle.loads(pickle.dumps(error)).reason == reason  # as a spawned rank sends it
