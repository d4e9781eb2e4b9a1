"""Given [src][dst] byte matrices (MatrixJob): the plans, the checks, and real gloo runs of odd matrices."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError, VerificationError
from commbench.run.config import RunOptions
from commbench.run.dist import launch
from commbench.run.harness import run_jobs
from commbench.run.jobs import MatrixCall, MatrixJob
from commbench.run.matrix import matrix_pattern, matrix_plans
from commbench.run.rows import byte_columns

# Three ranks; rows of 3 bytes (no row header), a call that moves nothing, and wide rows with a silent pair.
ODD = np.array([[3, 6, 0], [9, 0, 3], [0, 12, 15]], dtype=np.int64)
ZERO = np.zeros((3, 3), dtype=np.int64)
WIDE = np.array([[8192, 4096, 0], [0, 12288, 4096], [4096, 4096, 4096]], dtype=np.int64)
CALLS = [MatrixCall("call 0 odd", ODD), MatrixCall("call 1 nothing", ZERO), MatrixCall("call 2 wide", WIDE)]


def test_row_bytes_are_the_gcd_of_the_entries() -> None:
    assert [call.row_bytes for call in CALLS] == [3, 8, 4096]
    plans = matrix_plans(WIDE, 4096)
    assert [plan.send_counts.view(-1).tolist() for plan in plans] == [[2, 1, 0], [0, 3, 1], [1, 1, 1]]
    assert [plan.static_recv_counts.view(-1).tolist() for plan in plans] == [[2, 0, 1], [1, 3, 1], [0, 1, 1]]
    assert plans[1].send_token_index.tolist() == [0, 1, 2, 3] and plans[1].send_key.tolist() == [1, 1, 1, 2]
    pattern = matrix_pattern("m", CALLS[2])
    np.testing.assert_array_equal(pattern.dispatch_bytes, WIDE)
    assert pattern.dispatch_tokens.sum() == 10 and not pattern.combine_bytes.any()


def test_bad_matrices_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="run it with --world-size 3"):
        MatrixJob("m", [CALLS[0]]).check(4)
    with pytest.raises(UsageError, match="whole numbers >= 0"):
        MatrixJob("m", [MatrixCall("c", -ODD)]).check(3)
    with pytest.raises(UsageError, match="no all-to-all call"):
        MatrixJob("m", []).check(3)
    huge = np.array([[1 << 40, 1], [1, 1]], dtype=np.int64)  # rows of one byte: 2^40 of them
    with pytest.raises(UsageError, match="more than 2147483647"):
        MatrixJob("m", [MatrixCall("c", huge)]).check(2)


class MovedBytes(TorchDistBackend):
    """gloo, recording per set-up plan the bytes this rank received from each source."""

    moved: ClassVar[list[list[int]]] = []

    def dispatch(self, tokens, plan, recv_counts):
        received = super().dispatch(tokens, plan, recv_counts)
        MovedBytes.moved.append((recv_counts.sum(dim=1) * plan.dispatch_row_bytes).tolist())
        return received


def matrix_entry(comm, jobs, every):
    """Run ``jobs``, then ``every`` with each timed iteration verified, then ``jobs`` again with a corrupted
    byte on rank 0 (caught here, with its rows)."""
    rows, _ = run_jobs(comm, jobs, RunOptions("gloo"), MovedBytes)
    moved = comm.all_gather_object(MovedBytes.moved[-1])  # the last call each rank ran
    rows += run_jobs(comm, every, RunOptions("gloo", check="every"), MovedBytes)[0]
    written: list[dict] = []
    try:
        corrupting = RunOptions("gloo", corrupt="dispatch")
        run_jobs(comm, jobs, corrupting, MovedBytes, sink=lambda r, _: written.extend(r))
        caught = None
    except VerificationError as exc:
        caught = str(exc)
    return rows, moved, caught, [(row["phase"], row["wrong"]) for row in written]


def test_gloo_moves_and_verifies_every_call() -> None:
    jobs = [MatrixJob("m", CALLS, warmup=1, iters=3)]
    every = [MatrixJob("every", CALLS[2:], warmup=1, iters=3, timing="iteration")]
    rows, moved, caught, corrupted = launch(
        3, matrix_entry, (jobs, every), process_group="gloo", timeout_s=60
    )
    assert [row["phase"] for row in rows] == [call.name for call in CALLS + CALLS[2:]]
    for row, call in zip(rows[:3], CALLS, strict=True):
        assert row["pattern"] == "m" and row["wrong"] == 0 and row["row_bytes"] == call.row_bytes
        assert (row["timing"], row["check"]) == ("window", "window-last")
        assert {key: row[key] for key in byte_columns(call.matrix)} == byte_columns(call.matrix)
    assert np.array(moved).T.tolist() == WIDE.tolist()  # rank dst received matrix[src][dst] from each src
    assert [(r["pattern"], r["timing"], r["check"], r["wrong"]) for r in rows[3:]] == [
        ("every", "iteration", "every", 0)
    ]
    # The hook flips the last byte of rank 0's first received row: one wrong byte in each call that gives
    # rank 0 anything, and the run says which.
    assert corrupted == [("call 0 odd", 1), ("call 1 nothing", 0), ("call 2 wide", 1)]
    assert caught is not None and "call 0 odd #wrong=1" in caught and "call 2 wide #wrong=1" in caught
