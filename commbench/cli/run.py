"""``commbench run`` (one pattern, or a balanced size sweep) and ``commbench suite`` (the default cases), both
through the one launch of ``commbench.cli.launch``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from commbench.cli import options as opt
from commbench.cli.inputs import MoeInputs, balanced_sizes, build_routing_config, check_jobs, replica_cases
from commbench.cli.launch import LaunchSettings, balanced_job, launch, moe_job
from commbench.errors import UsageError

# The default suite, sized so that 4 gloo ranks on 2 CPU cores finish it in a few minutes.
SUITE_MODEL = "deepseek-v3"
SUITE_SKEWS = ("uniform", "zipf:1.2", "hot:8:0.3")
SUITE_TOKENS = 512
SUITE_MIN_BYTES = 1 << 10
SUITE_MAX_BYTES = 16 << 20
SUITE_STEP_FACTOR = 2.0
# The MoE cases' repeats: their skew cost (a ratio of two times) swings between single runs on a busy host.
SUITE_MOE_REPEAT = 3
RACK_TOKENS = 4096
# --quick: a smoke test of the whole pipeline in seconds.
QUICK_TOKENS = 128
QUICK_MAX_BYTES = 1 << 20
QUICK_STEP_FACTOR = 4.0


def _backend_option(func: Any) -> Any:
    return click.option(
        "--backend-option",
        "option_pairs",
        multiple=True,
        metavar="KEY=VALUE[,VALUE...]",
        help="Backend knob (repeatable), e.g. num_blocks=24; lands in every result row. Several values "
        "(num_blocks=16,32,64) sweep them: every combination of the listed values runs in this one launch "
        "and report folder.",
    )(func)


@click.command()
@opt.moe_options
@opt.WORLD_SIZE
@opt.BACKEND
@_backend_option
@opt.WARMUP
@opt.ITERS
@opt.REPEAT
@opt.TIMEOUT
@opt.CHECK
@opt.TIMING
@opt.INJECT_DELAY
@opt.PAIR_BYTES
@opt.profile_options
@opt.acceptance_options
@opt.RESUME
@opt.OUT
@opt.NCCL_TESTS_MATRIX
@click.option(
    "--corrupt",
    type=click.Choice(["dispatch", "combine"]),
    default=None,
    hidden=True,
    help="Test hook: corrupt one received byte/element on rank 0 (the run must exit 3).",
)
@opt.layout_options
@opt.imbalance_cost_option(default=False)
@click.option(
    "--pattern",
    "pattern_kind",
    type=click.Choice(["moe", "balanced", "pairwise", "kineto"]),
    default="moe",
    show_default=True,
    help="moe: the model's dispatch and combine phases; balanced: an nccl-tests-style all-to-all size sweep; "
    "pairwise: the pairwise link test alone (every ordered pair, one way and both ways; --pair-bytes); "
    "kineto: the all-to-all calls of a torch.profiler trace (--kineto-trace).",
)
@click.option(
    "--kineto-trace",
    default=None,
    metavar="PATH",
    help="With --pattern kineto: a torch.profiler (Kineto) trace of a training step, a .json/.json.gz file "
    "per rank (a file or their folder). Each all-to-all call of its process group runs as one all-to-all-v "
    "moving the bytes of the trace's split sizes, verified; a result row per call.",
)
@click.option(
    "--min-bytes",
    type=opt.BYTES,
    default="1K",
    show_default=True,
    help="Balanced: smallest size, bytes each rank sends in total (nccl-tests -b; K/M/G = 1024-based).",
)
@click.option(
    "--max-bytes",
    type=opt.BYTES,
    default="16M",
    show_default=True,
    help="Balanced: largest size in bytes each rank sends (nccl-tests -e). Sizes are rounded down to a "
    "multiple of the world size.",
)
@click.option(
    "--step-factor",
    type=opt.finite_float(1.0),
    default=2.0,
    show_default=True,
    help="Balanced: multiply the size by this factor between steps (nccl-tests -f).",
)
def run(
    pattern_kind: str,
    kineto_trace: str | None,
    min_bytes: int,
    max_bytes: int,
    step_factor: float,
    option_pairs: tuple[str, ...],
    corrupt: str | None,
    repeat: int | None,
    **params: Any,
) -> None:
    """Run one pattern: a model's dispatch + combine, or a balanced all-to-all size sweep.

    Ends with a verdict (verdict.json, junit.xml, the last console line). Exit code: 0 PASS or WARN, 1 FAIL,
    2 could not run, 3 wrong data, 4 a rank died or timed out."""
    from commbench.cli.pattern import nccl_tests_files

    nccl_tests_matrix = params.pop("nccl_tests_matrix")  # not a launch setting: from_params takes those
    settings = LaunchSettings.from_params(params)
    moe = MoeInputs.from_params(params)
    world = settings.world_size
    if kineto_trace is not None and pattern_kind != "kineto":
        raise UsageError("--kineto-trace is the trace of --pattern kineto; add --pattern kineto")
    traced: dict[str, Any] = {}  # --pattern kineto: where its calls came from (meta.json's args)
    if pattern_kind == "pairwise":
        sizes = None
        jobs = []
        settings = replace(settings, imbalance_cost=False)
    elif pattern_kind == "balanced":
        sizes = balanced_sizes(min_bytes, max_bytes, step_factor, world)
        jobs = [balanced_job(sizes, settings)]
        settings = replace(settings, imbalance_cost=False)  # a balanced sweep has nothing to compare with
    elif pattern_kind == "kineto":
        sizes = None
        job, traced = _kineto_job(kineto_trace, world, settings)
        jobs = [job]
        settings = replace(settings, imbalance_cost=False)
    else:
        sizes = None
        cfg = build_routing_config(moe, world, dry_run=False)
        jobs = [moe_job(case, moe.send_mode, settings) for case in replica_cases(cfg)]  # --replicas: 2 cases
    jobs = [replace(job, repeat=index) for index in range(repeat or 1) for job in jobs]
    if pattern_kind != "kineto":  # checked by _kineto_job (cli.resources sizes MoE and balanced jobs)
        check_jobs(jobs, settings)
    is_moe = pattern_kind == "moe"
    args = {
        "pattern": pattern_kind,
        "model": moe.model_name if is_moe else None,
        "skew": moe.skew if is_moe else None,
        "tokens_per_rank": moe.tokens if is_moe else None,
        "send_mode": moe.send_mode,
        "mask_ratio": moe.mask_ratio,
        "capacity_factor": moe.capacity_factor,
        "seed": moe.seed,
        **({"replicas": moe.replicas} if moe.replicas else {}),  # absent without: older folders resume
        # The balanced sweep's nccl-tests header (-b/-e/-f); warmup, iters, check and timing are shared.
        "min_bytes": min_bytes if pattern_kind == "balanced" else None,
        "max_bytes": max_bytes if pattern_kind == "balanced" else None,
        "step_factor": step_factor if pattern_kind == "balanced" else None,
        "sizes": sizes,
        "repeat": repeat or 1,
        **traced,
    }
    pairwise = pattern_kind == "pairwise"
    # --nccl-tests-matrix: written (rank 0) before the launch, removed again if the launch is refused; of the
    # last job's routing, the options' own (with --replicas the replica case), as `commbench pattern` builds.
    with nccl_tests_files(jobs[-1].routing if is_moe else None, moe.send_mode, nccl_tests_matrix, settings):
        launch("run", settings, jobs, args, option_pairs=option_pairs, corrupt=corrupt, pairwise=pairwise)


def _kineto_job(path: str | None, world: int, settings: LaunchSettings) -> tuple[Any, dict[str, Any]]:
    """--pattern kineto: (the trace's all-to-all calls as one MatrixJob, checked here with the memory its
    busiest rank needs; meta.json's record of the trace)."""
    from commbench.cli.launch import job_timing
    from commbench.cli.resources import check_launch_fits
    from commbench.inputs.kineto import read_kineto
    from commbench.run.jobs import BalancedJob, MatrixCall, MatrixJob

    if path is None:
        raise UsageError(
            "--pattern kineto needs --kineto-trace PATH (a trace file, or a folder of one per rank)"
        )
    if settings.resume:
        raise UsageError("--resume cannot continue a --pattern kineto run; run it again")
    trace = read_kineto(path)
    if trace.group_size != world:
        raise UsageError(
            f"the trace's process group {trace.group!r} has {trace.group_size} ranks, this run {world}; run "
            f"it on {trace.group_size} ranks (--world-size {trace.group_size})"
        )
    calls = [MatrixCall(call.name, call.matrix) for call in trace.calls]
    timing = job_timing(settings, MatrixJob.timing)
    job = MatrixJob("kineto", calls, warmup=settings.warmup, iters=settings.iters, timing=timing)
    job.check(world)
    # Memory: each call sized as a balanced all-to-all of its busiest rank's bytes (cli.resources).
    busiest = [max(int(c.matrix.sum(0).max()), int(c.matrix.sum(1).max()), world) for c in calls]
    check_launch_fits([BalancedJob("kineto", busiest, iters=settings.iters)], world, settings.backend, False)
    return job, {"kineto_trace": trace.source, "kineto_group": trace.group, "kineto_calls": len(calls)}


@click.command()
@opt.WORLD_SIZE
@opt.BACKEND
@_backend_option
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME|PATH",
    help=f"Model preset or YAML file of the MoE cases (repeatable). Default: {SUITE_MODEL}.",
)
@click.option(
    "--skew",
    "skews",
    multiple=True,
    help="Skew of the MoE cases (repeatable; every model runs every skew). Default: "
    f"{', '.join(SUITE_SKEWS)}. " + opt.SKEW_HELP,
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1, max=opt.MAX_TOKENS),
    default=None,
    help=f"Tokens per rank of the MoE cases. Default: {SUITE_TOKENS} ({QUICK_TOKENS} with --quick); on a GPU "
    f"rack use {RACK_TOKENS}.",
)
@click.option(
    "--max-bytes",
    type=opt.BYTES,
    default=None,
    help=f"Largest balanced size, bytes each rank sends (nccl-tests -e). Default: {SUITE_MAX_BYTES >> 20}M "
    f"({QUICK_MAX_BYTES >> 20}M with --quick); on a GPU rack e.g. 1G.",
)
@opt.REPLICAS
@opt.WARMUP
@opt.ITERS
@opt.REPEAT
@opt.SEED
@opt.TIMEOUT
@opt.CHECK
@opt.TIMING
@opt.INJECT_DELAY
@opt.PAIR_BYTES
@opt.profile_options
@opt.acceptance_options
@opt.RESUME
@opt.OUT
@opt.layout_options
@opt.imbalance_cost_option(default=True)
@click.option(
    "--soak",
    "soak_s",
    type=opt.Duration(),
    default=None,
    help="Soak test: run the largest balanced size and the MoE cases round after round for this long (e.g. "
    "30m, 2h); busbw per round over time in report.html, each case's drift from its first rounds to its "
    "last judged (soak.drift_*_pct), with the health counters before/after and #wrong of every round.",
)
@click.option(
    "--pairwise/--no-pairwise",
    default=True,
    show_default=True,
    help="After the all-to-all cases, the pairwise link test: every ordered pair of ranks one way and both "
    "ways at once, in rounds of disjoint pairs; [src][dst] bandwidth and latency matrices (pairs.csv, "
    "heatmaps) and each pair judged against its link class.",
)
@click.option(
    "--quick",
    is_flag=True,
    help=f"Smoke test: sizes 1 KiB..{QUICK_MAX_BYTES >> 20} MiB x{QUICK_STEP_FACTOR:g}, "
    f"{QUICK_TOKENS} tokens, {opt.QUICK_WARMUP} warm-up + {opt.QUICK_ITERS} timed iterations, one window.",
)
def suite(
    models: tuple[str, ...],
    skews: tuple[str, ...],
    tokens: int | None,
    max_bytes: int | None,
    repeat: int | None,
    option_pairs: tuple[str, ...],
    seed: int,
    quick: bool,
    pairwise: bool,
    soak_s: float | None,
    replicas: int,
    **params: Any,
) -> None:
    """The default suite in one launch and one report folder, ending with a verdict.

    \b
    1. balanced all-to-all sweep, 1 KiB .. 16 MiB each rank sends, x2 per step (nccl-tests -b 1K -e 16M -f 2);
    2. deepseek-v3 dispatch + combine (FP8 dispatch, BF16 combine, token mode) at skews
       uniform, zipf:1.2 and hot:8:0.3, 512 tokens per rank, 3 repeats each;
    3. the pairwise link test: every ordered pair of ranks, one way and both ways (--no-pairwise skips it).
    Sized for 4 gloo ranks on 2 CPU cores to take a few minutes; on GPUs raise --tokens (e.g. 4096) and
    --max-bytes (e.g. 1G). Exit code: 0 PASS or WARN, 1 FAIL, 2 could not run, 3 wrong data, 4 a rank died
    or timed out.
    """
    settings = LaunchSettings.from_params(params, quick=quick)
    world = settings.world_size
    tokens = tokens or (QUICK_TOKENS if quick else SUITE_TOKENS)
    max_bytes = max_bytes or (QUICK_MAX_BYTES if quick else SUITE_MAX_BYTES)
    step = QUICK_STEP_FACTOR if quick else SUITE_STEP_FACTOR
    models = models or (SUITE_MODEL,)
    skews = skews or SUITE_SKEWS
    moe_repeat = repeat or (1 if quick else SUITE_MOE_REPEAT)
    sizes = balanced_sizes(min(SUITE_MIN_BYTES, max_bytes), max_bytes, step, world)
    if soak_s is not None:
        if repeat is not None or settings.resume:
            raise UsageError("--soak repeats the cases for its duration: leave out --repeat and --resume")
        sizes = sizes[-1:]  # the largest balanced size: bandwidth, not latency, drifts
        moe_repeat = 1
    cases: list[Any] = [balanced_job(sizes, settings)]
    for model in models:
        for skew in skews:
            moe = MoeInputs(model, skew, tokens, seed, 0.0, None, "token", replicas)
            cfg = build_routing_config(moe, world, dry_run=False)
            cases += [moe_job(case, "token", settings) for case in replica_cases(cfg)]  # --replicas: 2
    # Round after round: each repeat of a case is apart in time from its others, as separate runs would be.
    rounds = max(repeat or 1, moe_repeat)
    jobs = [
        replace(job, repeat=index)
        for index in range(rounds)
        for job in cases
        if index < (moe_repeat if job.kind == "moe" else repeat or 1)
    ]
    check_jobs(jobs, settings)
    args = {
        "suite": "quick" if quick else "default",
        "model": models[0] if len(models) == 1 else list(models),
        "skews": list(skews),
        "tokens_per_rank": tokens,
        "min_bytes": sizes[0],
        "max_bytes": max_bytes,
        "step_factor": step,
        "sizes": sizes,
        "seed": seed,
        **({"replicas": replicas} if replicas else {}),
        "repeat": {"balanced": repeat or 1, "moe": moe_repeat},
        "soak_s": soak_s,
    }
    launch("suite", settings, jobs, args, option_pairs=option_pairs, pairwise=pairwise, soak_s=soak_s)


def _profile(**params: Any) -> None:
    params["profile"] = True
    run.callback(**params)  # type: ignore[misc]


# ``commbench profile``: ``run`` with --profile (every option of run, the same report folder and verdict).
profile = click.Command(
    "profile",
    params=list(run.params),
    callback=_profile,
    help="Profile one pattern: `commbench run --profile` with every option of run. Each phase's named steps "
    "per rank and iteration (where each microsecond goes), who arrives late on one clock, --trace for a "
    "Perfetto trace of every rank, --torch-profiler for a Kineto capture with comm/compute overlap, and the "
    "comm/compute budget of the MoE cases (--tflops).",
)
