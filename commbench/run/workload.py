"""The options that say what runs: an MoE case's routing, run's pattern and balanced sweep, the suite's cases
and the pairwise test's message size (sections of ``commbench.run.config.RunConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from commbench.run.declare import (
    MAX_CAPACITY_FACTOR,
    MAX_RANKS,
    MAX_SEED,
    MAX_TOKENS,
    MOE,
    PATTERNS,
    RUN,
    SEND_MODES,
    SKEW_HELP,
    option,
)

# The decode case (run --decode, one per model in the suite): a serving engine's decode step, DeepEP's
# low-latency regime (its tests: 128 tokens per rank, per-selection messages), timed as a CUDA graph where
# the backend can capture it (run.graphs) and read as a latency in microseconds.
DECODE = "decode"
DECODE_TOKENS = 128
DECODE_SEND_MODE = "selection"
DEFAULT_TOKENS = 4096


@dataclass(frozen=True)
class MoeConfig:
    """The routing of one MoE case (run, profile, pattern)."""

    model: str = option("deepseek-v3", "", kind="model", commands=MOE)
    skew: str = option("uniform", SKEW_HELP, commands=MOE)
    tokens: int = option(
        DEFAULT_TOKENS,
        "Tokens per rank (the batch each rank dispatches), in tokens.",
        kind="int",
        low=1,
        high=MAX_TOKENS,
        commands=MOE,
    )
    send_mode: str = option(
        "token",
        "token: one row per (token, destination rank); selection: one row per (token, expert) selection, as "
        "per-expert all-to-all dispatchers; node: per-node (hierarchical) dispatch as DeepEP's internode "
        "kernels, Hybrid-EP and UCCL-EP, in two stages: a token once to each other node holding its experts "
        "(scale-out, to the rank of the same local index), then once to each rank of the node holding them "
        "(NVLink); nodes = NVLink domains (--ranks-per-domain); nccl and gloo only.",
        kind="choice",
        choices=SEND_MODES,
        commands=MOE,
    )
    decode: bool = option(
        False,
        f"The decode case: {DECODE_TOKENS} tokens per rank, --send-mode {DECODE_SEND_MODE} (a message per "
        "(token, expert) selection, as low-latency kernels send), its latency in us, timed as a CUDA graph "
        "where the backend can capture it (else per iteration; the rows' timing says which); its rows' "
        "pattern is '<model> decode'.",
        kind="flag",
        commands=RUN,
    )
    mask_ratio: float = option(
        0.0,
        "Fraction of (token, expert) selections dropped at random, in [0, 1) (as DeepEP's masked ratio).",
        kind="float",
        low=0.0,
        high=1.0,
        open_high=True,
        commands=MOE,
    )
    capacity_factor: float | None = option(
        None,
        "Expert capacity as a multiple of tokens/experts per source rank; selections over it are dropped. "
        "Default: no capacity limit.",
        kind="float",
        low=0.0,
        high=MAX_CAPACITY_FACTOR,
        open_low=True,
        commands=MOE,
        show_default=False,
    )
    seed: int = option(
        0,
        "Random seed of the routing (integer >= 0).",
        kind="int",
        low=0,
        high=MAX_SEED,
        commands=(*MOE, "suite", "simulate"),
    )
    replicas: int = option(
        0,
        "EPLB redundant experts: N extra expert slots placed by DeepSeek EPLB's greedy balance of the "
        "measured expert load (hot experts replicated, slots packed onto the least-loaded ranks), each "
        "expert's tokens split among its replicas; experts + N must divide evenly over the ranks. run and "
        "suite run each MoE case without and with them (knob replicas=N); pattern prints the placement. 0: "
        "none.",
        kind="int",
        low=0,
        high=MAX_RANKS,
        commands=(*MOE, "suite"),
    )


@dataclass(frozen=True)
class SweepConfig:
    """What ``run`` runs: the pattern and, for the balanced sweep, its sizes (nccl-tests -b/-e/-f)."""

    pattern: str = option(
        "moe",
        "moe: the model's dispatch and combine phases; balanced: an nccl-tests-style all-to-all size sweep; "
        "pairwise: the pairwise link test alone (every ordered pair, one way and both ways; --pair-bytes); "
        "kineto: the all-to-all calls of a torch.profiler trace (--kineto-trace).",
        kind="choice",
        choices=PATTERNS,
        commands=RUN,
    )
    kineto_trace: str | None = option(
        None,
        "With --pattern kineto: a torch.profiler (Kineto) trace of a training step, a .json/.json.gz file "
        "per rank (a file or their folder). Each all-to-all call of its process group runs as one "
        "all-to-all-v moving the bytes of the trace's split sizes, verified; a result row per call.",
        commands=RUN,
        metavar="PATH",
        show_default=False,
    )
    min_bytes: int = option(
        1 << 10,
        "Balanced: smallest size, bytes each rank sends in total (nccl-tests -b; K/M/G = 1024-based).",
        kind="bytes",
        commands=RUN,
    )
    max_bytes: int | None = option(
        None,
        "Largest balanced size, bytes each rank sends (nccl-tests -e; K/M/G = 1024-based). Sizes are rounded "
        "down to a multiple of the world size. Default: run 16M; suite 16M (1M with --quick); on a GPU rack "
        "e.g. 1G.",
        kind="bytes",
        show_default=False,
    )
    step_factor: float = option(
        2.0,
        "Balanced: multiply the size by this factor between steps (nccl-tests -f).",
        kind="float",
        low=1.0,
        open_low=True,
        commands=RUN,
    )
    nccl_tests_matrix: str | None = option(
        None,
        "Also write the MoE pattern's dispatch bytes as an nccl-tests alltoallv_perf traffic matrix to FILE "
        "(a row per sending rank, bytes; combine to FILE with .combine before its suffix) and print the "
        "alltoallv_perf command that moves the same bytes. FILE must not exist.",
        kind="file",
        commands=(*RUN, "pattern"),
        metavar="FILE",
    )


@dataclass(frozen=True)
class SuiteConfig:
    """The default suite's cases (suite only)."""

    models: tuple[str, ...] = option(
        (),
        "Model preset or YAML file of the MoE cases (repeatable). Default: deepseek-v3.",
        flag="--model",
        multiple=True,
        commands=("suite",),
        metavar="NAME|PATH",
    )
    skews: tuple[str, ...] = option(
        (),
        "Skew of the MoE cases (repeatable; every model runs every skew). Default: uniform, zipf:1.2, "
        "hot:8:0.3. " + SKEW_HELP,
        flag="--skew",
        multiple=True,
        commands=("suite",),
    )
    suite_tokens: int | None = option(
        None,
        "Tokens per rank of the MoE cases. Default: 512 (128 with --quick); on a GPU rack use 4096.",
        kind="int",
        flag="--tokens",
        low=1,
        high=MAX_TOKENS,
        commands=("suite",),
        show_default=False,
    )
    soak_s: float | None = option(
        None,
        "Soak test: run the largest balanced size and the MoE cases round after round for this long (e.g. "
        "30m, 2h); busbw per repeat over time in report.html, each case's drift from its first repeats to "
        "its last judged (soak.drift_*_pct), with the health counters before/after and #wrong of every "
        "repeat.",
        kind="duration",
        flag="--soak",
        commands=("suite",),
        show_default=False,
    )
    pairwise: bool = option(
        True,
        "After the all-to-all cases, the pairwise link test: every ordered pair of ranks one way and both "
        "ways at once, in rounds of disjoint pairs; [src][dst] bandwidth and latency matrices (pairs.csv, "
        "heatmaps) and each pair judged against its link class.",
        kind="switch",
        commands=("suite",),
    )
    quick: bool = option(
        False,
        "Smoke test: sizes 1 KiB..1 MiB x4, 128 tokens, 2 warm-up + 5 timed iterations, one repeat.",
        kind="flag",
        commands=("suite",),
    )


@dataclass(frozen=True)
class PairwiseConfig:
    """The pairwise link test's message size (its iterations are --warmup and --iters)."""

    pair_bytes: int | None = option(
        None,
        "Pairwise link test: message size of its bandwidth windows (K/M/G = 1024-based). Default: the spec's "
        "acceptance limits (pairwise.bandwidth_bytes: 256M on GPU specs, 1M on a CPU run).",
        kind="bytes",
        low=1,
        show_default=False,
    )
