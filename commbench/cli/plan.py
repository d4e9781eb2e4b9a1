"""What the launching process hands to every rank of a ``run`` or ``suite`` launch (``LaunchPlan``), and how a
launch that ended early names its reason in the report."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from commbench.errors import StoppedError, VerificationError, first_line

if TYPE_CHECKING:
    from commbench.cli.acceptance import Acceptance
    from commbench.inputs.specs import SystemSpec
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
    out_claim: str | None = None  # the token of the launcher's claim on out_dir (report.claim_out_dir)
    resume: bool = False  # out_dir is an interrupted run's folder: skip its finished cases, append
    acceptance: Acceptance | None = None  # what the verdict judges by (None: no verdict, unit tests)

    @property
    def soak_s(self) -> float | None:
        """--soak: the jobs round after round for this long (None: once)."""
        return self.config.suite.soak_s


def incomplete_reason(exc: BaseException) -> str | None:
    """Why a run that ended with ``exc`` left an incomplete report (one line), or None when the report is
    as complete as the run meant it to be (wrong data: the failing job's rows say so, and the run stops)."""
    if isinstance(exc, VerificationError):
        return None
    text = first_line(exc) or type(exc).__name__
    if isinstance(exc, StoppedError):  # "stopped by SIGTERM", "the launcher (pid 12) is gone"
        return re.sub(r"^rank \d+: ", "", text).split(";")[0]
    return text
