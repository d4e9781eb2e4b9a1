"""How a config field declares a command-line option (``option``, ``OptionSpec``), the options' bounds and
the words their values take. Imports nothing heavy: ``commbench --help`` reads it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Bounds of the integer and size options. Each is far beyond a real run and keeps the products computed from
# it (rows x row bytes, tokens x top-k x ranks) inside int64; what a machine can hold is the memory
# estimate's business (commbench.cli.resources), not these.
MAX_BYTES = 1 << 50  # --min-bytes / --max-bytes: 1 PiB each rank sends
MAX_TOKENS = 1 << 31  # tokens per rank: serving batches are ~10^3..10^5
MAX_SEED = (1 << 63) - 1  # stored as int64 in the report files
MAX_TIMEOUT_S = 86400.0  # a collective that takes a day has hung
MAX_REPEATS = 1 << 31  # --warmup / --iters
MAX_RANKS = 1 << 24  # ranks per NVLink domain, per host, per leaf group: 16M GPUs
MAX_WINDOWS = 1000  # --repeat
# Expert capacity: at num_experts / top-k x the mean nothing is dropped any more; the bound keeps
# tokens x top-k x factor inside int64.
MAX_CAPACITY_FACTOR = 1e6
MAX_INJECT_DELAY_S = 10.0  # --inject-delay: a typo cannot stall a run for hours
DEFAULT_WARMUP = 5
DEFAULT_ITERS = 20
QUICK_WARMUP = 2  # suite --quick: a smoke test of the whole pipeline in seconds
QUICK_ITERS = 5

CHECK_MODES = ("checksum", "every")
TIMINGS = ("window", "iteration")
# --cuda-graph N: a job's calls captured N at a time into one CUDA graph and the graph replayed (run.graphs);
# a job timing of its own, never one of --timing's choices.
GRAPH_TIMING = "graph"
JOB_TIMINGS = (*TIMINGS, GRAPH_TIMING)
MAX_GRAPH_CALLS = 1 << 16  # calls captured in one graph: each is a node set of its own, kept on the GPU
CORRUPT_PHASES = ("dispatch", "combine")
SEND_MODES = ("token", "selection", "node")
PATTERNS = ("moe", "balanced", "pairwise", "kineto")

RUN = ("run", "profile")
LAUNCHED = ("run", "profile", "suite")
MOE = ("run", "profile", "pattern")

SKEW_HELP = (
    "Expert popularity: uniform | zipf:S (Zipf exponent S) | hot:N:F (N hot experts get fraction F of "
    "selections) | rank-imbalance:R (one rank's experts get R x the load) | trace:PATH (recorded routing) | "
    "load:PATH[:LAYER] (a router's expert-load table, CSV/Parquet: layer, expert, tokens)."
)


@dataclass(frozen=True)
class OptionSpec:
    """How one config field appears on the command line: ``kind`` names its value type for the generator in
    ``commbench.cli.options`` (int, float, str, path, file, dir, bytes, duration, choice, flag, switch,
    backend, delay, model, spec), ``low``/``high`` its range (``open_low``: strictly above ``low``)."""

    help: str
    kind: str = "str"
    commands: tuple[str, ...] = LAUNCHED
    flag: str | None = None  # default: --<field name with dashes>
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    multiple: bool = False
    hidden: bool = False
    metavar: str | None = None
    show_default: bool = True


def option(default: Any, help: str, **spec: Any) -> Any:  # noqa: A002 - the option's help text
    """A config field that is also a command-line option (``OptionSpec``'s keywords)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("option defaults are immutable: use a tuple")
    return field(default=default, metadata={"option": OptionSpec(help=help, **spec)})


def option_spec(item: dataclasses.Field[Any]) -> OptionSpec | None:
    """The command-line spec of a config field, None for a field that is not an option."""
    return item.metadata.get("option")
