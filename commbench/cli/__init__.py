"""The ``commbench`` command line: run, suite, pattern, report.

Every input is validated before any process is launched, so bad input costs one line on stderr and exit
code 2. Errors never print a traceback unless COMMBENCH_DEBUG=1.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

import commbench
from commbench.backends import BACKENDS
from commbench.errors import CommbenchError, UsageError

BACKEND_CHOICES = ["auto", *BACKENDS]
DEFAULT_REPORTS_DIR = "reports"

# The default suite, sized so that 4 gloo ranks on 2 CPU cores finish it in a few minutes.
SUITE_MODEL = "deepseek-v3"
SUITE_SKEWS = ("uniform", "zipf:1.2", "hot:8:0.3")
SUITE_TOKENS = 512
SUITE_MIN_BYTES = 1 << 10
SUITE_MAX_BYTES = 16 << 20
SUITE_STEP_FACTOR = 2.0
# --quick: a smoke test of the whole pipeline in seconds.
QUICK_TOKENS = 128
QUICK_MAX_BYTES = 1 << 20
QUICK_STEP_FACTOR = 4.0
QUICK_WARMUP = 2
QUICK_ITERS = 5


# ----------------------------------------------------------------------------------------------------------
# Option types and helpers


class ByteSize(click.ParamType):
    """A byte count with an optional binary suffix, as nccl-tests -b/-e: 4096, 64K, 16M, 1G (K = 1024)."""

    name = "BYTES"
    _pattern = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
    _scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = self._pattern.match(str(value))
        if not match:
            self.fail(f"{value!r} is not a byte count; use e.g. 4096, 64K, 16M or 1G (K = 1024)", param, ctx)
        return int(match.group(1)) * self._scale[match.group(2).lower()]


BYTES = ByteSize()


def _option_value(text: str) -> Any:
    """One --backend-option value: int, float or bool where it looks like one, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


@dataclass(frozen=True)
class BackendOptionSweep:
    """``--backend-option KEY=V1,V2,...`` values: keys with one value are fixed, keys with several are swept
    (the cartesian product, first key outermost, in the order given)."""

    fixed: dict[str, Any]
    swept: dict[str, list[Any]]

    def settings(self) -> list[dict[str, Any]]:
        """Every combination of the swept values ([{}] when nothing is swept)."""
        keys = list(self.swept)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.swept.values())]


def parse_backend_option_sweep(pairs: tuple[str, ...]) -> BackendOptionSweep:
    """KEY=VALUE or KEY=V1,V2,... pairs (each key once); UsageError naming the bad pair."""
    fixed: dict[str, Any] = {}
    swept: dict[str, list[Any]] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(
                f"--backend-option {pair!r} is not KEY=VALUE; e.g. --backend-option num_blocks=24 "
                "(or num_blocks=16,32,64 to sweep)"
            )
        if key in fixed or key in swept:
            raise UsageError(
                f"--backend-option {key} is given twice; list its values once, e.g. {key}=V1,V2 to sweep"
            )
        texts = [part.strip() for part in text.split(",")]
        if not all(texts):
            raise UsageError(
                f"--backend-option {pair!r} has an empty value; give {key}=VALUE or {key}=V1,V2,... "
                "without empty entries"
            )
        values = list(dict.fromkeys(_option_value(part) for part in texts))  # a repeated value runs once
        if len(values) == 1:
            fixed[key] = values[0]
        else:
            swept[key] = values
    return BackendOptionSweep(fixed, swept)


def under_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets these for every worker it starts."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _is_rank0() -> bool:
    return not under_torchrun() or os.environ.get("RANK") == "0"


def resolve_world_size(world_size: int | None) -> int:
    if under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != launched:
            raise UsageError(
                f"--world-size {world_size} differs from torchrun's WORLD_SIZE={launched}; drop --world-size "
                "under torchrun"
            )
        return launched
    if world_size is None:
        raise UsageError(
            "--world-size is required outside torchrun; pass e.g. --world-size 4 (one local process per rank)"
        )
    return world_size


def resolve_backend(backend: str, world_size: int) -> tuple[str, str]:
    """(backend, reason); auto = nccl with a CUDA device per rank (any under torchrun), else gloo."""
    import torch

    devices = torch.cuda.device_count()
    if backend == "auto":
        if under_torchrun() and devices >= 1:
            return "nccl", f"auto: torchrun with {devices} local CUDA device(s) -> nccl"
        if devices >= world_size:
            return "nccl", f"auto: {devices} CUDA device(s) for {world_size} ranks -> nccl"
        return "gloo", f"auto: {devices} CUDA device(s) for {world_size} ranks -> gloo (CPU processes)"
    if backend in ("nccl", "nvshmem"):
        needed = 1 if under_torchrun() else world_size
        if devices < needed:
            raise UsageError(
                f"backend {backend} needs {needed} CUDA device(s) on this host, found {devices}; use "
                "--backend gloo (CPU) or fewer ranks"
            )
    return backend, f"{backend} (as requested)"


def _default_spec() -> str:
    from commbench.inputs.specs import DEFAULT_SPEC_NAME

    return DEFAULT_SPEC_NAME


def check_backend_available(backend: str) -> None:
    """The backend's own pre-launch check (``check_available`` classmethod, e.g. nvshmem's "needs GPUs and
    NVSHMEM"), so a backend that cannot run here fails with its one-line message before any launch."""
    from commbench.backends import get_backend

    check = getattr(get_backend(backend), "check_available", None)
    if callable(check):
        check()


def check_backend_options(backend: str, option_sets: list[dict[str, Any]]) -> None:
    """Every option set through the backend's ``check_options`` classmethod (where it has one), so a bad
    key or value, in any setting of a sweep, fails with one line before the launch."""
    from commbench.backends import get_backend

    check = getattr(get_backend(backend), "check_options", None)
    if callable(check):
        for options in option_sets:
            check(options)


def sweep_jobs(jobs: list[Any], settings: list[dict[str, Any]]) -> list[Any]:
    """The jobs once per knob setting (setting outermost, so each setting's backend is built once); a
    single empty setting leaves the jobs as they are."""
    from dataclasses import replace

    if settings == [{}]:
        return list(jobs)
    return [replace(job, backend_options=dict(setting)) for setting in settings for job in jobs]


@dataclass
class FabricInputs:
    """--spec and the layout overrides, validated in the parent process."""

    spec_text: str
    ranks_per_domain: int | None
    ranks_per_host: int | None


def prepare_fabric(inputs: FabricInputs, world_size: int) -> tuple[Any, Any, dict[str, Any]]:
    """(SystemSpec, report BandwidthSpec, meta entries); UsageError for a bad spec or layout override."""
    from dataclasses import asdict

    from commbench.inputs.layout import build_layout
    from commbench.inputs.specs import load_spec
    from commbench.report import BandwidthSpec

    system = load_spec(inputs.spec_text)
    build_layout(world_size, inputs.ranks_per_domain, inputs.ranks_per_host)  # nesting, sizes
    bandwidth = BandwidthSpec.from_system(system)
    meta = {
        "spec": asdict(bandwidth),
        "system_spec": {**asdict(system), "description_line": system.describe()},
    }
    return system, bandwidth, meta


def sim_backend_options(options: dict[str, Any], inputs: FabricInputs) -> dict[str, Any]:
    """The sim backend models the same system and layout as the report, unless its options say otherwise."""
    merged = {"spec": inputs.spec_text, **options}
    if inputs.ranks_per_domain is not None:
        merged.setdefault("ranks_per_domain", inputs.ranks_per_domain)
    if inputs.ranks_per_host is not None:
        merged.setdefault("ranks_per_host", inputs.ranks_per_host)
    return merged


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


def default_out_dir(base: str | os.PathLike[str] = DEFAULT_REPORTS_DIR) -> Path:
    """reports/<UTC timestamp>/, with a -2, -3, ... suffix if that folder already exists."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    candidate = Path(base) / stamp
    suffix = 2
    while candidate.exists():
        candidate = Path(base) / f"{stamp}-{suffix}"
        suffix += 1
    return candidate


def _echo_err(message: str) -> None:
    click.echo(message, err=True)


# ----------------------------------------------------------------------------------------------------------
# Validation: everything a launch needs, checked in the parent process


@dataclass
class MoeInputs:
    model_name: str
    skew_text: str
    tokens: int
    seed: int
    mask_ratio: float
    capacity_factor: float | None
    send_mode: str


def build_routing_config(inputs: MoeInputs, world_size: int, dry_run: bool = True) -> Any:
    """Load the model, parse the skew and build (and dry-run) the RoutingConfig; UsageError on bad input."""
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = load_model(inputs.model_name)  # also checks top-k <= experts, group limits, dtypes
    skew = parse_skew(inputs.skew_text)
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
    )
    if dry_run:
        # Route rank 0 here: a bad trace file or an impossible group limit fails now, not in every rank.
        route_rank(cfg, 0)
    return cfg


@dataclass
class LaunchPlan:
    """What the parent hands to every rank (must pickle)."""

    jobs: list[Any]
    options: Any  # harness.RunOptions
    out_dir: str
    meta: dict[str, Any]
    total_steps: int
    progress: bool = True
    swept_keys: tuple[str, ...] = ()  # knobs a --backend-option sweep varies (named in progress lines)


def _sweep_text(sweep: BackendOptionSweep) -> str:
    """The swept values for the start-up line, e.g. "chunk_rows=4,16 x signal=chunk,segment"."""
    return " x ".join(f"{key}={','.join(str(v) for v in values)}" for key, values in sweep.swept.items())


def _job_steps(job: Any) -> int:
    return len(job.sizes) if job.kind == "balanced" else 2


def _prepare_out(out: str | None) -> str:
    """Check (and on rank 0 create) the report folder before launching; UsageError if it is not new/empty."""
    from commbench.report import prepare_out_dir

    path = Path(out) if out else default_out_dir()
    if _is_rank0():
        prepare_out_dir(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# The per-rank entry point


class _Progress:
    """'[3/7] deepseek-v3 zipf:1.2 dispatch ...' lines on stderr after each finished phase (rank 0)."""

    def __init__(self, total: int, enabled: bool, swept_keys: tuple[str, ...] = ()) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.swept_keys = swept_keys

    def _setting(self, record: dict[str, Any]) -> str:
        """The swept knobs of a row (effective values) for its progress line, e.g. " [chunk_rows=4]"."""
        from commbench.report import parse_knobs

        knobs = parse_knobs(record.get("knobs"))
        prefix = f"{record.get('backend_name')}_"  # sim and mock report their options as "<name>_<option>"
        values = {key: knobs.get(key, knobs.get(prefix + key)) for key in self.swept_keys}
        shown = [f"{key}={value}" for key, value in values.items() if value is not None]
        return f" [{' '.join(shown)}]" if shown else ""

    def __call__(self, rows: list[dict[str, Any]]) -> None:
        from commbench.report import format_bandwidth, results_frame

        if not rows:
            return
        for record in results_frame(rows).to_dict("records"):
            self.done += 1
            if not self.enabled:
                continue
            skew = record.get("skew")
            case = "alltoall" if record.get("phase") == "alltoall" else f"{skew} {record.get('phase')}"
            _echo_err(
                f"[{self.done}/{self.total}] {record.get('pattern')} {case}{self._setting(record)}: "
                f"size {int(record['size_bytes'])} B, "
                f"{record['time_us_p50']:.1f} us, busbw {format_bandwidth(record['busbw_GBps'])} GB/s, "
                f"#wrong {record.get('wrong')}"
            )


def launch_worker(comm: Any, plan: LaunchPlan) -> None:
    """Every rank runs the jobs; rank 0 writes the report as phases finish and prints the table."""
    from commbench.run import harness

    topology = harness.gather_topology(comm, plan.options)  # collective: every rank's place
    if comm.rank != 0:
        harness.run_jobs(comm, plan.jobs, plan.options, sink=None, topology=topology)
        return

    from commbench.hardware.environment import capture_environment
    from commbench.report import ReportWriter, format_table

    env = capture_environment()
    env["argv"] = plan.meta.get("argv", env["argv"])
    env["command"] = plan.meta.get("command", env["command"])
    writer = ReportWriter(plan.out_dir, {**plan.meta, "env": env, "topology": topology.to_meta()})
    if plan.progress:
        _echo_err(f"commbench: topology: {topology.describe()}")
    progress = _Progress(plan.total_steps, plan.progress, plan.swept_keys)

    def sink(rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]]) -> None:
        writer.add(rows, rank_rows)
        progress(rows)

    try:
        harness.run_jobs(comm, plan.jobs, plan.options, sink=sink, topology=topology)
    except BaseException:
        # Keep whatever finished readable (summary, html) before the error propagates.
        try:
            frame = writer.finalize()
            if not frame.empty:
                click.echo(format_table(frame))
        except Exception as exc:  # never mask the original error
            _echo_err(f"commbench: could not finalize the partial report: {exc}")
        raise
    frame = writer.finalize()
    click.echo(format_table(frame))


# The torch.distributed process group each benchmark backend runs on (default: gloo, CPU processes).
_PROCESS_GROUP_OF_BACKEND = {"nccl": "nccl", "nvshmem": "nccl", "gloo": "gloo"}


def process_group_backend(backend: str) -> str:
    return _PROCESS_GROUP_OF_BACKEND.get(backend, "gloo")


def _launch(plan: LaunchPlan, world_size: int, backend: str, timeout_s: float) -> None:
    from commbench.run import dist

    try:
        dist.launch(world_size, launch_worker, (plan,), process_group_backend(backend), timeout_s)
    except BaseException:
        # A launch that failed before rank 0 wrote anything leaves no empty report folder behind.
        out = Path(plan.out_dir)
        if _is_rank0() and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def _run_meta(command: str, args: dict[str, Any], backend_reason: str) -> dict[str, Any]:
    import shlex

    return {
        "commbench_version": commbench.__version__,
        "subcommand": command,
        "args": args,
        "backend_choice": backend_reason,
        "argv": list(sys.argv),
        "command": shlex.join(sys.argv),
    }


# ----------------------------------------------------------------------------------------------------------
# Error handling: one line on stderr, an exit code, no traceback


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _exit_code_and_message(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one stderr line for an error that ends the command."""
    if isinstance(exc, click.exceptions.ClickException):  # click's own usage errors (bad option, bad value)
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        code = 2 if isinstance(exc, click.UsageError) else exc.exit_code
        return code, f"commbench: error: {_one_line(exc.format_message())}{hint}"
    if isinstance(exc, click.exceptions.Abort | KeyboardInterrupt):
        return 130, "commbench: interrupted"
    if isinstance(exc, CommbenchError):
        return exc.exit_code, f"commbench: error: {_one_line(str(exc))}"
    # Only the first line: a failed rank's message carries its whole traceback after it.
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    hint = "(set COMMBENCH_DEBUG=1 for the traceback)"
    return 1, f"commbench: error: unexpected {type(exc).__name__}: {first} {hint}"


# click >= 8.2 raises this for a group called without a command; older versions print the help themselves.
_NO_ARGS_IS_HELP: type[Exception] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (Exception,), {})
)


class CommbenchGroup(click.Group):
    """A click group whose ``main`` turns every error into one stderr line and an exit code (no traceback,
    unless COMMBENCH_DEBUG=1). Living in ``main`` itself, this also holds under click's CliRunner."""

    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        debug = os.environ.get("COMMBENCH_DEBUG", "") not in ("", "0")
        try:
            result = super().main(
                args=args,
                prog_name=prog_name or "commbench",
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except click.exceptions.Exit as exc:  # e.g. --help, --version
            result = exc.exit_code
        except _NO_ARGS_IS_HELP as exc:  # bare `commbench` (click >= 8.2): the help, not an error
            if not standalone_mode:
                raise
            click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
            result = 0
        except (Exception, KeyboardInterrupt, click.exceptions.Abort) as exc:
            if debug and not isinstance(exc, click.exceptions.ClickException):
                raise
            if not standalone_mode:
                raise
            code, message = _exit_code_and_message(exc)
            _echo_err(message)
            sys.exit(code)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


# ----------------------------------------------------------------------------------------------------------
# Commands


def _model_help() -> str:
    try:
        from commbench.inputs.models import list_models

        names = ", ".join(list_models())
    except Exception:  # help must work even if presets cannot be listed
        names = "see commbench/inputs/presets/"
    return f"Model preset name ({names}) or path to a YAML file with the same keys."


OUT_HELP = "Report folder; must be new or empty. Default: reports/<UTC timestamp>/ (never overwritten)."
SKEW_HELP = (
    "Expert popularity: uniform | zipf:S (Zipf exponent S) | hot:N:F (N hot experts get fraction F of "
    "selections) | rank-imbalance:R (one rank's experts get R x the load) | trace:PATH (recorded routing)."
)


def common_moe_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--model", "model_name", default="deepseek-v3", show_default=True, help=_model_help()),
        click.option("--skew", default="uniform", show_default=True, help=SKEW_HELP),
        click.option(
            "--tokens",
            type=click.IntRange(min=1),
            default=4096,
            show_default=True,
            help="Tokens per rank (the batch each rank dispatches), in tokens.",
        ),
        click.option(
            "--send-mode",
            type=click.Choice(["token", "selection"]),
            default="token",
            show_default=True,
            help="token: one row per (token, destination rank), as DeepEP normal kernels; selection: one row "
            "per (token, expert) selection, as per-expert all-to-all dispatchers.",
        ),
        click.option(
            "--mask-ratio",
            type=float,
            default=0.0,
            show_default=True,
            help="Fraction of (token, expert) selections dropped at random, in [0, 1) (as DeepEP's "
            "masked ratio).",
        ),
        click.option(
            "--capacity-factor",
            type=float,
            default=None,
            help="Expert capacity as a multiple of tokens/experts per source rank; selections over it are "
            "dropped. Default: no capacity limit.",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Random seed of the routing (integer >= 0).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _spec_help() -> str:
    try:
        from commbench.inputs.specs import DEFAULT_SPEC_NAME, list_specs

        names, default = ", ".join(list_specs()), DEFAULT_SPEC_NAME
    except Exception:  # help must work even if the catalogue cannot be listed
        names, default = "see commbench/inputs/catalogue/", "gb300-nvl72"
    return (
        f"System spec the report compares with: a catalogue name ({names}) or a YAML file with the same "
        f"keys. Default: {default}."
    )


def fabric_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--spec and the NVLink-domain / host layout overrides (run and suite)."""
    options = [
        click.option("--spec", "spec_text", default=None, metavar="NAME|PATH", help=_spec_help()),
        click.option(
            "--ranks-per-domain",
            type=click.IntRange(min=1),
            default=None,
            help="Override the discovered NVLink domains: contiguous groups of N ranks share one (a CPU "
            "what-if: 4 gloo ranks with N=2 stand for 2 domains of 2). Default: NVML fabric clique, else "
            "the host.",
        ),
        click.option(
            "--ranks-per-host",
            type=click.IntRange(min=1),
            default=None,
            help="Override the hosts: contiguous groups of N ranks per host (must divide "
            "--ranks-per-domain). Default: discovered host names, or one host per domain with "
            "--ranks-per-domain.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def run_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--world-size",
            type=click.IntRange(min=1),
            default=None,
            help="Number of ranks (processes), in ranks. Default under torchrun: its WORLD_SIZE; otherwise "
            "required (commbench starts that many local processes).",
        ),
        click.option(
            "--backend",
            type=click.Choice(BACKEND_CHOICES),
            default="auto",
            show_default=True,
            help="Communication backend. auto = nccl when there is a CUDA device per rank (any under "
            "torchrun), else gloo (CPU). mock/sim/shmem-emu are emulated: reports label their timings.",
        ),
        click.option(
            "--backend-option",
            "backend_option_pairs",
            multiple=True,
            metavar="KEY=VALUE[,VALUE...]",
            help="Backend knob (repeatable), e.g. num_blocks=24; lands in every result row. Several values "
            "(num_blocks=16,32,64) sweep them: every combination of the listed values runs in this one "
            "launch and report folder.",
        ),
        click.option(
            "--warmup",
            type=click.IntRange(min=0),
            default=5,
            show_default=True,
            help="Untimed warm-up iterations.",
        ),
        click.option(
            "--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Timed iterations."
        ),
        click.option(
            "--timeout",
            "timeout_s",
            type=click.FloatRange(min=1.0),
            default=300.0,
            show_default=True,
            help="Seconds a collective (or rank start-up) may take before the run aborts with exit code 4.",
        ),
        click.option(
            "--out",
            type=click.Path(file_okay=False),
            default=None,
            help=OUT_HELP,
        ),
        click.option(
            "--corrupt",
            type=click.Choice(["dispatch", "combine"]),
            default=None,
            hidden=True,
            help="Test hook: corrupt one received byte/element on rank 0 (the run must exit 3).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.group(
    cls=CommbenchGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.version_option(commbench.__version__, prog_name="commbench")
def cli() -> None:
    """MoE dispatch/combine communication benchmark (nccl-tests conventions: size, time, algbw, busbw,
    #wrong; GB = 1e9 bytes).

    \b
    Examples:
      commbench run --model deepseek-v3 --skew zipf:1.2 --tokens 4096 --world-size 4
      torchrun --nproc-per-node 8 -m commbench run --model deepseek-v3 --skew hot:8:0.3
      commbench run --pattern balanced --min-bytes 1K --max-bytes 64M --world-size 4
      commbench suite --world-size 4 --quick
      commbench pattern --model kimi-k2 --world-size 64 --tokens 4096 --skew zipf:1.2
      commbench report reports/20250101T000000Z
    """


@cli.command()
@common_moe_options
@run_options
@fabric_options
@click.option(
    "--imbalance-cost/--no-imbalance-cost",
    default=False,
    show_default=True,
    help="MoE: after each job, rerun dispatch and combine (same code path, same launch) on a balanced layout "
    "of the same rows, and add balanced_time_us_p50, skew_cost and skew_bw_loss_pct to its rows.",
)
@click.option(
    "--pattern",
    "pattern_kind",
    type=click.Choice(["moe", "balanced"]),
    default="moe",
    show_default=True,
    help="moe: the model's dispatch and combine phases; balanced: an nccl-tests-style all-to-all size sweep.",
)
@click.option(
    "--min-bytes",
    type=BYTES,
    default="1K",
    show_default=True,
    help="Balanced: smallest size, bytes each rank sends in total (nccl-tests -b; K/M/G = 1024-based).",
)
@click.option(
    "--max-bytes",
    type=BYTES,
    default="16M",
    show_default=True,
    help="Balanced: largest size in bytes each rank sends (nccl-tests -e). Sizes are rounded down to a "
    "multiple of the world size.",
)
@click.option(
    "--step-factor",
    type=float,
    default=2.0,
    show_default=True,
    help="Balanced: multiply the size by this factor between steps (nccl-tests -f).",
)
def run(
    model_name: str,
    skew: str,
    tokens: int,
    send_mode: str,
    mask_ratio: float,
    capacity_factor: float | None,
    seed: int,
    world_size: int | None,
    backend: str,
    backend_option_pairs: tuple[str, ...],
    warmup: int,
    iters: int,
    timeout_s: float,
    out: str | None,
    corrupt: str | None,
    spec_text: str | None,
    ranks_per_domain: int | None,
    ranks_per_host: int | None,
    imbalance_cost: bool,
    pattern_kind: str,
    min_bytes: int,
    max_bytes: int,
    step_factor: float,
) -> None:
    """Run one pattern: a model's dispatch + combine, or a balanced all-to-all size sweep."""
    from commbench.run.harness import Job, RunOptions

    world = resolve_world_size(world_size)
    sweep = parse_backend_option_sweep(backend_option_pairs)
    fabric = FabricInputs(spec_text or _default_spec(), ranks_per_domain, ranks_per_host)
    system, _, spec_meta = prepare_fabric(fabric, world)
    if pattern_kind == "balanced":
        sizes = balanced_sizes(min_bytes, max_bytes, step_factor, world)
        jobs = [Job(name="balanced", kind="balanced", routing=None, sizes=sizes, warmup=warmup, iters=iters)]
    else:
        inputs = MoeInputs(model_name, skew, tokens, seed, mask_ratio, capacity_factor, send_mode)
        cfg = build_routing_config(inputs, world)
        jobs = [
            Job(name=cfg.model.name, kind="moe", routing=cfg, send_mode=send_mode, warmup=warmup, iters=iters)
        ]
    if backend != "auto":
        check_backend_available(backend)
    chosen, reason = resolve_backend(backend, world)
    backend_options = sweep.fixed
    if chosen == "sim":
        backend_options = sim_backend_options(backend_options, fabric)
    settings = sweep.settings()
    check_backend_options(chosen, [{**backend_options, **setting} for setting in settings])
    jobs = sweep_jobs(jobs, settings)
    out_dir = _prepare_out(out)
    if _is_rank0():
        swept = f"; {len(settings)} knob settings ({_sweep_text(sweep)})" if sweep.swept else ""
        _echo_err(
            f"commbench: backend {reason}; {world} ranks; spec {system.name}{swept}; report folder {out_dir}"
        )
    args = {
        "pattern": pattern_kind,
        "model": model_name if pattern_kind == "moe" else None,
        "skew": skew if pattern_kind == "moe" else None,
        "tokens_per_rank": tokens if pattern_kind == "moe" else None,
        "send_mode": send_mode,
        "mask_ratio": mask_ratio,
        "capacity_factor": capacity_factor,
        "seed": seed,
        "world_size": world,
        "backend": chosen,
        "backend_options": {**backend_options, **sweep.swept},
        "knob_settings": len(settings),
        "warmup": warmup,
        "iters": iters,
        "timeout_s": timeout_s,
        "sizes": jobs[0].sizes if pattern_kind == "balanced" else None,
        "spec": fabric.spec_text,
        "ranks_per_domain": ranks_per_domain,
        "ranks_per_host": ranks_per_host,
        "imbalance_cost": imbalance_cost and pattern_kind == "moe",
    }
    options = RunOptions(
        backend=chosen,
        backend_options=backend_options,
        timeout_s=timeout_s,
        corrupt=corrupt,
        ranks_per_domain=ranks_per_domain,
        ranks_per_host=ranks_per_host,
        imbalance_cost=imbalance_cost,
    )
    plan = LaunchPlan(
        jobs=jobs,
        options=options,
        out_dir=out_dir,
        meta={**_run_meta("run", args, reason), **spec_meta},
        total_steps=sum(_job_steps(job) for job in jobs),
        swept_keys=tuple(sweep.swept),
    )
    _launch(plan, world, chosen, timeout_s)
    if _is_rank0():
        click.echo(f"commbench: report written to {out_dir}")


@cli.command()
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="Number of ranks, in ranks. Default under torchrun: its WORLD_SIZE; otherwise required.",
)
@click.option(
    "--backend",
    type=click.Choice(BACKEND_CHOICES),
    default="auto",
    show_default=True,
    help="Communication backend (auto = nccl with a CUDA device per rank, else gloo).",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=None,
    help=f"Tokens per rank for the {SUITE_MODEL} cases, in tokens. Default: {SUITE_TOKENS} "
    f"({QUICK_TOKENS} with --quick).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=None,
    help=f"Untimed warm-up iterations per case. Default: 5 ({QUICK_WARMUP} with --quick).",
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    default=None,
    help=f"Timed iterations per case. Default: 20 ({QUICK_ITERS} with --quick).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Random seed of the routing (>= 0).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="Seconds a collective (or rank start-up) may take before the run aborts with exit code 4.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help=OUT_HELP,
)
@fabric_options
@click.option(
    "--imbalance-cost/--no-imbalance-cost",
    default=True,
    show_default=True,
    help="After each MoE case, rerun dispatch and combine on a balanced layout of the same rows (same code "
    "path, same launch) and report skew_cost = skewed time / balanced time.",
)
@click.option(
    "--quick",
    is_flag=True,
    help=f"Smoke test: sizes 1 KiB..{QUICK_MAX_BYTES >> 20} MiB x{QUICK_STEP_FACTOR:g}, "
    f"{QUICK_TOKENS} tokens, {QUICK_WARMUP} warm-up + {QUICK_ITERS} timed iterations.",
)
def suite(
    world_size: int | None,
    backend: str,
    tokens: int | None,
    warmup: int | None,
    iters: int | None,
    seed: int,
    timeout_s: float,
    out: str | None,
    spec_text: str | None,
    ranks_per_domain: int | None,
    ranks_per_host: int | None,
    imbalance_cost: bool,
    quick: bool,
) -> None:
    """The default suite in one launch and one report folder.

    \b
    1. balanced all-to-all sweep, 1 KiB .. 16 MiB each rank sends, x2 per step (nccl-tests -b 1K -e 16M -f 2);
    2. deepseek-v3 dispatch + combine (FP8 dispatch, BF16 combine, token mode) at skews
       uniform, zipf:1.2 and hot:8:0.3, 512 tokens per rank.
    Sized for 4 gloo ranks on 2 CPU cores to take a few minutes; on GPUs raise --tokens (e.g. 4096).
    """
    from commbench.run.harness import Job, RunOptions

    world = resolve_world_size(world_size)
    fabric = FabricInputs(spec_text or _default_spec(), ranks_per_domain, ranks_per_host)
    system, _, spec_meta = prepare_fabric(fabric, world)
    tokens = tokens or (QUICK_TOKENS if quick else SUITE_TOKENS)
    warmup = warmup if warmup is not None else (QUICK_WARMUP if quick else 5)
    iters = iters or (QUICK_ITERS if quick else 20)
    max_bytes = QUICK_MAX_BYTES if quick else SUITE_MAX_BYTES
    step = QUICK_STEP_FACTOR if quick else SUITE_STEP_FACTOR
    sizes = balanced_sizes(SUITE_MIN_BYTES, max_bytes, step, world)
    jobs = [Job(name="balanced", kind="balanced", routing=None, sizes=sizes, warmup=warmup, iters=iters)]
    for skew in SUITE_SKEWS:
        cfg = build_routing_config(MoeInputs(SUITE_MODEL, skew, tokens, seed, 0.0, None, "token"), world)
        jobs.append(
            Job(name=cfg.model.name, kind="moe", routing=cfg, send_mode="token", warmup=warmup, iters=iters)
        )
    if backend != "auto":
        check_backend_available(backend)
    chosen, reason = resolve_backend(backend, world)
    backend_options = sim_backend_options({}, fabric) if chosen == "sim" else {}
    out_dir = _prepare_out(out)
    total = sum(_job_steps(job) for job in jobs)
    if _is_rank0():
        _echo_err(
            f"commbench suite: backend {reason}; {world} ranks; spec {system.name}; {total} cases; "
            f"report folder {out_dir}"
        )
    args = {
        "suite": "quick" if quick else "default",
        "model": SUITE_MODEL,
        "skews": list(SUITE_SKEWS),
        "tokens_per_rank": tokens,
        "sizes": sizes,
        "seed": seed,
        "world_size": world,
        "backend": chosen,
        "warmup": warmup,
        "iters": iters,
        "timeout_s": timeout_s,
        "spec": fabric.spec_text,
        "ranks_per_domain": ranks_per_domain,
        "ranks_per_host": ranks_per_host,
        "imbalance_cost": imbalance_cost,
    }
    options = RunOptions(
        backend=chosen,
        backend_options=backend_options,
        timeout_s=timeout_s,
        ranks_per_domain=ranks_per_domain,
        ranks_per_host=ranks_per_host,
        imbalance_cost=imbalance_cost,
    )
    plan = LaunchPlan(
        jobs=jobs,
        options=options,
        out_dir=out_dir,
        meta={**_run_meta("suite", args, reason), **spec_meta},
        total_steps=total,
    )
    _launch(plan, world, chosen, timeout_s)
    if _is_rank0():
        click.echo(f"commbench: report written to {out_dir}")


@cli.command()
@common_moe_options
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    required=True,
    help="Number of ranks the experts are spread over.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the pattern (matrices and statistics) as JSON.")
def pattern(
    model_name: str,
    skew: str,
    tokens: int,
    send_mode: str,
    mask_ratio: float,
    capacity_factor: float | None,
    seed: int,
    world_size: int,
    as_json: bool,
) -> None:
    """Build a traffic pattern without running it and print its statistics (no processes are started)."""
    inputs = MoeInputs(model_name, skew, tokens, seed, mask_ratio, capacity_factor, send_mode)
    cfg = build_routing_config(inputs, world_size, dry_run=False)
    from commbench.traffic.pattern import build_pattern, pattern_to_json

    built = build_pattern(cfg, send_mode)
    if as_json:
        import json

        click.echo(json.dumps(pattern_to_json(built), indent=2))
        return
    click.echo(describe_pattern(built))


def _aligned(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A plain aligned text table: first column left, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return [line(headers), *(line(r) for r in rows)]


def describe_pattern(built: Any, top: int = 5) -> str:
    """Human-readable statistics of a Pattern: bytes per phase, imbalance, busiest destination ranks."""
    import numpy as np

    cfg = built.routing_cfg
    header = f"pattern {built.name}: skew {built.skew_text or '-'}, {built.world_size} ranks"
    if cfg is not None:
        header += f" x {cfg.tokens_per_rank} tokens per rank, seed {cfg.seed}"
    lines = [header + f", send mode {built.send_mode}"]
    if cfg is not None:
        model = cfg.model
        lines.append(
            f"model: hidden {model.hidden}, {model.num_experts} routed experts, top-{model.topk}; dispatch "
            f"{model.dispatch_dtype} {model.dispatch_bytes_per_token} B/row, combine {model.combine_dtype} "
            f"{model.combine_bytes_per_token} B/row"
        )
    rows = []
    for phase, matrix in (("dispatch", built.dispatch_bytes), ("combine", built.combine_bytes)):
        matrix = np.asarray(matrix, dtype=np.int64)
        sent, received, self_bytes = matrix.sum(1), matrix.sum(0), np.diag(matrix)
        total, self_total = int(matrix.sum()), int(self_bytes.sum())
        link_max = int(np.maximum(sent - self_bytes, received - self_bytes).max())
        mean_received = float(received.mean())
        rows.append(
            [
                phase,
                str(total),
                str(self_total),
                str(total - self_total),
                str(int(np.maximum(sent, received).max())),
                str(link_max),
                f"{received.max() / mean_received:.3f}" if mean_received else "-",
            ]
        )
    lines.append("")
    lines += _aligned(
        ["phase", "total(B)", "self(B)", "link(B)", "size(B)", "link max(B)", "recv max/mean"], rows
    )
    lines.append(
        "size = the bottleneck rank's max(sent, received), self traffic included; link max = its bytes "
        "excluding self traffic, one direction"
    )
    if built.stats:
        lines += ["", "imbalance statistics:"]
        lines += [f"  {key}: {_format_stat(value)}" for key, value in built.stats.items()]
    received = np.asarray(built.dispatch_bytes, dtype=np.int64).sum(0)
    mean = float(received.mean())
    lines += ["", "top destination ranks (dispatch bytes received, self incl.):"]
    for rank in np.argsort(-received, kind="stable")[:top]:
        ratio = f" ({received[rank] / mean:.2f}x mean)" if mean else ""
        lines.append(f"  rank {int(rank)}: {int(received[rank])} B{ratio}")
    return "\n".join(lines)


def _format_stat(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@cli.command()
@click.argument("report_dir", type=click.Path(file_okay=False))
def report(report_dir: str) -> None:
    """Re-render a saved report folder (results.parquet, results.json, summary.md, report.html) from its
    results.csv, ranks.csv and meta.json, and print the table."""
    from commbench.report import format_table, render_report

    frame = render_report(report_dir)
    click.echo(format_table(frame))
    click.echo(f"commbench: re-rendered {report_dir}")


def _register_optional_commands() -> None:
    """Commands other modules define (``commbench topo``, ``commbench simulate``), when present."""
    try:
        from commbench.cli import fabric as cli_fabric
    except ModuleNotFoundError as exc:
        if exc.name != "commbench.cli.fabric":
            raise
        return
    for name in ("topo", "simulate"):
        command = getattr(cli_fabric, name, None)
        if isinstance(command, click.Command):
            cli.add_command(command, name)


_register_optional_commands()


# ----------------------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> None:
    """Console script: exit 0 on success, else the error's exit code and one line on stderr."""
    cli.main(args=argv, prog_name="commbench")
