"""The launch's memory estimate of one-sided backends against what they really allocate: shmem-emu's heap
file on real gloo ranks, for skewed patterns (the busiest rank sizes every rank's heap), and the NVSHMEM
backend's (on CPU stand-ins: tests/backends/shmem/test_nvshmem.py)."""

from __future__ import annotations

from typing import Any

import pytest

from commbench.backends.shmem import emu
from commbench.backends.shmem.emu import ShmemEmuBackend
from commbench.cli import resources
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.run import dist
from commbench.run.config import RunOptions
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.traffic.pattern import build_pattern
from commbench.traffic.routing import RoutingConfig

TINY = ModelConfig(name="tiny", hidden=64, num_experts=16, topk=4, dispatch_dtype="fp8", scale_block=32)
WORLD = 4
TIMEOUT_S = 60.0
# Skews that put far more rows on one rank than the mean, and the widest signal option next to the default.
CASES = [
    ("rank-imbalance:4", "token", {}),
    ("rank-imbalance:3", "selection", {"chunk_rows": 1, "signal_op": "set"}),
    ("hot:1:0.25", "selection", {"signal": "segment"}),
]


def _job(skew: str, mode: str) -> MoeJob:
    cfg = RoutingConfig(model=TINY, skew=parse_skew(skew), world_size=WORLD, tokens_per_rank=64, seed=3)
    return MoeJob(name=f"tiny {skew}", routing=cfg, send_mode=mode, warmup=0, iters=1)


BALANCED = BalancedJob(name="balanced", sizes=[256, 64 << 10], warmup=0, iters=1)


def _heap_files(comm: Any) -> list[list[int]]:
    """Runs on every rank: each case through the harness (imbalance-cost reference included); the bytes of
    every shared heap file the emulator creates (rank 0 creates it: world x one PE's region)."""
    created: list[int] = []
    real = emu.SharedHeap.__init__

    def recording(self: Any, path: str, world_size: int, pe_bytes: int, create: bool) -> None:
        if create:
            created.append(world_size * pe_bytes)
        real(self, path, world_size, pe_bytes, create)

    emu.SharedHeap.__init__ = recording  # type: ignore[method-assign]
    sizes = []
    for skew, mode, options in CASES:
        created.clear()
        opts = RunOptions("shmem-emu", options, TIMEOUT_S, imbalance_cost=True)
        run_jobs(comm, [_job(skew, mode)], opts, ShmemEmuBackend)
        sizes.append(list(created))
    created.clear()
    run_jobs(comm, [BALANCED], RunOptions("shmem-emu", {}, TIMEOUT_S), ShmemEmuBackend)
    sizes.append(list(created))
    return sizes


@pytest.fixture(scope="module")
def allocated() -> list[list[int]]:
    return dist.launch(WORLD, _heap_files, (), process_group="gloo", timeout_s=TIMEOUT_S)


def test_the_skews_put_more_rows_on_one_rank_than_the_mean() -> None:
    for skew, mode, _ in CASES:
        rows = build_pattern(_job(skew, mode).routing, mode).dispatch_rows
        busiest = max(rows.sum(axis=0).max(), rows.sum(axis=1).max())
        assert busiest > 1.3 * rows.sum() / WORLD, skew  # what a mean-based estimate misses


def test_shmem_emu_heap_is_never_above_the_estimate(allocated: list[list[int]]) -> None:
    """Every heap file of every case (the skewed job's and its imbalance-cost reference's) within the
    estimate's heap summed over the ranks (each rank holds one region of the file)."""
    jobs = [_job(skew, mode) for skew, mode, _ in CASES]
    for job, files in zip(jobs, allocated[: len(jobs)], strict=True):
        estimate = resources.job_memory(job, WORLD, True, ShmemEmuBackend)
        assert files and estimate.symmetric > 0
        assert max(files) <= WORLD * estimate.symmetric, (job.name, files, estimate.symmetric)
        # What the estimate used to count for these buffers, at the mean rows (send, receive and returned
        # rows plus one more receive side), falls short of the file: the busiest rank sizes every region.
        mean = build_pattern(job.routing, job.send_mode).dispatch_rows.sum() / WORLD
        dispatch, combine = TINY.dispatch_bytes_per_token, TINY.combine_bytes_per_token
        assert WORLD * mean * (3 * dispatch + 2 * combine) < max(files), job.name
    estimate = resources.job_memory(BALANCED, WORLD, False, ShmemEmuBackend)
    assert allocated[-1] and max(allocated[-1]) <= WORLD * estimate.symmetric


def test_the_estimate_counts_the_busiest_rank_not_the_mean() -> None:
    job = _job("rank-imbalance:4", "token")
    one_sided = resources.job_memory(job, WORLD, False, ShmemEmuBackend)
    rows = build_pattern(job.routing, job.send_mode).dispatch_rows
    row_bytes = TINY.dispatch_bytes_per_token
    # The busiest rank's receive buffer, both sides, is in every rank's heap: above what the mean would give.
    assert one_sided.symmetric >= 2 * int(rows.sum(axis=0).max()) * row_bytes
    assert one_sided.symmetric > 2 * (rows.sum() / WORLD) * row_bytes * 1.4
