"""What run, suite, profile and pattern ask for, checked in the parent before any process starts: the routing
of an MoE case, the sizes of a balanced sweep, the jobs of a launch and the files written before it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import click

from commbench.errors import UsageError
from commbench.run.config import MoeConfig, RunConfig
from commbench.run.workload import DECODE

if TYPE_CHECKING:
    from commbench.run.jobs import Job
    from commbench.traffic.routing import RoutingConfig

# The largest number of balanced sizes and of cases one launch takes: far beyond a real sweep (nccl-tests
# -b 1 -e 16G -f 2 has 35 sizes), and small enough that a typo cannot plan hours of work or an 8 KB start
# line.
MAX_SIZES = 1000
MAX_CASES = 10000


def build_routing_config(inputs: MoeConfig, world_size: int, dry_run: bool = True) -> RoutingConfig:
    """Load the model, parse the skew and build (and dry-run) the RoutingConfig; UsageError on bad input."""
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.routing import RoutingConfig

    model = load_model(inputs.model)  # also checks top-k <= experts, group limits, dtypes
    skew = parse_skew(inputs.skew)
    if model.num_experts % world_size != 0:
        divisors = [str(d) for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
        shown = ", ".join(divisors[:12]) + (", ..." if len(divisors) > 12 else "")
        raise UsageError(
            f"world size {world_size} does not divide {model.name}'s {model.num_experts} experts (contiguous "
            f"placement); use one of {shown}"
        )
    # RoutingConfig checks tokens, seed, mask ratio and capacity factor.
    cfg = RoutingConfig(
        model=model,
        skew=skew,
        world_size=world_size,
        tokens_per_rank=inputs.tokens,
        seed=inputs.seed,
        mask_ratio=inputs.mask_ratio,
        capacity_factor=inputs.capacity_factor,
        replicas=inputs.replicas,
    )
    if dry_run:
        dry_route(cfg)
    return cfg


def replica_cases(cfg: RoutingConfig) -> list[RoutingConfig]:
    """The MoE cases of one routing: itself, or with --replicas N the case without replicas first and the
    case with them second, run in one launch and shown side by side ("What EPLB replicas buy")."""
    from dataclasses import replace

    return [replace(cfg, replicas=0), cfg] if cfg.replicas else [cfg]


def dry_route(cfg: RoutingConfig) -> None:
    """Route rank 0 here: a bad trace file or an impossible group limit fails now, not in every rank."""
    from commbench.traffic.routing import route_rank

    route_rank(cfg, 0)


def check_jobs(jobs: list[Job], config: RunConfig) -> None:
    """Before a launch, in this order: each job's own check (the one every rank runs first: repeats, world
    size, a hidden size below the row header), the rank processes and memory the launch needs
    (``cli.resources``), then the dry routing of each MoE job (which itself needs that memory)."""
    from commbench.cli.resources import check_launch_fits

    world = config.world_size
    if len(jobs) > MAX_CASES:
        raise UsageError(
            f"{len(jobs)} cases in one launch are more than {MAX_CASES}; sweep fewer knob values, sizes or "
            "repeats"
        )
    for job in jobs:
        job.check(world)
    check_launch_fits(jobs, world, config.harness.backend, config.harness.imbalance_cost)
    for job in jobs:
        if job.kind == "moe":
            dry_route(job.routing)


def balanced_sizes(min_bytes: int, max_bytes: int, step_factor: float, world_size: int) -> list[int]:
    """nccl-tests -b/-e/-f: min, min*f, ... up to max; each rounded down to a multiple of the world size."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise UsageError(f"need 1 <= --min-bytes <= --max-bytes, got {min_bytes} and {max_bytes}")
    if step_factor <= 1.0 and max_bytes > min_bytes:
        raise UsageError(
            f"--step-factor must be > 1 to go from {min_bytes} to {max_bytes} bytes, got {step_factor}"
        )
    if max_bytes < world_size:
        raise UsageError(
            f"--max-bytes {max_bytes} is below the world size {world_size}: each rank must send at least one "
            "byte to every rank"
        )
    sizes: list[int] = []
    size = float(min_bytes)
    while size <= max_bytes:
        rounded = int(size) // world_size * world_size
        if rounded >= world_size and (not sizes or rounded != sizes[-1]):
            sizes.append(rounded)
        if step_factor <= 1.0:
            break
        if len(sizes) > MAX_SIZES:
            raise UsageError(
                f"--min-bytes {min_bytes} to --max-bytes {max_bytes} by --step-factor {step_factor:g} gives "
                f"more than {MAX_SIZES} sizes; raise --step-factor or narrow the range"
            )
        size *= step_factor
    return sizes


def moe_job(cfg: RoutingConfig, send_mode: str, config: RunConfig, decode: bool = False) -> Job:
    """An MoE case: dispatch and combine of ``cfg``'s routing, timed as the config says. ``decode``: the
    decode case (its pattern "<model> decode"; graph-timed where the backend can capture it, cli.launch)."""
    from commbench.run.jobs import MoeJob

    timing = config.timing.job_timing(config.harness.check, MoeJob.timing)
    warmup, iters = int(config.timing.warmup or 0), int(config.timing.iters or 1)
    name = f"{cfg.model.name} {DECODE}" if decode else cfg.model.name
    graph = config.timing.cuda_graph or 0
    return MoeJob(
        name, cfg, send_mode, warmup=warmup, iters=iters, timing=timing, graph_calls=graph, decode=decode
    )


def balanced_job(sizes: list[int], config: RunConfig) -> Job:
    """A balanced all-to-all size sweep (nccl-tests alltoall)."""
    from commbench.run.jobs import BalancedJob

    timing = config.timing.job_timing(config.harness.check, BalancedJob.timing)
    warmup, iters = int(config.timing.warmup or 0), int(config.timing.iters or 1)
    graph = config.timing.cuda_graph or 0
    return BalancedJob("balanced", sizes, warmup=warmup, iters=iters, timing=timing, graph_calls=graph)


def repeated(jobs: list[Job], repeats: int) -> list[Job]:
    """Every job ``repeats`` times, round after round (each repeat of a case apart in time from its others,
    as separate runs would be)."""
    return [replace(job, repeat=index) for index in range(repeats) for job in jobs]


@contextmanager
def nccl_tests_files(cfg: RoutingConfig | None, send_mode: str, config: RunConfig) -> Iterator[None]:
    """``run --nccl-tests-matrix``: around the launch, in the process that is (or starts) rank 0, write the
    nccl-tests files of ``cfg``'s pattern (the one ``commbench pattern`` builds, routed here) and print their
    commands on stderr with the run's --iters/--warmup; a run refused (UsageError) removes them again, so bad
    input leaves nothing. ``cfg`` None: not an MoE run, refused."""
    from commbench.run.dist import is_rank0_process

    path = config.sweep.nccl_tests_matrix
    if path is not None and cfg is None:
        raise UsageError(
            "--nccl-tests-matrix exports an MoE pattern (--pattern moe); a balanced sweep is nccl-tests' own "
            "alltoall_perf (-b/-e/-f as --min-bytes/--max-bytes/--step-factor)"
        )
    if path is None or cfg is None or not is_rank0_process():
        yield
        return
    from commbench.cli.resources import check_pattern_fits
    from commbench.report.interop.nccl_tests_export import (
        check_export_paths,
        export_summary,
        plan_export,
        remove_export,
        write_export,
    )
    from commbench.traffic.pattern import build_pattern

    check_export_paths(path)
    check_pattern_fits(cfg, as_json=False)
    exports = plan_export(build_pattern(cfg, send_mode), path, config.timing.iters, config.timing.warmup)
    write_export(exports)
    click.echo(export_summary(exports, timing_known=True), err=True)
    try:
        yield
    except UsageError:
        remove_export(exports)
        raise


def cap_cpu_threads(threads: int = 1) -> None:
    """Run torch's CPU ops (OpenMP and MKL) on ``threads`` threads unless the user set OMP_NUM_THREADS.

    Routing a pattern is many small tensor ops per rank: extra intra-op threads only add hand-offs, and on a
    busy host their spin-waiting costs more than they compute. Measured on 2 cores, 64 ranks x 4,096
    deepseek-v3 tokens: idle, 2.6-2.8 s (3.0 s CPU) with 2 threads vs 2.3-2.6 s (2.0-2.4 s CPU) with 1;
    beside other busy processes 5-22 s (4.8-8.5 s CPU) vs 3.2-11 s (1.6-2.4 s CPU)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(threads)
