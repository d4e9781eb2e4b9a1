"""What run, suite and pattern ask for, checked in the parent before any process starts: the routing of an
MoE case (model, skew, tokens, ...) and the sizes of a balanced all-to-all sweep."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from commbench.errors import UsageError

if TYPE_CHECKING:
    from commbench.cli.launch import LaunchSettings
    from commbench.run.jobs import Job
    from commbench.traffic.routing import RoutingConfig


@dataclass(frozen=True)
class MoeInputs:
    """The routing options (``cli.options.moe_options``); field names are the click parameter names."""

    model_name: str
    skew: str
    tokens: int
    seed: int
    mask_ratio: float
    capacity_factor: float | None
    send_mode: str
    replicas: int = 0  # --replicas: EPLB redundant experts (run and suite add a case with them)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> MoeInputs:
        """Takes (pops) this dataclass's fields out of a command's click parameters."""
        return cls(**{field.name: params.pop(field.name) for field in fields(cls)})


def build_routing_config(inputs: MoeInputs, world_size: int, dry_run: bool = True) -> RoutingConfig:
    """Load the model, parse the skew and build (and dry-run) the RoutingConfig; UsageError on bad input."""
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.routing import RoutingConfig

    model = load_model(inputs.model_name)  # also checks top-k <= experts, group limits, dtypes
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


def check_jobs(jobs: list[Job], settings: LaunchSettings) -> None:
    """Before a launch, in this order: each job's own check (the one every rank runs first: repeats, world
    size, a hidden size below the row header), the rank processes and memory the launch needs
    (``cli.resources``), then the dry routing of each MoE job (which itself needs that memory)."""
    from commbench.cli.resources import check_launch_fits

    world = settings.world_size
    for job in jobs:
        job.check(world)
    check_launch_fits(jobs, world, settings.backend, settings.imbalance_cost)
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
        size *= step_factor
    return sizes
