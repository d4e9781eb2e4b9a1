"""The run configuration: every option of run, suite, profile and pattern declared once, as a dataclass field.

An option is one field of one section below, with its help text, its command-line flag and the commands that
take it (``option``); ``commbench.cli.options`` generates the click options from these fields, so an option
shared by ``run`` and ``suite`` is one declaration. ``RunConfig.from_options`` builds the tree from a
command's parameters and checks it once (``check``: every rule that spans fields, e.g. ``--check every``
needs iteration timing); from then on the tree is handed down as it is: meta.json's ``config`` is
``config_meta.config_to_meta(config)`` (the field names are its keys), and ``--resume`` compares two trees
by equality.

``RunOptions`` is the section the harness (``commbench.run.harness``) reads; the launch fills in its
resolved backend and knob setting. Leaf field names are unique across the tree (the click parameter names).
This module imports neither torch, numpy nor click: ``commbench --help`` reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from commbench.errors import UsageError
from commbench.run.declare import (  # noqa: F401 - the bounds and words are this module's public names too
    CHECK_MODES,
    CORRUPT_PHASES,
    DEFAULT_ITERS,
    DEFAULT_WARMUP,
    GRAPH_TIMING,
    JOB_TIMINGS,
    LAUNCHED,
    MAX_BYTES,
    MAX_GRAPH_CALLS,
    MAX_INJECT_DELAY_S,
    MAX_RANKS,
    MAX_REPEATS,
    MAX_TIMEOUT_S,
    MAX_WINDOWS,
    QUICK_ITERS,
    QUICK_WARMUP,
    RUN,
    TIMINGS,
    OptionSpec,
    option,
    option_spec,
)
from commbench.run.graph_rules import decode_moe, graph_conflict
from commbench.run.workload import MoeConfig, PairwiseConfig, SuiteConfig, SweepConfig  # noqa: F401


@dataclass(frozen=True, order=True)
class InjectedDelay:
    """--inject-delay (test hook): ``src`` sleeps ``seconds`` before each timed call of every phase
    (``dst`` None), or, in the pairwise link test, before each timed send to ``dst``."""

    src: int
    dst: int | None
    seconds: float

    def text(self) -> str:
        """As it was given: RANK:US or SRC-DST:US."""
        where = str(self.src) if self.dst is None else f"{self.src}-{self.dst}"
        return f"{where}:{self.seconds * 1e6:g}"


@dataclass(frozen=True)
class RunOptions:
    """What the harness reads: the backend (resolved by the launch), its knob setting, and the options of
    every timed call."""

    backend: str = option(
        "auto",
        "Communication backend. auto = nccl when there is a CUDA device per rank (any under torchrun), else "
        "gloo (CPU). mock/sim/shmem-emu are emulated: reports label their timings.",
        kind="backend",
    )
    backend_options: dict[str, Any] = field(default_factory=dict)  # the fixed knobs (--backend-option)
    timeout_s: float = option(
        300.0,
        "Seconds a collective (or rank start-up) may take before the run aborts with exit code 4.",
        kind="float",
        flag="--timeout",
        low=1.0,
        high=MAX_TIMEOUT_S,
    )
    corrupt: str | None = option(
        None,
        "Test hook: corrupt one received byte/element on rank 0 (the run must exit 3).",
        kind="choice",
        choices=CORRUPT_PHASES,
        hidden=True,
        commands=RUN,
    )
    ranks_per_domain: int | None = option(
        None,
        "Override the discovered NVLink domains: contiguous groups of N ranks share one (a CPU what-if: 4 "
        "gloo ranks with N=2 stand for 2 domains of 2). Must divide the world size. Default: NVML fabric "
        "clique, else the host. pattern: the nodes of --send-mode node and the link classes it prints.",
        kind="int",
        low=1,
        high=MAX_RANKS,
        commands=(*LAUNCHED, "pattern"),
    )
    ranks_per_host: int | None = option(
        None,
        "Override the hosts: contiguous groups of N ranks per host (must divide --ranks-per-domain). Without "
        "--ranks-per-domain the NVLink domains stay the discovered fabric cliques, or where there are none "
        "follow these hosts (one domain per host). Default: discovered host names, or one host per domain "
        "with --ranks-per-domain.",
        kind="int",
        low=1,
        high=MAX_RANKS,
        commands=(*LAUNCHED, "pattern"),
    )
    imbalance_cost: bool | None = option(
        None,
        "After each MoE case, rerun dispatch and combine (same code path, same launch) on a uniform layout "
        "of the same rows, and add uniform_ref_time_us_p50, skew_cost (= skewed time / uniform time) and "
        "skew_bw_loss_pct to its rows. Default: on in suite, off in run.",
        kind="switch",
        show_default=False,
    )
    check: str = option(
        "checksum",
        "How the timed iterations are verified; before each one every receive buffer is filled with a "
        "sentinel, outside the timer. checksum: each timed iteration's output checksummed, the last verified "
        "byte for byte; every: every timed iteration verified byte for byte (slower; needs --timing "
        "iteration). With --timing window the window's last output is verified byte for byte (check "
        "window-last). Written in every result row (check) and meta.json.",
        kind="choice",
        choices=CHECK_MODES,
    )
    blocking: int = option(
        0,
        "As nccl-tests -z: 0 = a timed window's calls are issued without the host waiting for each one "
        "(torch.distributed async calls, waited for once at the window's end; NCCL queues them on its "
        "stream as it does anyway, gloo runs up to two at once on its worker threads, as PARAM's default "
        "--blocking 0 does); 1 = the host waits for each call to finish before issuing the next. Window "
        "timing only: iteration and graph timing wait for every call or replay. Combine and --send-mode "
        "node's stages use what they received, so they wait inside each call either way.",
        kind="int",
        low=0,
        high=1,
    )
    inject_delay: tuple[InjectedDelay, ...] = option(
        (),
        "Test hook: RANK:MICROSECONDS makes that rank sleep that long before each phase call of every timed "
        "iteration (every case, every backend), so the verdict's outlier rule can be tested; "
        "SRC-DST:MICROSECONDS makes SRC sleep before each of its timed sends to DST in the pairwise link "
        "test (that direction only). Each rank or pair at most once.",
        kind="delay",
        multiple=True,
        hidden=True,
    )
    profile: bool = option(
        False,
        "Profile each phase: its named steps per rank and iteration (count exchange, pack, payload transfer, "
        "send-back, weighted reduce; put issue, signal wait on NVSHMEM-style backends), every rank's arrival "
        "on one clock (who arrives late) -> profile.csv, arrivals.csv and the report's profile section. "
        "Times every iteration on its own (--timing iteration).",
        kind="flag",
    )

    def delay_s(self, rank: int) -> float:
        """The injected delay of ``rank`` before each timed call, in seconds (0: none)."""
        return next((d.seconds for d in self.inject_delay if d.dst is None and d.src == rank), 0.0)

    def pair_delay_s(self, src: int, dst: int) -> float:
        """The injected delay before each timed send from ``src`` to ``dst`` (pairwise test), in seconds."""
        return next((d.seconds for d in self.inject_delay if (d.src, d.dst) == (src, dst)), 0.0)

    def check_world(self, world_size: int) -> None:
        """UsageError for a check mode, corruption phase, injected delay or layout override that does not
        fit ``world_size`` ranks."""
        if self.corrupt is not None and self.corrupt not in CORRUPT_PHASES:
            raise UsageError(f"unknown corrupt phase {self.corrupt!r}; choose dispatch or combine")
        if self.check not in (*CHECK_MODES, CHECK_OFF):
            raise UsageError(f"unknown check mode {self.check!r}; choose {' or '.join(CHECK_MODES)}")
        seen: set[tuple[int, int | None]] = set()
        for delay in self.inject_delay:
            where = (delay.src, delay.dst)
            if where in seen:
                raise UsageError(
                    f"--inject-delay names {delay.text().split(':')[0]} twice; give each rank or pair once"
                )
            seen.add(where)
            if delay.dst is None and not 0 <= delay.src < world_size:
                raise UsageError(
                    f"--inject-delay names rank {delay.src}, but ranks are 0..{world_size - 1}; pick one"
                )
            if delay.dst is not None and (
                not (0 <= delay.src < world_size and 0 <= delay.dst < world_size) or delay.src == delay.dst
            ):
                raise UsageError(
                    f"--inject-delay {delay.src}-{delay.dst} needs two different ranks in "
                    f"0..{world_size - 1}; pick them"
                )
            if not 0 < delay.seconds <= MAX_INJECT_DELAY_S:
                raise UsageError(
                    f"--inject-delay {delay.seconds * 1e6:g} us is out of range; use "
                    f"1..{MAX_INJECT_DELAY_S * 1e6:g}"
                )
        from commbench.inputs.layout import build_layout

        build_layout(world_size, self.ranks_per_domain, self.ranks_per_host)


# Benchmark-only (benchmarks/bench_check.py, never offered by the CLI): no poisoning, no verification at all;
# rows say check "off" and #wrong n/a. The baseline the cost of checking is measured against.
CHECK_OFF = "off"


@dataclass(frozen=True)
class LaunchConfig:
    """Where the ranks run and where the report goes."""

    world_size: int | None = option(
        None,
        "Number of ranks (processes), in ranks. Default under torchrun: its WORLD_SIZE; otherwise required "
        "(commbench starts that many local processes).",
        kind="int",
        low=1,
        high=MAX_RANKS,
        show_default=False,
    )
    backend_option: tuple[str, ...] = option(
        (),
        "Backend knob (repeatable), e.g. num_blocks=24; lands in every result row. Several values "
        "(num_blocks=16,32,64) sweep them: every combination of the listed values runs in this one launch "
        "and report folder.",
        multiple=True,
        metavar="KEY=VALUE[,VALUE...]",
    )
    resume: str | None = option(
        None,
        "Continue the interrupted run whose report folder is DIR (its meta.json says INCOMPLETE), with the "
        "same command and options: the cases it finished are skipped, the rest appended to its files.",
        kind="dir",
        metavar="DIR",
    )
    out: str | None = option(
        None,
        "Report folder; must be new or empty. Default: reports/<UTC timestamp>/ (never overwritten).",
        kind="dir",
        show_default=False,
    )
    allow_cpu: bool = option(
        False,
        "Run on gloo (CPU ranks) even though this host shows GPUs that torch cannot use (a CPU torch build, "
        "a driver/CUDA mismatch). Without it such a run is refused (exit 2): its figures are this host's "
        "CPUs, not the GPUs it was meant to test.",
        kind="flag",
    )


@dataclass(frozen=True)
class TimingConfig:
    """How often and how each case is timed."""

    warmup: int | None = option(
        None,
        f"Untimed warm-up iterations per case. Default: {DEFAULT_WARMUP} ({QUICK_WARMUP} with suite "
        "--quick).",
        kind="int",
        low=0,
        high=MAX_REPEATS,
    )
    iters: int | None = option(
        None,
        f"Timed iterations per case. Default: {DEFAULT_ITERS} ({QUICK_ITERS} with suite --quick).",
        kind="int",
        low=1,
        high=MAX_REPEATS,
    )
    repeat: int | None = option(
        None,
        "Measurements per case: each case runs N times (repeat 0..N-1), round after round, and the report "
        "shows its range (min/median/max over repeats). Default: run 1; suite 3 for the MoE cases (their "
        "skew cost is a ratio of two times) and 1 for the balanced sweep, 1 with --quick.",
        kind="int",
        low=1,
        high=MAX_WINDOWS,
    )
    timing: str | None = option(
        None,
        "How each case is timed. window (nccl-tests' way): after the warm-up, one barrier, then one timer "
        "around --iters back-to-back calls; time = window / iters per rank (one sample, max over ranks), and "
        "only the window's last output is verified (check window-last). iteration: a barrier before every "
        "timed call and one timer each; p50/p99 over iterations, every iteration verified. Default: window "
        "for the balanced sweep (iteration with --check every), iteration for MoE dispatch/combine. Written "
        "in every result row (timing).",
        kind="choice",
        choices=TIMINGS,
    )

    cuda_graph: int | None = option(
        None,
        "CUDA graph timing (nccl-tests -G): N back-to-back calls of each phase captured into one CUDA "
        "graph after the warm-up, the graph replayed --iters times in one window; time = window / (iters "
        "x N), max over ranks; the last replay verified. Rows say timing graph. nccl (balanced, kineto) "
        "and nvshmem (counts=device, signal_op=add, N even) only; see docs/usage.md.",
        kind="int",
        low=1,
        high=MAX_GRAPH_CALLS,
        metavar="N",
        show_default=False,
    )

    def job_timing(self, check: str, kind_default: str) -> str:
        """A job's timing: "graph" with --cuda-graph, else --timing if given, else the job kind's default;
        --check every (each timed iteration verified) turns a window default into iteration timing."""
        if self.cuda_graph is not None:
            return GRAPH_TIMING
        if self.timing is not None:
            return self.timing
        return "iteration" if check == "every" else kind_default


@dataclass(frozen=True)
class AcceptanceConfig:
    """What the report compares with and the verdict judges by."""

    spec: str | None = option(
        None,
        "System spec the report compares with: a catalogue name or a YAML file with the same keys. Default: "
        "chosen from the GPUs the ranks see (NVML); a CPU run has none.",
        kind="spec",
        metavar="NAME|PATH",
        show_default=False,
    )
    limits: str | None = option(
        None,
        "Acceptance limits (YAML) laid over the spec's shipped ones (commbench/inputs/acceptance/"
        "<spec>.yaml; cpu.yaml for a CPU run): only the keys given change.",
        kind="file",
        metavar="FILE",
    )
    limit: tuple[str, ...] = option(
        (),
        "Override one acceptance limit (repeatable), e.g. --limit spread.confirm_reruns=3 or --limit "
        "balanced.large.busbw_fail_fraction=0.6.",
        multiple=True,
        metavar="KEY=VALUE",
    )
    baseline: str | None = option(
        None,
        "A baseline (commbench baseline RUN_DIR... --out FILE): each case is also judged against it (WARN > "
        "5%, FAIL > 10% worse than its median and beyond its run-to-run spread).",
        kind="file",
        metavar="FILE",
    )


@dataclass(frozen=True)
class ProfileConfig:
    """What the profiler writes besides the steps (``RunOptions.profile``)."""

    trace: bool = option(
        False,
        "With the profile, write trace.json: one Chrome/Perfetto trace of every rank (a process per rank, a "
        "track per step, on rank 0's clock); load it in ui.perfetto.dev or chrome://tracing. Implies "
        "--profile. On GPUs every step is also an NVTX range (Nsight Systems).",
        kind="flag",
    )
    torch_profiler: bool = option(
        False,
        "Capture a torch.profiler (Kineto) trace of every rank's timed iterations (kineto/rank<R>.json) and "
        "report communication time and its overlap with compute per rank, kernels classified by a registry "
        "of communication kernels (NCCL, NVSHMEM, commbench's put kernels, DeepEP, ...).",
        kind="flag",
    )
    tflops: float | None = option(
        None,
        "Per-GPU throughput for the comm/compute budget of the MoE cases (TFLOP/s). Default: 1648, the "
        "DeepSeek-V3 training record on GB300 NVL72; the spec's dense peak is shown beside it.",
        kind="float",
        low=0.0,
        high=1e6,
        open_low=True,
    )


@dataclass(frozen=True)
class RunConfig:
    """Every option of one launched command, in sections; ``command`` is run, profile or suite."""

    command: str = "run"
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    harness: RunOptions = field(default_factory=RunOptions)
    timing: TimingConfig = field(default_factory=TimingConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    profiler: ProfileConfig = field(default_factory=ProfileConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    suite: SuiteConfig = field(default_factory=SuiteConfig)
    pairwise: PairwiseConfig = field(default_factory=PairwiseConfig)

    @property
    def world_size(self) -> int:
        """The resolved world size (``from_options`` fills it in)."""
        assert self.launch.world_size is not None
        return self.launch.world_size

    @classmethod
    def from_options(cls, command: str, values: dict[str, Any]) -> RunConfig:
        """The tree from a command's parameters (leaf name -> value; those the command does not take keep
        their defaults), with the defaults that depend on other options resolved and every cross-field rule
        checked (UsageError, one line). ``profile`` is ``run --profile``."""
        sections = {}
        for item in dataclasses.fields(cls):
            if item.name == "command":
                continue
            section = item.default_factory()  # type: ignore[misc]
            given = {f.name: values[f.name] for f in dataclasses.fields(section) if f.name in values}
            sections[item.name] = dataclasses.replace(section, **given)
        unknown = set(values) - {f.name for s in sections.values() for f in dataclasses.fields(s)}
        if unknown:
            raise TypeError(f"not config fields: {sorted(unknown)}")
        config = cls(command=command, **sections)
        return config.resolved()

    def resolved(self) -> RunConfig:
        """Defaults that depend on the command or other options filled in, then ``check``."""
        from commbench.run.dist import resolve_world_size

        quick = self.suite.quick
        suite = self.command == "suite"
        harness = self.harness
        profile = harness.profile or self.profiler.trace or self.command == "profile"
        imbalance = harness.imbalance_cost if harness.imbalance_cost is not None else suite
        harness = dataclasses.replace(harness, profile=profile, imbalance_cost=bool(imbalance))
        timing = self.timing
        if profile:
            if timing.timing == "window":
                raise UsageError(
                    "--profile and --trace time every iteration on its own: drop --timing window"
                )
            timing = dataclasses.replace(timing, timing="iteration")
        if harness.check == "every" and timing.timing == "window":
            raise UsageError("--check every needs --timing iteration")
        if timing.cuda_graph is not None and graph_conflict(self, harness, timing):
            raise UsageError(f"--cuda-graph {timing.cuda_graph} {graph_conflict(self, harness, timing)}")
        if self.moe.send_mode == "node" and harness.imbalance_cost:
            raise UsageError(
                "--imbalance-cost reruns a uniform layout of the same rows, which --send-mode node's two "
                "stages do not have; drop --imbalance-cost or use --send-mode token"
            )
        if self.moe.send_mode == "node" and self.sweep.nccl_tests_matrix is not None:
            raise UsageError(
                "--nccl-tests-matrix writes one all-to-all, --send-mode node runs two (scale-out, then "
                "NVLink); use --send-mode token or selection"
            )
        moe = self.moe
        if moe.decode:
            moe = decode_moe(moe, self.sweep.pattern)
        timing = dataclasses.replace(
            timing,
            warmup=timing.warmup
            if timing.warmup is not None
            else (QUICK_WARMUP if quick else DEFAULT_WARMUP),
            iters=timing.iters if timing.iters is not None else (QUICK_ITERS if quick else DEFAULT_ITERS),
        )
        launch = dataclasses.replace(self.launch, world_size=resolve_world_size(self.launch.world_size))
        if self.acceptance.spec is not None and not self.acceptance.spec.strip():
            raise UsageError("--spec '' names no spec; leave --spec out to choose it from the GPUs")
        if launch.resume and launch.out:
            raise UsageError("--resume DIR writes into DIR: leave out --out")
        config = dataclasses.replace(self, launch=launch, harness=harness, timing=timing, moe=moe)
        harness.check_world(launch.world_size)
        return config


# Options that may differ between an interrupted run and the one resuming it: they do not change which cases
# run or what a case measures.
RESUME_FREE = frozenset({"timeout_s", "limits", "limit", "baseline", "inject_delay", "resume", "out"})
