"""One launch for ``run`` and ``suite``: everything a launch needs is checked in the parent (spec, layout
overrides, backend, its options, report folder), then every rank runs the jobs and rank 0 writes the report
as phases finish, prints a progress line per phase and the results table.

Every call into the harness (``commbench.run``) and the report (``commbench.report``) for a launch is here.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import commbench
from commbench.cli.options import DEFAULT_ITERS, DEFAULT_WARMUP, QUICK_ITERS, QUICK_WARMUP
from commbench.errors import StoppedError

if TYPE_CHECKING:
    from commbench.backends.options import OptionSweep
    from commbench.cli.acceptance import Acceptance
    from commbench.inputs.specs import SystemSpec
    from commbench.report import OutDirClaim
    from commbench.run.jobs import Job, RunOptions
    from commbench.run.pairwise import PairwiseJob
    from commbench.traffic.routing import RoutingConfig

DEFAULT_REPORTS_DIR = "reports"
_DEFAULT_OUT_TRIES = 100  # runs starting in the same second each take the next -N suffix


@dataclass(frozen=True)
class LaunchSettings:
    """Where and how the jobs of ``run`` or ``suite`` run: their shared options (``cli.options``), with the
    world size and the defaults resolved."""

    world_size: int
    backend: str  # as requested: auto, nccl, gloo, ...
    warmup: int
    iters: int
    timeout_s: float
    out: str | None
    spec_text: str | None  # --spec; None: chosen from the detected GPUs (cli.acceptance)
    ranks_per_domain: int | None
    ranks_per_host: int | None
    imbalance_cost: bool
    check_mode: str  # --check: how the timed iterations are verified (RunOptions.check_mode)
    timing: str | None  # --timing: every job's (jobs.TIMINGS), or None for each kind's default
    inject_delay: tuple[tuple[int, float], ...] = ()  # --inject-delay RANK:US (test hook): (rank, seconds)
    pair_delay: tuple[tuple[int, int, float], ...] = ()  # --inject-delay SRC-DST:US: (src, dst, seconds)
    pair_bytes: int | None = None  # --pair-bytes: the pairwise test's message size (None: the limits')
    limits_file: str | None = None  # --limits FILE: acceptance limits over the spec's shipped ones
    limit_overrides: tuple[str, ...] = ()  # --limit KEY=VALUE
    baseline_file: str | None = None  # --baseline FILE: each case also judged against it
    resume: str | None = None  # --resume DIR: continue that interrupted run in its own folder
    profile: bool = False  # --profile (run.profile): steps, arrivals on one clock
    trace: bool = False  # --trace: trace.json of every rank (implies profile)
    torch_profiler: bool = False  # --torch-profiler: Kineto capture of the timed iterations
    tflops: float | None = None  # --tflops: the comm/compute budget's per-GPU throughput

    @classmethod
    def from_params(cls, params: dict[str, Any], quick: bool = False) -> LaunchSettings:
        """Takes (pops) the shared options out of a command's click parameters; UsageError without a world
        size outside torchrun, or one that differs from torchrun's, and for --check every with --timing
        window."""
        from commbench.errors import UsageError
        from commbench.run.dist import resolve_world_size

        values = {field.name: params.pop(field.name) for field in fields(cls) if field.name != "pair_delay"}
        delays = tuple(values.get("inject_delay") or ())  # RANK:US and SRC-DST:US, told apart by length
        values["inject_delay"] = tuple(item for item in delays if len(item) == 2)
        values["pair_delay"] = tuple(item for item in delays if len(item) == 3)
        values["limit_overrides"] = tuple(values.get("limit_overrides") or ())
        if values["check_mode"] == "every" and values["timing"] == "window":
            raise UsageError("--check every needs --timing iteration")
        values["profile"] = bool(values["profile"] or values["trace"])
        if values["profile"]:  # steps are resolved after each call's synchronize: one call per timed region
            if values["timing"] == "window":
                raise UsageError(
                    "--profile and --trace time every iteration on its own: drop --timing window"
                )
            values["timing"] = "iteration"
        values["world_size"] = resolve_world_size(values["world_size"])
        if values["warmup"] is None:
            values["warmup"] = QUICK_WARMUP if quick else DEFAULT_WARMUP
        if values["iters"] is None:
            values["iters"] = QUICK_ITERS if quick else DEFAULT_ITERS
        return cls(**values)


def job_timing(settings: LaunchSettings, kind_default: str) -> str:
    """--timing if given, else the job kind's default; --check every (each timed iteration verified) turns a
    window default into iteration timing."""
    if settings.timing is not None:
        return settings.timing
    return "iteration" if settings.check_mode == "every" else kind_default


def moe_job(cfg: RoutingConfig, send_mode: str, settings: LaunchSettings) -> Job:
    """An MoE case: dispatch and combine of ``cfg``'s routing."""
    from commbench.run.jobs import MoeJob

    timing = job_timing(settings, MoeJob.timing)
    return MoeJob(cfg.model.name, cfg, send_mode, warmup=settings.warmup, iters=settings.iters, timing=timing)


def balanced_job(sizes: list[int], settings: LaunchSettings) -> Job:
    """A balanced all-to-all size sweep (nccl-tests alltoall)."""
    from commbench.run.jobs import BalancedJob

    timing = job_timing(settings, BalancedJob.timing)
    return BalancedJob("balanced", sizes, warmup=settings.warmup, iters=settings.iters, timing=timing)


def _phases(job: Job) -> int:
    """Result rows a job writes (progress steps): one per size or trace call, or dispatch + combine."""
    if job.kind == "matrix":
        return len(job.calls)
    return len(job.sizes) if job.kind == "balanced" else 2


def default_out_dir(base: str | os.PathLike[str] = DEFAULT_REPORTS_DIR) -> Path:
    """reports/<UTC timestamp>/, with a -2, -3, ... suffix if that folder already exists."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    candidate = Path(base) / stamp
    suffix = 2
    while candidate.exists():
        candidate = Path(base) / f"{stamp}-{suffix}"
        suffix += 1
    return candidate


@dataclass
class LaunchPlan:
    """What the parent hands to every rank (must pickle)."""

    jobs: list[Job]
    options: RunOptions
    spec: SystemSpec  # what the report compares with
    out_dir: str
    meta: dict[str, Any]
    total_steps: int
    swept_keys: tuple[str, ...] = ()  # knobs a --backend-option sweep varies (named in progress lines)
    pairwise: PairwiseJob | None = None  # the pairwise link test, after the jobs (None: not run)
    soak_s: float | None = None  # --soak: the jobs round after round for this long (None: once)
    trace: bool = False  # --trace: rank 0 writes trace.json of every profiled phase
    torch_profiler: bool = False  # --torch-profiler: every rank writes kineto/rank<R>.json
    tflops: float | None = None  # --tflops: the comm/compute budget's throughput (None: the default)
    out_claim: str | None = None  # the token of the launcher's claim on out_dir (report.claim_out_dir)
    resume: bool = False  # out_dir is an interrupted run's folder: skip its finished cases, append
    acceptance: Acceptance | None = None  # what the verdict judges by (None: no verdict, unit tests)


def launch(
    command: str,
    settings: LaunchSettings,
    jobs: list[Job],
    args: dict[str, Any],
    option_pairs: Sequence[str] | None = None,
    corrupt: str | None = None,
    pairwise: bool = False,
    soak_s: float | None = None,
) -> None:
    """Check everything in the parent, run ``jobs`` on every rank (then the pairwise link test when
    ``pairwise``), write the report folder.

    ``args`` are the command's own arguments for meta.json (the shared ones are added here);
    ``option_pairs`` the ``--backend-option`` pairs of a command that takes them (None: it does not);
    ``soak_s``: run the jobs round after round for that many seconds (suite --soak).
    UsageError (one line, nothing launched or written) on bad input.
    """
    from commbench.backends import get_backend
    from commbench.cli.acceptance import Acceptance, choose_report_spec
    from commbench.cli.worker import launch_worker
    from commbench.run import dist
    from commbench.run.jobs import RunOptions

    world = settings.world_size
    _check_layout(settings)
    backend, reason, sweep = _choose_backend(settings, option_pairs or ())
    system, spec_how, judged_spec = choose_report_spec(settings.spec_text, backend)
    acceptance = Acceptance(
        judged_spec, spec_how, settings.limits_file, settings.limit_overrides, settings.baseline_file
    )
    acceptance.check()  # limits and baseline files: one line, exit 2, before anything starts
    fixed = sweep.fixed
    knob_settings = sweep.settings()
    if knob_settings != [{}]:  # setting outermost: each setting's backend is built once
        jobs = [replace(job, backend_options=dict(setting)) for setting in knob_settings for job in jobs]
    shared = {"world_size": world, "backend": backend}
    if option_pairs is not None:
        shared.update(backend_options={**fixed, **sweep.swept}, knob_settings=len(knob_settings))
    shared.update(
        warmup=settings.warmup,
        iters=settings.iters,
        timeout_s=settings.timeout_s,
        spec=settings.spec_text,  # None: chosen from the hardware (meta.json's acceptance says how)
        ranks_per_domain=settings.ranks_per_domain,
        ranks_per_host=settings.ranks_per_host,
        imbalance_cost=settings.imbalance_cost,
        check=settings.check_mode,
        timing=settings.timing,  # None: each kind's default (the rows' timing column says which ran)
        profile=settings.profile,
        trace=settings.trace,
        torch_profiler=settings.torch_profiler,
        tflops=settings.tflops,
    )
    if settings.inject_delay or settings.pair_delay:  # a planted fault: the report must say so
        shared["inject_delay_us"] = {
            **{str(rank): seconds * 1e6 for rank, seconds in settings.inject_delay},
            **{f"{src}-{dst}": seconds * 1e6 for src, dst, seconds in settings.pair_delay},
        }
    link_test = None
    if pairwise:
        from commbench.cli.linktest import pairwise_job

        link_test = pairwise_job(
            settings.pair_bytes, settings.warmup, settings.iters, acceptance, world, backend, not jobs
        )
    if link_test is not None:
        shared["pairwise"] = {
            "bandwidth_bytes": link_test.bandwidth_bytes,
            "latency_bytes": link_test.latency_bytes,
            "warmup": link_test.warmup,
            "iters": link_test.iters,
        }
    options = RunOptions(
        backend=backend,
        backend_options=fixed,
        timeout_s=settings.timeout_s,
        corrupt=corrupt,
        ranks_per_domain=settings.ranks_per_domain,
        ranks_per_host=settings.ranks_per_host,
        imbalance_cost=settings.imbalance_cost,
        check_mode=settings.check_mode,
        inject_delay=settings.inject_delay,
        pair_delay=settings.pair_delay,
        profile=settings.profile,
    )
    options.check(world)  # a rank out of range in --inject-delay, before anything starts
    if settings.limits_file or settings.limit_overrides or settings.baseline_file:
        shared.update(
            limits=settings.limits_file, limit=list(settings.limit_overrides), baseline=settings.baseline_file
        )
    meta = _run_meta(command, {**args, **shared}, reason)
    meta["acceptance"] = acceptance.to_meta()
    if settings.resume:
        out_dir, out_claim, meta, total = _prepare_resume(settings, command, meta, jobs)
    else:
        out_dir, out_claim = _prepare_out(settings.out)
        total = sum(_phases(job) for job in jobs)
    if dist.is_rank0_process():
        swept = f"; {len(knob_settings)} knob settings ({sweep.describe()})" if sweep.swept else ""
        resumed = " (resumed: its finished cases are skipped)" if settings.resume else ""
        click.echo(
            f"commbench {command}: backend {reason}; {world} ranks; spec {system.name} ({spec_how}){swept}; "
            f"{total} cases; report folder {out_dir}{resumed}",
            err=True,
        )
    token = out_claim.token if out_claim is not None else None
    plan = LaunchPlan(
        jobs,
        options,
        system,
        out_dir,
        meta,
        total,
        tuple(sweep.swept),
        out_claim=token,
        acceptance=acceptance,
        resume=bool(settings.resume),
        pairwise=link_test,
        soak_s=soak_s,
        trace=settings.trace,
        torch_profiler=settings.torch_profiler,
        tflops=settings.tflops,
    )
    try:
        dist.launch(world, launch_worker, (plan,), get_backend(backend).process_group, settings.timeout_s)
    except BaseException as exc:
        # A launch that failed before rank 0 wrote anything leaves no empty report folder behind; one that
        # wrote rows leaves them, marked INCOMPLETE (here if rank 0 was killed before it could say so).
        kept = (
            _finish_partial_report(out_dir, out_claim, exc, acceptance) if dist.is_rank0_process() else None
        )
        error = StoppedError(exc.signum, f"{exc}; {kept}") if isinstance(exc, StoppedError) and kept else exc
        if dist.is_rank0_process():
            _verdict_last(out_dir, error)
        if error is not exc:
            raise error from exc
        raise
    if dist.is_rank0_process():
        _verdict_last(out_dir, None)


def _verdict_last(out_dir: str, error: BaseException | None) -> None:
    """The console's last line: the verdict with the report path (after the error line of a failed run),
    and the verdict's exit code (click.exceptions.Exit: the error line is already out)."""
    from commbench.cli.main import exit_code_and_message
    from commbench.errors import CommbenchError
    from commbench.report import saved_verdict
    from commbench.report.judge.verdict import console_line

    try:
        verdict = saved_verdict(out_dir) if Path(out_dir).is_dir() else None
    except CommbenchError:
        verdict = None
    if error is None:
        if verdict is None:
            click.echo(f"commbench: report written to {out_dir}")
            return
        click.echo(console_line(verdict, out_dir))
        if verdict.exit_code:
            raise click.exceptions.Exit(verdict.exit_code)
        return
    if verdict is None:
        return  # nothing was judged (nothing ran): the error line alone
    code, message = exit_code_and_message(error)
    click.echo(message, err=True)
    click.echo(console_line(verdict, out_dir))
    raise click.exceptions.Exit(code)


def incomplete_reason(exc: BaseException) -> str | None:
    """Why a run that ended with ``exc`` left an incomplete report (one line), or None when the report is
    as complete as the run meant it to be (wrong data: the failing job's rows say so, and the run stops)."""
    from commbench.errors import VerificationError

    if isinstance(exc, VerificationError):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    if isinstance(exc, StoppedError):  # "stopped by SIGTERM", "the launcher (pid 12) is gone"
        return re.sub(r"^rank \d+: ", "", text).split(";")[0]
    return text


def _finish_partial_report(
    out_dir: str, out_claim: OutDirClaim | None, exc: BaseException, acceptance: Acceptance | None = None
) -> str | None:
    """After a failed or stopped launch, in the launcher (or rank 0 under torchrun): release a report folder
    nothing was written to, else make sure it says INCOMPLETE. Returns where the finished rows are, or
    None."""
    import json

    from commbench.report import ReportWriteError, mark_incomplete

    if out_claim is not None and out_claim.release_if_unused():
        return None
    meta_path = Path(out_dir) / "meta.json"
    reason = incomplete_reason(exc)
    if reason is None or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        # Rank 0 did not get to it, or knew less (it was stopped because another rank failed).
        saved = str(meta.get("incomplete_reason", ""))[:200]  # the report clips a long reason
        if meta.get("status") != "incomplete" or saved != " ".join(reason.split())[:200]:
            mark_incomplete(out_dir, reason, _judge(acceptance, exc))
    except ReportWriteError:  # the full disk that ended the run: its one error line says so already
        return None
    except Exception as error:  # noqa: BLE001 - never mask the error that ended the run
        click.echo(f"commbench: could not mark the partial report incomplete: {error}", err=True)
        return None
    return f"what finished is in {out_dir} (marked INCOMPLETE)"


def _choose_backend(settings: LaunchSettings, option_pairs: Sequence[str]) -> tuple[str, str, OptionSweep]:
    """(backend, why it was chosen, its --backend-option values; sim's over the report's spec and layout):
    the backend's own availability check, the device check, every knob setting's ``check_options``."""
    from commbench.backends import get_backend
    from commbench.backends.options import parse_option_sweep
    from commbench.run.dist import check_group_devices, resolve_backend

    if settings.backend != "auto":
        # The backend's own pre-launch check (nvshmem: "needs GPUs and NVSHMEM"), before the device count.
        check_available = getattr(get_backend(settings.backend), "check_available", None)
        if callable(check_available):
            check_available()
    backend, reason = resolve_backend(settings.backend, settings.world_size)
    backend_class = get_backend(backend)
    check_group_devices(backend_class.process_group, settings.world_size, backend)  # nccl: a GPU per rank
    sweep = parse_option_sweep(backend, backend_class.OPTIONS, option_pairs)
    fixed = _with_report_layout(sweep.fixed, settings) if backend_class.models_report_layout else sweep.fixed
    for setting in sweep.settings():  # a bad value in any setting of a sweep fails now, not in the ranks
        backend_class.check_options({**fixed, **setting}, world_size=settings.world_size)
    return backend, reason, replace(sweep, fixed=fixed)


def _check_layout(settings: LaunchSettings) -> None:
    """The layout overrides' nesting and sizes checked; UsageError otherwise."""
    from commbench.inputs.layout import build_layout

    build_layout(settings.world_size, settings.ranks_per_domain, settings.ranks_per_host)


def _judge(acceptance: Acceptance | None, error: BaseException | None) -> Any:
    """The report's judge for a run that ended with ``error`` (None: it finished), or None."""
    if acceptance is None:
        return None
    from commbench.cli.acceptance import make_judge
    from commbench.report.judge.verdict import run_status_from_error

    return make_judge(acceptance, run_status_from_error(error))


def _with_report_layout(options: dict[str, Any], settings: LaunchSettings) -> dict[str, Any]:
    """A backend that models the report's system and layout (``models_report_layout``: sim) gets them as
    options, unless its own options say otherwise."""
    from commbench.inputs.specs import DEFAULT_SPEC_NAME

    # sim needs figures to model: with no --spec it models the catalogue's default system.
    merged = {"spec": settings.spec_text or DEFAULT_SPEC_NAME, **options}
    if settings.ranks_per_domain is not None:
        merged.setdefault("ranks_per_domain", settings.ranks_per_domain)
    if settings.ranks_per_host is not None:
        merged.setdefault("ranks_per_host", settings.ranks_per_host)
    return merged


def _prepare_resume(
    settings: LaunchSettings, command: str, meta: dict[str, Any], jobs: list[Job]
) -> tuple[str, OutDirClaim | None, dict[str, Any], int]:
    """--resume DIR on rank 0: the folder checked (an INCOMPLETE run of this command with these options)
    and taken over; (folder, claim, its meta.json for this run, phases left). Other ranks: (folder, None,
    meta, 0); rank 0 tells them the jobs left inside the launch."""
    from commbench.cli.resume import check_same_run, read_interrupted, remaining_jobs, resumed_meta
    from commbench.errors import UsageError
    from commbench.report.folder.claim import take_over_out_dir
    from commbench.run.dist import is_rank0_process

    folder = str(settings.resume)
    if settings.out:
        raise UsageError("--resume DIR writes into DIR: leave out --out")
    if not is_rank0_process():
        return folder, None, meta, 0
    saved, results = read_interrupted(folder)
    check_same_run(folder, saved, command, meta["args"])
    left, kept = remaining_jobs(jobs, results)
    if not left:
        raise UsageError(f"--resume {folder}: every case already finished; render it with commbench report")
    merged = {**resumed_meta(saved, kept), **{key: meta[key] for key in ("argv", "command", "acceptance")}}
    return folder, take_over_out_dir(folder), merged, sum(_phases(job) for job in left)


def _prepare_out(out: str | None) -> tuple[str, OutDirClaim | None]:
    """Claim (on rank 0) the report folder before launching: created exclusively, or an existing empty one
    claimed by its marker, so two runs given the same --out cannot both take it (UsageError for the
    second, and for a folder that is not new or empty). Without --out: the next free reports/<UTC time>."""
    from commbench.errors import UsageError
    from commbench.report import OutDirTaken, claim_out_dir
    from commbench.run.dist import is_rank0_process

    if not is_rank0_process():
        return str(Path(out) if out else default_out_dir()), None
    if out:
        claim = claim_out_dir(out)
        return str(claim.path), claim
    for _ in range(_DEFAULT_OUT_TRIES):
        try:
            claim = claim_out_dir(default_out_dir())
        except OutDirTaken:  # another run took this second's folder between the check and the claim
            continue
        return str(claim.path), claim
    raise UsageError(f"could not claim a new folder under {DEFAULT_REPORTS_DIR}/; pass --out DIR")


def _run_meta(command: str, args: dict[str, Any], backend_reason: str) -> dict[str, Any]:
    from commbench.run.launch_env import launcher

    return {
        "commbench_version": commbench.__version__,
        "subcommand": command,
        "args": args,
        "backend_choice": backend_reason,
        "launcher": launcher(),  # torchrun, slurm (srun tasks) or spawn (local ranks started here)
        "argv": list(sys.argv),
        "command": shlex.join(sys.argv),
    }
