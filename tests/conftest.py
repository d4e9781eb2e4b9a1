"""Session set-up for every test: the suite is run as a plain process, never as a task of the Slurm job (or
torchrun launch) it may be started in, whose variables would turn in-process launches into job ranks; and the
shared launches (tests/launches.py): each real multi-rank gloo run of the CLI that several tests read, started
once per session, on first use."""

from __future__ import annotations

import os

import pytest

from tests.launches import (
    BALANCED,
    PAIR_DELAY,
    PAIRWISE,
    SLOW_RANK,
    SLOW_RANK_US,
    SMALL_MODEL,
    Launch,
    launch,
)

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")


def pytest_configure() -> None:
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in _LAUNCH_VARIABLES or name == "MASTER_PORT":
            del os.environ[name]


@pytest.fixture(scope="session")
def balanced_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """BALANCED without a fault (exit 1 allowed: a busy host's straggler may be flagged)."""
    return launch(BALANCED, tmp_path_factory.mktemp("balanced"), codes=(0, 1))


@pytest.fixture(scope="session")
def slow_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """BALANCED with rank SLOW_RANK planted SLOW_RANK_US late before each timed call: FAIL, exit 1."""
    args = [*BALANCED, "--inject-delay", f"{SLOW_RANK}:{SLOW_RANK_US}"]
    return launch(args, tmp_path_factory.mktemp("slow-rank"), codes=(1,))


@pytest.fixture(scope="session")
def corrupt_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """BALANCED (window timing, its default) with one byte of every dispatch output corrupted: exit 3."""
    return launch([*BALANCED, "--corrupt", "dispatch"], tmp_path_factory.mktemp("corrupt"), codes=(3,))


@pytest.fixture(scope="session")
def pairwise_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The pairwise link test on 4 gloo ranks with the direction SLOW_PAIR planted slow: FAIL, exit 1."""
    args = [*PAIRWISE, "--inject-delay", PAIR_DELAY]
    return launch(args, tmp_path_factory.mktemp("pairwise"), codes=(1,))


@pytest.fixture(scope="session")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """A small MoE run on 2 gloo ranks, each its own NVLink domain of gb200-nvl72 (every link byte is
    scale-out), with the imbalance cost and the routing exported for nccl-tests (``<cwd>/moe.txt`` and
    ``moe.combine.txt``). Exit 1 allowed: a busy host's straggler may be flagged."""
    root = tmp_path_factory.mktemp("moe")
    (root / "small.yaml").write_text(SMALL_MODEL)
    args = ["run", "--model", str(root / "small.yaml"), "--skew", "zipf:1.2", "--tokens", "32"]
    args += ["--backend", "gloo", "--world-size", "2", "--warmup", "1", "--iters", "3"]
    args += ["--spec", "gb200-nvl72", "--ranks-per-domain", "1", "--imbalance-cost"]
    args += ["--nccl-tests-matrix", str(root / "moe.txt")]
    return launch(args, root, codes=(0, 1))


@pytest.fixture(scope="session")
def decode_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The decode case (``run --decode``: 128 tokens per rank, selection mode) of the small model on 2 gloo
    ranks; gloo cannot be captured, so it is timed per iteration. Exit 1 allowed: a busy host's
    straggler may be flagged."""
    root = tmp_path_factory.mktemp("decode")
    (root / "small.yaml").write_text(SMALL_MODEL)
    args = ["run", "--model", str(root / "small.yaml"), "--decode", "--backend", "gloo", "--world-size", "2"]
    args += ["--warmup", "1", "--iters", "3"]
    return launch(args, root, codes=(0, 1))
