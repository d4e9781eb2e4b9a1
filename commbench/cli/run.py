"""``commbench run`` (one pattern, or a balanced size sweep), ``commbench profile`` (run with --profile) and
``commbench suite`` (the default cases): each turns its ``RunConfig`` into jobs and hands both to the one
launch of ``commbench.cli.launch``. Their options are the config's fields (``commbench.run.config``)."""

from __future__ import annotations

from typing import Any

import click

from commbench.cli.inputs import (
    balanced_job,
    balanced_sizes,
    build_routing_config,
    check_jobs,
    moe_job,
    nccl_tests_files,
    repeated,
    replica_cases,
)
from commbench.cli.launch import launch
from commbench.cli.options import config_from, config_options
from commbench.errors import UsageError
from commbench.run.config import MoeConfig, RunConfig
from commbench.run.workload import DECODE_SEND_MODE, DECODE_TOKENS

# The default suite, sized so that 4 gloo ranks on 2 CPU cores finish it in a few minutes.
SUITE_MODEL = "deepseek-v3"
SUITE_SKEWS = ("uniform", "zipf:1.2", "hot:8:0.3")
SUITE_TOKENS = 512
SUITE_MIN_BYTES = 1 << 10
SUITE_MAX_BYTES = 16 << 20
SUITE_STEP_FACTOR = 2.0
RUN_MAX_BYTES = 16 << 20
# The MoE cases' repeats: their skew cost (a ratio of two times) swings between single runs on a busy host.
SUITE_MOE_REPEAT = 3
# --quick: a smoke test of the whole pipeline in seconds.
QUICK_TOKENS = 128
QUICK_MAX_BYTES = 1 << 20
QUICK_STEP_FACTOR = 4.0


def run_pattern(config: RunConfig) -> None:
    """``run`` and ``profile``: the jobs of ``--pattern``, repeated ``--repeat`` times, launched."""
    world = config.world_size
    kind = config.sweep.pattern
    plan: dict[str, Any] = {}  # what the options became: meta.json's ``plan``
    if config.sweep.kineto_trace is not None and kind != "kineto":
        raise UsageError("--kineto-trace is the trace of --pattern kineto; add --pattern kineto")
    routing = None
    if kind == "pairwise":
        jobs = []
    elif kind == "balanced":
        max_bytes = config.sweep.max_bytes or RUN_MAX_BYTES
        sizes = balanced_sizes(config.sweep.min_bytes, max_bytes, config.sweep.step_factor, world)
        jobs = [balanced_job(sizes, config)]
        plan.update(sizes=sizes, min_bytes=config.sweep.min_bytes, max_bytes=max_bytes)
        plan["step_factor"] = config.sweep.step_factor
    elif kind == "kineto":
        job, plan = _kineto_job(config)
        jobs = [job]
    else:
        routing = build_routing_config(config.moe, world, dry_run=False)
        decode = config.moe.decode
        jobs = [moe_job(case, config.moe.send_mode, config, decode) for case in replica_cases(routing)]
        plan["models"] = [config.moe.model]
        plan["decode"] = decode
    if kind != "moe" and config.harness.imbalance_cost:
        raise UsageError(
            f"--imbalance-cost compares MoE cases with a uniform layout; --pattern {kind} has none"
        )
    jobs = repeated(jobs, config.timing.repeat or 1)
    plan["repeat"] = config.timing.repeat or 1
    if kind != "kineto":  # checked by _kineto_job (cli.resources sizes MoE and balanced jobs)
        check_jobs(jobs, config)
    # --nccl-tests-matrix: written (rank 0) before the launch, removed again if the launch is refused; of the
    # last job's routing, the options' own (with --replicas the replica case), as `commbench pattern` builds.
    with nccl_tests_files(jobs[-1].routing if kind == "moe" else None, config.moe.send_mode, config):
        launch(config, jobs, plan, pairwise=kind == "pairwise")


def _kineto_job(config: RunConfig) -> tuple[Any, dict[str, Any]]:
    """--pattern kineto: (the trace's all-to-all calls as one MatrixJob, checked here with the memory its
    busiest rank needs; meta.json's record of the trace)."""
    from commbench.cli.resources import check_launch_fits
    from commbench.inputs.kineto import read_kineto
    from commbench.run.jobs import BalancedJob, MatrixCall, MatrixJob

    path, world = config.sweep.kineto_trace, config.world_size
    if path is None:
        raise UsageError(
            "--pattern kineto needs --kineto-trace PATH (a trace file, or a folder of one per rank)"
        )
    if config.launch.resume:
        raise UsageError("--resume cannot continue a --pattern kineto run; run it again")
    trace = read_kineto(path)
    if trace.group_size != world:
        raise UsageError(
            f"the trace's process group {trace.group!r} has {trace.group_size} ranks, this run {world}; run "
            f"it on {trace.group_size} ranks (--world-size {trace.group_size})"
        )
    calls = [MatrixCall(call.name, call.matrix) for call in trace.calls]
    timing = config.timing.job_timing(config.harness.check, MatrixJob.timing)
    warmup, iters = int(config.timing.warmup or 0), int(config.timing.iters or 1)
    graph = config.timing.cuda_graph or 0
    job = MatrixJob("kineto", calls, warmup=warmup, iters=iters, timing=timing, graph_calls=graph)
    job.check(world)
    # Memory: each call sized as a balanced all-to-all of its busiest rank's bytes (cli.resources).
    busiest = [max(int(c.matrix.sum(0).max()), int(c.matrix.sum(1).max()), world) for c in calls]
    check_launch_fits([BalancedJob("kineto", busiest, iters=iters)], world, config.harness.backend, False)
    return job, {"kineto_trace": trace.source, "kineto_group": trace.group, "kineto_calls": len(calls)}


def run_suite(config: RunConfig) -> None:
    """``suite``: the balanced sweep, every model x skew MoE case (repeats round after round) and the
    pairwise link test, in one launch."""
    suite, world, quick = config.suite, config.world_size, config.suite.quick
    tokens = suite.suite_tokens or (QUICK_TOKENS if quick else SUITE_TOKENS)
    max_bytes = config.sweep.max_bytes or (QUICK_MAX_BYTES if quick else SUITE_MAX_BYTES)
    step = QUICK_STEP_FACTOR if quick else SUITE_STEP_FACTOR
    models = suite.models or (SUITE_MODEL,)
    skews = suite.skews or SUITE_SKEWS
    repeat = config.timing.repeat
    moe_repeat = repeat or (1 if quick else SUITE_MOE_REPEAT)
    sizes = balanced_sizes(min(SUITE_MIN_BYTES, max_bytes), max_bytes, step, world)
    if suite.soak_s is not None:
        if repeat is not None or config.launch.resume:
            raise UsageError("--soak repeats the cases for its duration: leave out --repeat and --resume")
        sizes = sizes[-1:]  # the largest balanced size: bandwidth, not latency, drifts
        moe_repeat = 1
    cases: list[Any] = [balanced_job(sizes, config)]
    for model in models:
        for skew in skews:
            moe = MoeConfig(model, skew, tokens, seed=config.moe.seed, replicas=config.moe.replicas)
            routing = build_routing_config(moe, world, dry_run=False)
            cases += [moe_job(case, "token", config) for case in replica_cases(routing)]  # --replicas: 2
        # The model's decode case: DECODE_TOKENS tokens per rank, a message per selection, uniform routing
        # (a graph where the backend can capture it: cli.launch).
        moe = MoeConfig(model, "uniform", DECODE_TOKENS, seed=config.moe.seed, replicas=config.moe.replicas)
        routing = build_routing_config(moe, world, dry_run=False)
        cases += [moe_job(case, DECODE_SEND_MODE, config, decode=True) for case in replica_cases(routing)]
    # Round after round: each repeat of a case is apart in time from its others, as separate runs would be.
    rounds = max(repeat or 1, moe_repeat)
    jobs = [
        job
        for job in repeated(cases, rounds)
        if job.repeat < (moe_repeat if job.kind == "moe" else repeat or 1)
    ]
    check_jobs(jobs, config)
    plan = {
        "suite": "quick" if quick else "default",
        "models": list(models),
        "skews": list(skews),
        "tokens": tokens,
        "decode_tokens": DECODE_TOKENS,
        "min_bytes": sizes[0],
        "max_bytes": max_bytes,
        "step_factor": step,
        "sizes": sizes,
        "repeat": {"balanced": repeat or 1, "moe": moe_repeat},
    }
    launch(config, jobs, plan, pairwise=suite.pairwise)


@click.command()
@config_options("run")
def run(**params: Any) -> None:
    """Run one pattern: a model's dispatch + combine, or a balanced all-to-all size sweep.

    Ends with a verdict (verdict.json, junit.xml, the last console line). Exit code: 0 PASS or WARN, 1 FAIL,
    2 could not run, 3 wrong data, 4 a rank died or timed out."""
    run_pattern(config_from("run", params))


@click.command()
@config_options("profile")
def profile(**params: Any) -> None:
    """Profile one pattern: `commbench run --profile` with every option of run. Each phase's named steps per
    rank and iteration (where each microsecond goes), who arrives late on one clock, --trace for a Perfetto
    trace of every rank, --torch-profiler for a Kineto capture with comm/compute overlap, and the comm/compute
    budget of the MoE cases (--tflops)."""
    run_pattern(config_from("profile", params))


@click.command()
@config_options("suite")
def suite(**params: Any) -> None:
    """The default suite in one launch and one report folder, ending with a verdict.

    \b
    1. balanced all-to-all sweep, 1 KiB .. 16 MiB each rank sends, x2 per step (nccl-tests -b 1K -e 16M -f 2);
    2. deepseek-v3 dispatch + combine (FP8 dispatch, BF16 combine, token mode) at skews
       uniform, zipf:1.2 and hot:8:0.3, 512 tokens per rank, 3 repeats each;
    3. the decode case of each model: 128 tokens per rank, a message per selection (selection mode),
       uniform, its latency in us; a CUDA graph where the backend can capture it (see --cuda-graph);
    4. the pairwise link test: every ordered pair of ranks, one way and both ways (--no-pairwise skips it).
    Sized for 4 gloo ranks on 2 CPU cores to take a few minutes; on GPUs raise --tokens (e.g. 4096) and
    --max-bytes (e.g. 1G). Exit code: 0 PASS or WARN, 1 FAIL, 2 could not run, 3 wrong data, 4 a rank died
    or timed out.
    """
    run_suite(config_from("suite", params))
