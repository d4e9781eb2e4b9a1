"""What the launching process hands to every rank of a ``run`` or ``suite`` launch (``LaunchPlan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commbench.cli.acceptance import Acceptance
    from commbench.inputs.specs import SystemSpec
    from commbench.report import OutDirClaim
    from commbench.run.config import RunConfig, RunOptions
    from commbench.run.jobs import Job
    from commbench.run.pairwise import PairwiseJob


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a rank needs (it must pickle): the checked config, the jobs, the harness's options with the
    backend resolved, the spec the report compares with, and where the report goes."""

    config: RunConfig
    jobs: list[Job]
    options: RunOptions  # config.harness with the resolved backend and its fixed knobs
    spec: SystemSpec  # what the report compares with
    out_dir: str
    meta: dict[str, Any]
    total_steps: int
    swept_keys: tuple[str, ...] = ()  # knobs a --backend-option sweep varies (named in progress lines)
    pairwise: PairwiseJob | None = None  # the pairwise link test, after the jobs (None: not run)
    out_claim: OutDirClaim | None = None  # the launcher's claim on out_dir (report.claim_out_dir)
    resume: bool = False  # out_dir is an interrupted run's folder: skip its finished cases, append
    acceptance: Acceptance | None = None  # what the verdict judges by (None: no verdict, unit tests)

    @property
    def soak_s(self) -> float | None:
        """--soak: the jobs round after round for this long (None: once)."""
        return self.config.suite.soak_s
