"""Command-line option types and the options shared by several commands, each declared once.

``moe_options`` (the routing inputs) serve ``run`` and ``pattern``; the launch options (world size, backend,
iterations, timeout, check mode, timing, report folder, spec and layout overrides) serve ``run`` and
``suite``. Help
texts state units and defaults.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import click

from commbench.backends import BACKENDS

# Bounds of the integer and size options. Each is far beyond a real run and keeps the products computed
# from it (rows x row bytes, tokens x top-k x ranks) inside int64; what a machine can hold is the memory
# estimate's business (commbench.cli.resources), not these.
MAX_BYTES = 1 << 50  # --min-bytes / --max-bytes: 1 PiB each rank sends
MAX_TOKENS = 1 << 31  # tokens per rank: serving batches are ~10^3..10^5
MAX_SEED = (1 << 63) - 1  # stored as int64 in the report files
MAX_TIMEOUT_S = 86400.0  # a collective that takes a day has hung
MAX_REPEATS = 1 << 31  # --warmup / --iters
MAX_RANKS = 1 << 24  # ranks per NVLink domain, per host, per leaf group: 16M GPUs
# Expert capacity: at num_experts / top-k x the mean nothing is dropped any more; the bound keeps
# tokens x top-k x factor inside int64.
MAX_CAPACITY_FACTOR = 1e6
DEFAULT_WARMUP = 5
DEFAULT_ITERS = 20
# suite --quick: a smoke test of the whole pipeline in seconds.
QUICK_WARMUP = 2
QUICK_ITERS = 5


class ByteSize(click.ParamType):
    """A byte count with an optional binary suffix, as nccl-tests -b/-e: 4096, 64K, 16M, 1G (K = 1024)."""

    name = "BYTES"
    _pattern = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
    _scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            count = value
        else:
            match = self._pattern.match(str(value))
            if not match:
                self.fail(
                    f"{str(value)[:40]!r} is not a byte count; use e.g. 4096, 64K, 16M or 1G (K = 1024)",
                    param,
                    ctx,
                )
            digits = match.group(1).lstrip("0") or "0"
            # More digits than 2^50 has: too large, without converting a 100,000-digit number first.
            count = MAX_BYTES + 1 if len(digits) > 16 else int(digits) * self._scale[match.group(2).lower()]
        if count > MAX_BYTES:
            # Far beyond any machine (the memory estimate refuses much less); keeps every later product of a
            # size within int64 and float64's exact integers.
            self.fail(f"{str(value)[:40]!r} is above the largest size taken, 1P (2^50 bytes)", param, ctx)
        return count


class FiniteFloat(click.FloatRange):
    """A finite number in a range. click's FLOAT takes "nan" and "inf", and NaN passes every range check, so
    every float option uses this type (tests/cli/test_bad_input.py checks that none uses another)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{str(value)[:40]!r} is not a finite number", param, ctx)
        return float(super().convert(number, param, ctx))


def finite_float(
    min: float | None = None,  # noqa: A002 - click's own names
    max: float | None = None,  # noqa: A002
    min_open: bool = False,
    max_open: bool = False,
) -> FiniteFloat:
    """A FiniteFloat type: finite, and within [min, max] (open ends as given)."""
    return FiniteFloat(min=min, max=max, min_open=min_open, max_open=max_open)


BYTES = ByteSize()
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _model_help() -> str:
    try:
        from commbench.inputs.models import list_models

        names = ", ".join(list_models())
    except Exception:  # help must work even if presets cannot be listed
        names = "see commbench/inputs/presets/"
    return f"Model preset name ({names}) or path to a YAML file with the same keys."


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


SKEW_HELP = (
    "Expert popularity: uniform | zipf:S (Zipf exponent S) | hot:N:F (N hot experts get fraction F of "
    "selections) | rank-imbalance:R (one rank's experts get R x the load) | trace:PATH (recorded routing) | "
    "load:PATH[:LAYER] (a router's expert-load table, CSV/Parquet: layer, expert, tokens)."
)

SEED = click.option(
    "--seed",
    type=click.IntRange(min=0, max=MAX_SEED),
    default=0,
    show_default=True,
    help="Random seed of the routing (integer >= 0).",
)

# --replicas: EPLB redundant experts (commbench.traffic.replicas), on run, suite and pattern.
REPLICAS = click.option(
    "--replicas",
    type=click.IntRange(min=0, max=MAX_RANKS),  # the real bound, experts x (ranks - 1), needs the model
    default=0,
    show_default=True,
    help="EPLB redundant experts: N extra expert slots placed by DeepSeek EPLB's greedy balance of the "
    "measured expert load (hot experts replicated, slots packed onto the least-loaded ranks), each expert's "
    "tokens split among its replicas; experts + N must divide evenly over the ranks. run and suite run each "
    "MoE case without and with them (knob replicas=N); pattern prints the placement. 0: none.",
)

_MOE_OPTIONS = (
    click.option("--model", "model_name", default="deepseek-v3", show_default=True, help=_model_help()),
    click.option("--skew", default="uniform", show_default=True, help=SKEW_HELP),
    click.option(
        "--tokens",
        type=click.IntRange(min=1, max=MAX_TOKENS),
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
        type=finite_float(0.0, 1.0, max_open=True),
        default=0.0,
        show_default=True,
        help="Fraction of (token, expert) selections dropped at random, in [0, 1) (as DeepEP's "
        "masked ratio).",
    ),
    click.option(
        "--capacity-factor",
        type=finite_float(0.0, MAX_CAPACITY_FACTOR, min_open=True),
        default=None,
        help="Expert capacity as a multiple of tokens/experts per source rank; selections over it are "
        "dropped. Default: no capacity limit.",
    ),
    SEED,
    REPLICAS,
)


def moe_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--model, --skew, --tokens, --send-mode, --mask-ratio, --capacity-factor, --seed, --replicas (run,
    pattern)."""
    for option in reversed(_MOE_OPTIONS):
        func = option(func)
    return func


# The launch options of run and suite, applied one by one so each command keeps its order in --help.
WORLD_SIZE = click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="Number of ranks (processes), in ranks. Default under torchrun: its WORLD_SIZE; otherwise required "
    "(commbench starts that many local processes).",
)
BACKEND = click.option(
    "--backend",
    type=click.Choice(["auto", *BACKENDS]),
    default="auto",
    show_default=True,
    help="Communication backend. auto = nccl when there is a CUDA device per rank (any under torchrun), "
    "else gloo (CPU). mock/sim/shmem-emu are emulated: reports label their timings.",
)
WARMUP = click.option(
    "--warmup",
    type=click.IntRange(min=0, max=MAX_REPEATS),
    default=None,
    help=f"Untimed warm-up iterations per case. Default: {DEFAULT_WARMUP} ({QUICK_WARMUP} with suite "
    "--quick).",
)
ITERS = click.option(
    "--iters",
    type=click.IntRange(min=1, max=MAX_REPEATS),
    default=None,
    help=f"Timed iterations per case. Default: {DEFAULT_ITERS} ({QUICK_ITERS} with suite --quick).",
)
TIMEOUT = click.option(
    "--timeout",
    "timeout_s",
    type=finite_float(1.0, MAX_TIMEOUT_S),
    default=300.0,
    show_default=True,
    help="Seconds a collective (or rank start-up) may take before the run aborts with exit code 4.",
)
# The choices are commbench.run.jobs.CHECK_MODES (not imported here: --help must not load torch).
CHECK = click.option(
    "--check",
    "check_mode",
    type=click.Choice(["checksum", "every"]),
    default="checksum",
    show_default=True,
    help="How the timed iterations are verified; before each one every receive buffer is filled with a "
    "sentinel, outside the timer. checksum: each timed iteration's output checksummed, the last verified "
    "byte for byte; every: every timed iteration verified byte for byte (slower; needs --timing iteration). "
    "With --timing window the window's last output is verified byte for byte (check window-last). Written "
    "in every result row (check) and meta.json.",
)
# The choices are commbench.run.jobs.TIMINGS (not imported here: --help must not load torch).
TIMING = click.option(
    "--timing",
    type=click.Choice(["window", "iteration"]),
    default=None,
    help="How each case is timed. window (nccl-tests' way): after the warm-up, one barrier, then one timer "
    "around --iters back-to-back calls; time = window / iters per rank (one sample, max over ranks), and "
    "only the window's last output is verified (check window-last). iteration: a barrier before every "
    "timed call and one timer each; p50/p99 over iterations, every iteration verified. Default: window for "
    "the balanced sweep (iteration with --check every), iteration for MoE dispatch/combine. Written in every "
    "result row (timing).",
)


class InjectDelay(click.ParamType):
    """RANK:MICROSECONDS -> (rank, seconds), SRC-DST:MICROSECONDS -> (src, dst, seconds): the hidden
    --inject-delay test hook."""

    name = "RANK:US|SRC-DST:US"
    _rank = re.compile(r"^\s*(\d{1,8})\s*:\s*(\d{1,8}(?:\.\d*)?)\s*$")
    _pair = re.compile(r"^\s*(\d{1,8})\s*-\s*(\d{1,8})\s*:\s*(\d{1,8}(?:\.\d*)?)\s*$")

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, float] | tuple[int, int, float]:
        if isinstance(value, tuple):
            return value
        if match := self._rank.match(str(value)):
            if float(match.group(2)) > 0:
                return int(match.group(1)), float(match.group(2)) / 1e6
        elif (match := self._pair.match(str(value))) and float(match.group(3)) > 0:
            return int(match.group(1)), int(match.group(2)), float(match.group(3)) / 1e6
        self.fail(
            f"{str(value)[:40]!r} is not RANK:MICROSECONDS or SRC-DST:MICROSECONDS; use e.g. 2:5000 or "
            "1-2:5000",
            param,
            ctx,
        )


INJECT_DELAY = click.option(
    "--inject-delay",
    "inject_delay",
    type=InjectDelay(),
    multiple=True,
    hidden=True,
    help="Test hook: RANK:MICROSECONDS makes that rank sleep that long before each phase call of every "
    "timed iteration (every case, every backend), so the verdict's outlier rule can be tested; "
    "SRC-DST:MICROSECONDS makes SRC sleep before each of its timed sends to DST in the pairwise link test "
    "(that direction only).",
)


class Duration(click.ParamType):
    """A duration as operators write it: 90s, 30m, 2h, 1h30m, or plain seconds -> seconds (float)."""

    name = "DURATION"
    _part = re.compile(r"(\d{1,7}(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)
    _scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
    MAX_S = 7 * 86400.0

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        parts = self._part.findall(text)
        seconds = sum(float(number) * self._scale[unit.lower()] for number, unit in parts)
        if not parts or self._part.sub("", text).strip() or not 0 < seconds <= self.MAX_S:
            self.fail(
                f"{text[:40]!r} is not a duration of up to 7 days; use e.g. 30m, 2h or 1h30m", param, ctx
            )
        return seconds


PAIR_BYTES = click.option(
    "--pair-bytes",
    type=BYTES,
    default=None,
    help="Pairwise link test: message size of its bandwidth windows (K/M/G = 1024-based). Default: the "
    "spec's acceptance limits (pairwise.bandwidth_bytes: 256M on GPU specs, 1M on a CPU run).",
)
_ACCEPTANCE_OPTIONS = (
    click.option(
        "--limits",
        "limits_file",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="Acceptance limits (YAML) laid over the spec's shipped ones (commbench/inputs/acceptance/"
        "<spec>.yaml; cpu.yaml for a CPU run): only the keys given change.",
    ),
    click.option(
        "--limit",
        "limit_overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one acceptance limit (repeatable), e.g. --limit spread.confirm_reruns=3 or "
        "--limit balanced.large.busbw_fail_fraction=0.6.",
    ),
    click.option(
        "--baseline",
        "baseline_file",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="A baseline (commbench baseline RUN_DIR... --out FILE): each case is also judged against it "
        "(WARN > 5%, FAIL > 10% worse than its median and beyond its run-to-run spread).",
    ),
)


_PROFILE_OPTIONS = (
    click.option(
        "--profile",
        is_flag=True,
        help="Profile each phase: its named steps per rank and iteration (count exchange, pack, payload "
        "transfer, send-back, weighted reduce; put issue, signal wait on NVSHMEM-style backends), every "
        "rank's arrival on one clock (who arrives late) -> profile.csv, arrivals.csv and the report's "
        "profile section. Times every iteration on its own (--timing iteration).",
    ),
    click.option(
        "--trace",
        is_flag=True,
        help="With the profile, write trace.json: one Chrome/Perfetto trace of every rank (a process per "
        "rank, a track per step, on rank 0's clock); load it in ui.perfetto.dev or chrome://tracing. Implies "
        "--profile. On GPUs every step is also an NVTX range (Nsight Systems).",
    ),
    click.option(
        "--torch-profiler",
        is_flag=True,
        help="Capture a torch.profiler (Kineto) trace of every rank's timed iterations (kineto/rank<R>.json) "
        "and report communication time and its overlap with compute per rank, kernels classified by a "
        "registry of communication kernels (NCCL, NVSHMEM, commbench's put kernels, DeepEP, ...).",
    ),
    click.option(
        "--tflops",
        type=finite_float(0.0, 1e6, min_open=True),
        default=None,
        help="Per-GPU throughput for the comm/compute budget of the MoE cases (TFLOP/s). Default: 1648, the "
        "DeepSeek-V3 training record on GB300 NVL72; the spec's dense peak is shown beside it.",
    ),
)


def profile_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--profile, --trace, --torch-profiler and --tflops (run, profile and suite)."""
    for option in reversed(_PROFILE_OPTIONS):
        func = option(func)
    return func


def acceptance_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--limits, --limit and --baseline (run and suite): what the verdict judges by."""
    for option in reversed(_ACCEPTANCE_OPTIONS):
        func = option(func)
    return func


MAX_WINDOWS = 1000
REPEAT = click.option(
    "--repeat",
    type=click.IntRange(min=1, max=MAX_WINDOWS),
    default=None,
    help="Measurements per case: each case runs N times (repeat 0..N-1), round after round, and the report "
    "shows its range (min/median/max over repeats). Default: run 1; suite 3 for the MoE cases (their skew "
    "cost is a ratio of two times) and 1 for the balanced sweep, 1 with --quick.",
)
RESUME = click.option(
    "--resume",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Continue the interrupted run whose report folder is DIR (its meta.json says INCOMPLETE), with the "
    "same command and options: the cases it finished are skipped, the rest appended to its files.",
)
OUT = click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Report folder; must be new or empty. Default: reports/<UTC timestamp>/ (never overwritten).",
)
NCCL_TESTS_MATRIX = click.option(
    "--nccl-tests-matrix",
    "nccl_tests_matrix",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also write the MoE pattern's dispatch bytes as an nccl-tests alltoallv_perf traffic matrix to FILE "
    "(a row per sending rank, bytes; combine to FILE with .combine before its suffix) and print the "
    "alltoallv_perf command that moves the same bytes. FILE must not exist.",
)
_LAYOUT_OPTIONS = (
    click.option("--spec", "spec_text", default=None, metavar="NAME|PATH", help=_spec_help()),
    click.option(
        "--ranks-per-domain",
        type=click.IntRange(min=1, max=MAX_RANKS),
        default=None,
        help="Override the discovered NVLink domains: contiguous groups of N ranks share one (a CPU what-if: "
        "4 gloo ranks with N=2 stand for 2 domains of 2). Default: NVML fabric clique, else the host.",
    ),
    click.option(
        "--ranks-per-host",
        type=click.IntRange(min=1, max=MAX_RANKS),
        default=None,
        help="Override the hosts: contiguous groups of N ranks per host (must divide --ranks-per-domain). "
        "Default: discovered host names, or one host per domain with --ranks-per-domain.",
    ),
)


def layout_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--spec and the NVLink-domain / host layout overrides (run and suite)."""
    for option in reversed(_LAYOUT_OPTIONS):
        func = option(func)
    return func


def imbalance_cost_option(default: bool) -> Decorator:
    """--imbalance-cost/--no-imbalance-cost; on by default in the suite, off in run."""
    return click.option(
        "--imbalance-cost/--no-imbalance-cost",
        default=default,
        show_default=True,
        help="After each MoE case, rerun dispatch and combine (same code path, same launch) on a uniform "
        "layout of the same rows, and add uniform_ref_time_us_p50, skew_cost (= skewed time / uniform time) "
        "and skew_bw_loss_pct to its rows.",
    )
