"""``commbench run`` (one pattern, or a balanced size sweep) and ``commbench suite`` (the default cases), both
through the one launch of ``commbench.cli.launch``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from commbench.cli import options as opt
from commbench.cli.inputs import MoeInputs, balanced_sizes, build_routing_config, check_jobs
from commbench.cli.launch import LaunchSettings, balanced_job, launch, moe_job
from commbench.errors import UsageError

# The default suite, sized so that 4 gloo ranks on 2 CPU cores finish it in a few minutes.
SUITE_MODEL = "deepseek-v3"
SUITE_SKEWS = ("uniform", "zipf:1.2", "hot:8:0.3")
SUITE_TOKENS = 512
SUITE_MIN_BYTES = 1 << 10
SUITE_MAX_BYTES = 16 << 20
SUITE_STEP_FACTOR = 2.0
# The MoE cases' windows: their skew cost (a ratio of two times) swings between single runs on a busy host.
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
@opt.acceptance_options
@opt.RESUME
@opt.OUT
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
    type=click.Choice(["moe", "balanced", "pairwise"]),
    default="moe",
    show_default=True,
    help="moe: the model's dispatch and combine phases; balanced: an nccl-tests-style all-to-all size sweep; "
    "pairwise: the pairwise link test alone (every ordered pair, one way and both ways; --pair-bytes).",
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
    settings = LaunchSettings.from_params(params)
    moe = MoeInputs.from_params(params)
    world = settings.world_size
    if pattern_kind == "pairwise":
        sizes = None
        jobs = []
        settings = replace(settings, imbalance_cost=False)
    elif pattern_kind == "balanced":
        sizes = balanced_sizes(min_bytes, max_bytes, step_factor, world)
        jobs = [balanced_job(sizes, settings)]
        settings = replace(settings, imbalance_cost=False)  # a balanced sweep has nothing to compare with
    else:
        sizes = None
        jobs = [moe_job(build_routing_config(moe, world, dry_run=False), moe.send_mode, settings)]
    jobs = [replace(job, window=window) for window in range(repeat or 1) for job in jobs]
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
        # The balanced sweep's nccl-tests header (-b/-e/-f); warmup, iters, check and timing are shared.
        "min_bytes": min_bytes if pattern_kind == "balanced" else None,
        "max_bytes": max_bytes if pattern_kind == "balanced" else None,
        "step_factor": step_factor if pattern_kind == "balanced" else None,
        "sizes": sizes,
        "repeat": repeat or 1,
    }
    pairwise = pattern_kind == "pairwise"
    launch("run", settings, jobs, args, option_pairs=option_pairs, corrupt=corrupt, pairwise=pairwise)


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
@opt.WARMUP
@opt.ITERS
@opt.REPEAT
@opt.SEED
@opt.TIMEOUT
@opt.CHECK
@opt.TIMING
@opt.INJECT_DELAY
@opt.PAIR_BYTES
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
    "30m, 2h); busbw per window over time in report.html, each case's drift from its first windows to its "
    "last judged (soak.drift_*_pct), with the health counters before/after and #wrong of every window.",
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
    **params: Any,
) -> None:
    """The default suite in one launch and one report folder, ending with a verdict.

    \b
    1. balanced all-to-all sweep, 1 KiB .. 16 MiB each rank sends, x2 per step (nccl-tests -b 1K -e 16M -f 2);
    2. deepseek-v3 dispatch + combine (FP8 dispatch, BF16 combine, token mode) at skews
       uniform, zipf:1.2 and hot:8:0.3, 512 tokens per rank, 3 windows each;
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
            moe = MoeInputs(model, skew, tokens, seed, 0.0, None, "token")
            cases.append(moe_job(build_routing_config(moe, world, dry_run=False), "token", settings))
    # Round after round: each window of a case is apart in time from its others, as separate runs would be.
    rounds = max(repeat or 1, moe_repeat)
    jobs = [
        replace(job, window=window)
        for window in range(rounds)
        for job in cases
        if window < (moe_repeat if job.kind == "moe" else repeat or 1)
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
        "repeat": {"balanced": repeat or 1, "moe": moe_repeat},
        "soak_s": soak_s,
    }
    launch("suite", settings, jobs, args, option_pairs=option_pairs, pairwise=pairwise, soak_s=soak_s)
