"""Session set-up for every test: the suite is run as a plain process, never as a task of the Slurm job (or
torchrun launch) it may be started in, whose variables would turn in-process launches into job ranks."""

from __future__ import annotations

import os

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")


def pytest_configure() -> None:
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in _LAUNCH_VARIABLES or name == "MASTER_PORT":
            del os.environ[name]
