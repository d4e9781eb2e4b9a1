"""One launch for ``run``, ``profile`` and ``suite``: everything a launch needs is resolved and checked in the
parent (backend and its knob sweep, the spec, the acceptance limits and baseline, the report folder), then
every rank runs the jobs (``cli.worker``) and rank 0 writes the report as phases finish.

The config (``commbench.run.config.RunConfig``) arrives checked; here it gains what only the machine can
say (the backend ``auto`` resolves to, the spec of the GPUs) and is handed to the ranks as a ``LaunchPlan``.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import commbench
from commbench.cli.ending import finish_partial_report, stopped_error, verdict_last
from commbench.cli.inputs import MAX_CASES
from commbench.cli.plan import LaunchPlan
from commbench.errors import UsageError
from commbench.run.config import RESUME_FREE, RunConfig
from commbench.run.config_meta import config_to_meta

if TYPE_CHECKING:
    from commbench.backends.options import OptionSweep
    from commbench.report import OutDirClaim
    from commbench.run.jobs import Job

DEFAULT_REPORTS_DIR = "reports"
_DEFAULT_OUT_TRIES = 100  # runs starting in the same second each take the next -N suffix
MAX_KNOB_SETTINGS = 1000  # --backend-option sweeps: combinations in one launch


def _phases(job: Job) -> int:
    """Result rows a job writes (progress steps): one per size or trace call, or its MoE phases."""
    if job.kind == "matrix":
        return len(job.calls)
    return len(job.sizes) if job.kind == "balanced" else len(job.phases)


def default_out_dir(base: str | os.PathLike[str] = DEFAULT_REPORTS_DIR) -> Path:
    """reports/<UTC timestamp>/, with a -2, -3, ... suffix if that folder already exists."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    candidate = Path(base) / stamp
    suffix = 2
    while candidate.exists():
        candidate = Path(base) / f"{stamp}-{suffix}"
        suffix += 1
    return candidate


def launch(config: RunConfig, jobs: list[Job], plan: dict[str, Any], pairwise: bool = False) -> None:
    """Resolve and check everything in the parent, run ``jobs`` on every rank (then the pairwise link test
    when ``pairwise``), write the report folder.

    ``plan`` is what the command made of its options (sizes, repeats, a trace's source: meta.json's
    ``plan``). UsageError (one line, nothing launched or written) on bad input.
    """
    from commbench.backends import get_backend
    from commbench.cli.acceptance import Acceptance, choose_report_spec
    from commbench.cli.worker import launch_worker
    from commbench.run import dist

    world = config.world_size
    backend, reason, sweep = _choose_backend(config, len(jobs))
    jobs = _graph_jobs(config, jobs, get_backend(backend), sweep)
    system, spec_how, judged = choose_report_spec(config.acceptance.spec, backend)
    # Limits and baseline read and checked once, here: one line, exit 2, before anything starts.
    acceptance = Acceptance.load(config.acceptance, system if judged else None, spec_how, judged)
    knob_settings = sweep.settings()
    if knob_settings != [{}]:  # setting outermost: each setting's backend is built once
        jobs = [replace(job, backend_options=dict(setting)) for setting in knob_settings for job in jobs]
    options = replace(config.harness, backend=backend, backend_options=sweep.fixed)
    plan = {**plan, "backend": backend, "backend_options": {**sweep.fixed, **sweep.swept}}
    plan["knob_settings"] = len(knob_settings)
    link_test = None
    if pairwise:
        from commbench.cli.linktest import pairwise_job

        link_test = pairwise_job(config, acceptance, backend, alone=not jobs)
    if link_test is not None:
        plan["pairwise"] = {
            "bandwidth_bytes": link_test.bandwidth_bytes,
            "latency_bytes": link_test.latency_bytes,
            "warmup": link_test.warmup,
            "iters": link_test.iters,
        }
    meta = _run_meta(config, plan, reason)
    meta["acceptance"] = acceptance.to_meta()
    if config.launch.resume:
        out_dir, out_claim, meta, total = _prepare_resume(config, meta, jobs)
    else:
        out_dir, out_claim = _prepare_out(config.launch.out)
        total = sum(_phases(job) for job in jobs)
    if dist.is_rank0_process():
        swept = f"; {len(knob_settings)} knob settings ({sweep.describe()})" if sweep.swept else ""
        resumed = " (resumed: its finished cases are skipped)" if config.launch.resume else ""
        click.echo(
            f"commbench {config.command}: backend {reason}; {world} ranks; spec {system.name} ({spec_how})"
            f"{swept}; {total} cases; report folder {out_dir}{resumed}",
            err=True,
        )
    launch_plan = LaunchPlan(
        config, jobs, options, system, out_dir, meta, total, tuple(sweep.swept), link_test, out_claim,
        bool(config.launch.resume), acceptance,
    )  # fmt: skip
    try:
        process_group = get_backend(backend).process_group
        dist.launch(world, launch_worker, (launch_plan,), process_group, options.timeout_s)
    except BaseException as exc:
        if not dist.is_rank0_process():
            raise
        # A launch that failed before rank 0 wrote anything leaves no empty report folder behind, nor does a
        # stop before any case finished; one that wrote rows leaves them, marked INCOMPLETE (here if rank 0
        # was killed before it could say so).
        kept = finish_partial_report(out_dir, out_claim, exc, acceptance, bool(config.launch.resume))
        error = stopped_error(exc, kept)
        code = verdict_last(out_dir, error)
        if code is not None:
            raise click.exceptions.Exit(code) from None  # the error line is out, before the verdict line
        if error is not exc:
            raise error from exc
        raise
    if dist.is_rank0_process():
        code = verdict_last(out_dir, None)
        if code:
            raise click.exceptions.Exit(code)


def _graph_jobs(config: RunConfig, jobs: list[Job], backend_class: Any, sweep: OptionSweep) -> list[Job]:
    """The jobs with the decode case graph-timed where the backend can capture it (``run.graphs``); a
    --cuda-graph job the backend cannot capture with some knob setting is refused (one line, exit 2)."""
    from commbench.run.graph_rules import graph_conflict
    from commbench.run.graphs import graph_refusal, with_graphs

    settings = [{**sweep.fixed, **setting} for setting in sweep.settings()]
    timing = config.timing
    allowed = timing.timing is None and not graph_conflict(config, config.harness, timing)
    jobs = with_graphs(jobs, backend_class, settings, allowed)
    refusal = graph_refusal(backend_class, jobs, settings)
    if refusal:
        raise UsageError(refusal)
    return jobs


def _choose_backend(config: RunConfig, cases: int) -> tuple[str, str, OptionSweep]:
    """(backend, why it was chosen, its --backend-option values; sim's over the report's spec and layout):
    the backend's own availability check, the device check, every knob setting's ``check_options``."""
    from commbench.backends import get_backend
    from commbench.backends.options import parse_option_sweep
    from commbench.run.dist import check_group_devices, resolve_backend
    from commbench.run.nodes import node_backend_refusal

    requested = config.harness.backend
    if requested != "auto":
        # The backend's own pre-launch check (nvshmem: "needs GPUs and NVSHMEM"), before the device count.
        check_available = getattr(get_backend(requested), "check_available", None)
        if callable(check_available):
            check_available()
    backend, reason = resolve_backend(requested, config.world_size)
    backend_class = get_backend(backend)
    refusal = node_backend_refusal(
        backend_class, [config.moe.send_mode] if config.sweep.pattern == "moe" else []
    )
    if refusal:
        raise UsageError(refusal)
    # A real all-to-all on CPU ranks (gloo; not an emulation) on a host whose GPUs torch cannot use.
    if not (backend_class.gpu_fabric or backend_class.emulated or config.launch.allow_cpu):
        from commbench.hardware.cuda_use import cuda_use

        found = cuda_use()
        if found.unusable:
            raise UsageError(f"{found.cause}; {found.fix}, or pass --allow-cpu to measure the CPUs anyway")
    check_group_devices(backend_class.process_group, config.world_size, backend)  # nccl: a GPU per rank
    sweep = parse_option_sweep(backend, backend_class.OPTIONS, config.launch.backend_option)
    settings = math.prod(len(values) for values in sweep.swept.values())
    if settings > MAX_KNOB_SETTINGS or settings * max(cases, 1) > MAX_CASES:
        raise UsageError(
            f"--backend-option sweeps {settings} knob settings x {cases} cases; at most {MAX_KNOB_SETTINGS} "
            f"settings and {MAX_CASES} cases in one launch: list fewer values"
        )
    fixed = _with_report_layout(sweep.fixed, config) if backend_class.models_report_layout else sweep.fixed
    for setting in sweep.settings():  # a bad value in any setting of a sweep fails now, not in the ranks
        backend_class.check_options({**fixed, **setting}, world_size=config.world_size)
    return backend, reason, replace(sweep, fixed=fixed)


def _with_report_layout(options: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """A backend that models the report's system and layout (``models_report_layout``: sim) gets them as
    options, unless its own options say otherwise."""
    from commbench.inputs.specs import DEFAULT_SPEC_NAME

    # sim needs figures to model: with no --spec it models the catalogue's default system.
    merged = {"spec": config.acceptance.spec or DEFAULT_SPEC_NAME, **options}
    if config.harness.ranks_per_domain is not None:
        merged.setdefault("ranks_per_domain", config.harness.ranks_per_domain)
    if config.harness.ranks_per_host is not None:
        merged.setdefault("ranks_per_host", config.harness.ranks_per_host)
    return merged


def _prepare_resume(
    config: RunConfig, meta: dict[str, Any], jobs: list[Job]
) -> tuple[str, OutDirClaim | None, dict[str, Any], int]:
    """--resume DIR on rank 0: the folder checked (an INCOMPLETE run of this command with this config) and
    taken over; (folder, claim, its meta.json for this run, phases left). Other ranks: (folder, None, meta,
    0); rank 0 tells them the jobs left inside the launch."""
    from commbench.cli.resume import check_same_run, read_interrupted, remaining_jobs, resumed_meta
    from commbench.report.folder.claim import take_over_out_dir
    from commbench.run.dist import is_rank0_process

    folder = str(config.launch.resume)
    if not is_rank0_process():
        return folder, None, meta, 0
    saved, results = read_interrupted(folder)
    check_same_run(folder, saved, config, RESUME_FREE)
    left, kept = remaining_jobs(jobs, results)
    if not left:
        raise UsageError(f"--resume {folder}: every case already finished; render it with commbench report")
    merged = {**resumed_meta(saved, kept), **{key: meta[key] for key in ("argv", "command", "acceptance")}}
    return folder, take_over_out_dir(folder), merged, sum(_phases(job) for job in left)


def _prepare_out(out: str | None) -> tuple[str, OutDirClaim | None]:
    """Claim (on rank 0) the report folder before launching: created exclusively, or an existing empty one
    claimed by its marker, so two runs given the same --out cannot both take it (UsageError for the
    second, and for a folder that is not new or empty). Without --out: the next free reports/<UTC time>."""
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


def _run_meta(config: RunConfig, plan: dict[str, Any], backend_reason: str) -> dict[str, Any]:
    """meta.json as the launch starts: the config as itself, what the command made of it, how the backend
    was chosen, the launcher and the command line."""
    from commbench.run.launch_env import launcher

    return {
        "commbench_version": commbench.__version__,
        "subcommand": config.command,
        "config": config_to_meta(config),
        "plan": plan,
        "backend_choice": backend_reason,
        "launcher": launcher(),  # torchrun, slurm (srun tasks) or spawn (local ranks started here)
        "argv": list(sys.argv),
        "command": shlex.join(sys.argv),
    }
