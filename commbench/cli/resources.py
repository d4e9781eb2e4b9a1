"""What a command needs before it starts: memory from the traffic sizes against the host's (and the GPUs')
memory, and rank processes against the host's CPU cores. A launch that cannot fit is one line (UsageError,
exit 2) naming the value, the estimate and the limit, before any process starts or any folder is made.

The estimates follow the code's peak holdings, derived from the job's sizes (formulas in ``moe_rank_memory``,
``balanced_rank_memory``, ``pattern_bytes`` and ``simulate_bytes``). They aim at the right size, not a
bound: against the peak RSS of gloo ranks they came within 5-15 % (below) for deepseek-v3 MoE runs and
~3 % for a 256 MiB balanced run, mock ~30 % above. For a two-sided backend routing is taken as uniform:
skew makes fewer rows per token but more on a hot rank. That matters only near the limit; the sizes the
checks exist to refuse (10^9 tokens per rank, a terabyte all-to-all, 10^8 simulated ranks) are orders of
magnitude over it.

A one-sided backend (nvshmem, shmem-emu) sizes its symmetric heap for the busiest rank on every rank,
double-buffered, with a staging copy per phase, and NVSHMEM reserves its heap up front: for these the
launcher routes every rank (the job's Pattern, as ``commbench pattern`` builds it; a few seconds for a
large world) and takes the heap from the backend class itself (``Backend.symmetric_memory_bytes``, the
same function its ``setup`` sizes the heap with), and the rows of the harness's own buffers from the busiest
rank too. That part is a bound: never below what the backend allocates.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from commbench.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

    from commbench.inputs.models import ModelConfig
    from commbench.run.interface import Backend, ExchangeShape
    from commbench.run.jobs import Job
    from commbench.traffic.routing import RoutingConfig

# A spawned rank before any buffer: interpreter, torch, commbench and its process group (290 MiB RSS
# measured after importing torch and commbench's run stage on Linux x86-64).
PROCESS_BYTES = 320 << 20
# Rank processes one CPU core can carry: gloo ranks wait in blocking calls most of the time, so a few share a
# core; far more and start-up (an interpreter and torch each) and every barrier crawl towards the timeout.
RANKS_PER_CORE = 8
# GPU memory a rank cannot use for its buffers: CUDA context, NCCL's own buffers, the allocator's slack.
GPU_RESERVE_BYTES = 1 << 30
# Routing: int64 expert ids + float32 weights per (token, top-k slot), of every source rank (every rank
# re-routes every source to know what it must receive).
ROUTING_BYTES_PER_SELECTION = 12
# The race sampler's scratch per token of a routing chunk (at most traffic.routing.CHUNK_TOKENS tokens):
# measured ~1.2 KB for deepseek-v3's group-limited routing.
ROUTING_SCRATCH_PER_TOKEN = 1280
# A plan: int64 token index + int64 key + float32 weight per send row; and its Python objects.
PLAN_ROW_BYTES = 20
PLAN_OBJECT_BYTES = 1024
# Counting one rank's rows: destination hits, int64 [tokens, ranks], and the bool "reached" of the same shape.
HITS_BYTES_PER_TOKEN_RANK = 10
# Pattern matrices on every rank: tokens, selections, dispatch and combine bytes, int64 [src][dst] each,
# and the per-link-class copies of the row builder.
PATTERN_BYTES_PER_PAIR = 64
CHECKSUM_BYTES_PER_ROW = 16  # row_checksums: int64 [rows, 2]
# Encoding rows (traffic.payload.encode_rows) builds its per-column pattern in int64 temporaries as wide as
# a row: measured ~30 B per byte of one row (it matters for the wide rows of a balanced all-to-all).
ENCODE_SCRATCH_PER_ROW_BYTE = 32
# Combine per token and hidden element: float32 reduction output, float64 reference, tolerance and difference,
# bool comparison (traffic.payload.CombineCheck).
COMBINE_CHECK_BYTES_PER_ELEMENT = 4 + 8 + 8 + 8 + 1
# Per timed iteration: a timer and its list entries on every rank; rank 0 also gathers every rank's time and
# #wrong (Python objects after unpickling).
TIMING_BYTES_PER_ITERATION = 512
GATHERED_BYTES_PER_RANK_ITERATION = 64
# simulate: the [group, src, dst] blocks of a phase and the fabric model's temporaries of the same shape,
# per (rank, EP peer): measured 52 B, 69 B with an oversubscribed fabric (uplink accounting).
SIMULATE_BYTES_PER_PAIR = 72
# ... and per rank: its place in every world size's layout, its loads, peers and times ([rank, class, dir]):
# measured 190 B with EP groups of 1.
SIMULATE_BYTES_PER_RANK = 256


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by what holds them."""

    what: str  # the case, naming the sizes that decide it
    tables: int  # host: routing tables, plans and patterns of every rank
    buffers: int  # the rank's device: token rows, send/receive buffers, verification copies
    timings: int  # host: per-iteration timings
    buffers_hint: str  # the values that size the buffers
    iters: int  # timed iterations (they size ``timings``)
    # The rank's device: a one-sided backend's own buffers (its symmetric heap, with what its library
    # reserves), sized for the busiest rank (``Backend.symmetric_memory_bytes``); 0 for a two-sided one.
    symmetric: int = 0

    @property
    def device(self) -> int:
        """What lives on the rank's device (the GPU, or host memory for CPU ranks)."""
        return self.buffers + self.symmetric

    def total(self) -> int:
        return self.tables + self.device + self.timings


def format_bytes(count: float) -> str:
    """1.5 GiB, 320 MiB, 12 KiB (binary units, as --min-bytes takes them)."""
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.3g} {unit}"
    return f"{int(count)} B"


def rows_per_token(model: ModelConfig, world_size: int, send_mode: str, mask_ratio: float = 0.0) -> float:
    """Send rows per token under uniform routing: top-k in selection mode; in token mode the expected number
    of ranks holding at least one of a token's k distinct experts, W x (1 - C(E - E/W, k) / C(E, k)), at
    most topk_group x (ranks an expert group spans) under a group limit; node mode twice token mode's (its
    NVLink stage moves token mode's rows, its scale-out stage at most as many)."""
    k = model.topk
    if send_mode == "node":
        return 2.0 * rows_per_token(model, world_size, "token", mask_ratio)
    if send_mode == "selection":
        rows = float(k)
    else:
        experts, per_rank = model.num_experts, model.num_experts // world_size
        miss = 1.0  # P(a given rank holds none of the token's experts)
        for i in range(k):
            miss *= max(0.0, (experts - per_rank - i) / (experts - i))
        rows = world_size * (1.0 - miss)
        if model.group_limited:
            rows = min(rows, model.topk_group * max(1.0, model.experts_per_group / per_rank))
    return rows * (1.0 - mask_ratio)


def _timings(iters: int, world_size: int) -> int:
    return iters * (TIMING_BYTES_PER_ITERATION + world_size * GATHERED_BYTES_PER_RANK_ITERATION)


def routing_scratch_bytes(tokens: int) -> int:
    """The race sampler's scratch while routing one rank (one chunk of tokens at a time)."""
    from commbench.traffic.routing import CHUNK_TOKENS

    return min(tokens, CHUNK_TOKENS) * ROUTING_SCRATCH_PER_TOKEN


def _busiest_rows(rows: np.ndarray) -> int:
    """The most rows one rank sends or receives in a [src, dst] row matrix."""
    return int(max(rows.sum(axis=1).max(initial=0), rows.sum(axis=0).max(initial=0)))


def moe_rank_memory(
    cfg: RoutingConfig,
    send_mode: str,
    iters: int,
    imbalance_cost: bool,
    backend: type[Backend] | None = None,
) -> RankMemory:
    """One rank of an MoE job. With T tokens per rank, top-k k, W ranks, S send rows (uniform routing:
    S = T x rows_per_token, also the mean a rank receives), row bytes D (dispatch) and C = 2H (combine),
    hidden H:

    tables  = W x (12 T k + 20 S + 1 KiB) [+ W x (20 S + 1 KiB), the imbalance-cost reference's plans]
              + 10 T W (counting one source's rows) + 64 W^2 (pattern) + 1280 min(T, 2^18) (routing scratch)
    buffers = T D (token rows) + 3 S D (send, receive, expected rows) + 16 S (checksums) + 32 D (encoding)
              + 2 S C (expert output, returned rows) + 4 S H (float32 weighted rows) + 29 T H (combine output
              and its check)
    timings = iters x (512 + 64 W)

    ``backend``: a one-sided backend class (module docstring). Then S is the busiest rank's rows of the job's
    Pattern, its send, receive and returned rows (2 S D + S C) live in its heap instead, and ``symmetric`` is
    the heap it allocates for the Pattern (and for the imbalance-cost reference's, whichever is larger).
    """
    model, tokens, world = cfg.model, cfg.tokens_per_rank, cfg.world_size
    hidden, dispatch, combine = model.hidden, model.dispatch_bytes_per_token, model.combine_bytes_per_token
    rows = math.ceil(tokens * rows_per_token(model, world, send_mode, cfg.mask_ratio))
    symmetric = 0
    one_sided = backend is not None and backend.one_sided
    if one_sided:
        assert backend is not None
        shapes = _moe_exchange_shapes(cfg, send_mode, imbalance_cost)
        rows = max(_busiest_rows(shape.rows) for shape in shapes)
        symmetric = max(backend.symmetric_memory_bytes(shape) for shape in shapes)
    plans = world * (rows * PLAN_ROW_BYTES + PLAN_OBJECT_BYTES) * (2 if imbalance_cost else 1)
    tables = world * tokens * model.topk * ROUTING_BYTES_PER_SELECTION + plans + routing_scratch_bytes(tokens)
    tables += HITS_BYTES_PER_TOKEN_RANK * tokens * world + PATTERN_BYTES_PER_PAIR * world * world
    buffers = tokens * dispatch + 3 * rows * dispatch + CHECKSUM_BYTES_PER_ROW * rows
    buffers += ENCODE_SCRATCH_PER_ROW_BYTE * dispatch
    buffers += 2 * rows * combine + 4 * rows * hidden + COMBINE_CHECK_BYTES_PER_ELEMENT * tokens * hidden
    if one_sided:  # the send, receive and returned rows are regions of the symmetric heap
        buffers -= 2 * rows * dispatch + rows * combine
    what = (
        f"{model.name} at --tokens {tokens} (hidden {hidden}, top-{model.topk}, {send_mode} mode) on "
        f"{world} ranks"
    )
    return RankMemory(
        what, tables, buffers, _timings(iters, world), "--tokens or the model's hidden size", iters, symmetric
    )


def _moe_exchange_shapes(cfg: RoutingConfig, send_mode: str, imbalance_cost: bool) -> list[ExchangeShape]:
    """The traffic a one-sided backend is set up for in an MoE job: the Pattern's rows (every rank routed
    here, as the ranks will), and the imbalance-cost reference's (the same total rows spread evenly)."""
    from commbench.run.interface import ExchangeShape
    from commbench.traffic.plan import balanced_pair_rows
    from commbench.traffic.routing import experts_per_rank

    model, world = cfg.model, cfg.world_size
    rows = _pattern_rows(cfg, send_mode)
    slots = experts_per_rank(model.num_experts + cfg.replicas, world) if send_mode == "selection" else 1
    row_bytes = (model.dispatch_bytes_per_token, model.combine_bytes_per_token)
    shapes = [ExchangeShape(rows, *row_bytes, slots)]
    if imbalance_cost:
        shapes.append(ExchangeShape(balanced_pair_rows(world, int(rows.sum())), *row_bytes, slots))
    return shapes


@functools.lru_cache(maxsize=16)
def _pattern_rows(cfg: RoutingConfig, send_mode: str) -> np.ndarray:
    """The [src, dst] dispatch rows of the job's Pattern (repeated cases and knob settings route once)."""
    from commbench.traffic.pattern import build_pattern

    return build_pattern(cfg, send_mode).dispatch_rows


def balanced_rank_memory(
    sizes: list[int], world_size: int, iters: int, backend: type[Backend] | None = None
) -> RankMemory:
    """One rank of a balanced sweep, at its largest size B (buffers grow to it and stay):
    tables = W x (20 W + 1 KiB) (every rank's plan) + 64 W^2; buffers = 3 B (token rows, receive, expected)
    + 16 W (checksums) + 32 B / W (encoding scratch). For a one-sided ``backend`` the receive buffer is part
    of its heap, ``symmetric`` (one row of B / W bytes to every rank)."""
    from commbench.run.interface import ExchangeShape
    from commbench.traffic.plan import balanced_row_bytes

    largest = max(sizes)
    tables = world_size * (world_size * PLAN_ROW_BYTES + PLAN_OBJECT_BYTES)
    tables += PATTERN_BYTES_PER_PAIR * world_size * world_size
    buffers = 3 * largest + CHECKSUM_BYTES_PER_ROW * world_size
    buffers += ENCODE_SCRATCH_PER_ROW_BYTE * (largest // world_size)
    symmetric = 0
    if backend is not None and backend.one_sided:
        import numpy as np

        ones = np.ones((world_size, world_size), dtype=np.int64)
        symmetric = backend.symmetric_memory_bytes(
            ExchangeShape(ones, balanced_row_bytes(world_size, largest), 0)
        )
        buffers -= largest  # the receive buffer is the heap's
    what = f"the balanced all-to-all of {largest} B ({format_bytes(largest)}) per rank on {world_size} ranks"
    return RankMemory(what, tables, buffers, _timings(iters, world_size), "--max-bytes", iters, symmetric)


def job_memory(
    job: Job, world_size: int, imbalance_cost: bool, backend: type[Backend] | None = None
) -> RankMemory:
    """The estimate of one job (an MoeJob or a BalancedJob); ``backend``: the launch's backend class (a
    one-sided one is asked for its heap, module docstring)."""
    if job.kind == "balanced":
        return balanced_rank_memory(list(job.sizes), world_size, job.iters, backend)
    return moe_rank_memory(job.routing, job.send_mode, job.iters, imbalance_cost, backend)


# ---------------------------------------------------------------------------------------------------------
# What the machine has


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as file:
            text = file.read().strip()
        return int(text)
    except (OSError, ValueError):  # absent, "max" (no limit) or unreadable
        return None


def host_memory_available() -> tuple[int, str] | None:
    """(bytes a new workload can use now, where that figure comes from), or None when nothing says.

    The lowest of the kernel's MemAvailable and the room left under a cgroup memory limit (v2, else v1)."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 says "no limit" as ~2^63
            found.append((max(0, limit - usage), "cgroup memory limit"))
            break
    if not found:
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"))
        except (OSError, ValueError, AttributeError):
            return None
    return min(found)


def gpu_memory_per_rank(local_ranks: int) -> int | None:
    """GPU memory a rank's buffers may use: the smallest of the local ranks' devices' total, less
    GPU_RESERVE_BYTES. Device properties need no CUDA context, so the launcher holds no GPU memory."""
    import torch

    count = torch.cuda.device_count()
    if count < 1:
        return None
    if _under_torchrun():  # this rank's own device
        try:
            devices = [int(os.environ.get("LOCAL_RANK", "0")) % count]
        except ValueError:
            return None
    else:
        devices = list(range(min(local_ranks, count)))
    total = min(torch.cuda.get_device_properties(index).total_memory for index in devices)
    return max(0, total - GPU_RESERVE_BYTES)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------
# The checks


def _under_torchrun() -> bool:
    from commbench.run.dist import running_under_torchrun

    return running_under_torchrun()


def local_ranks(world_size: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all of them (the launcher spawns them here)."""
    if not _under_torchrun():
        return world_size
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size  # the launch refuses it with its own message


def check_local_ranks(world_size: int) -> None:
    """UsageError when spawning ``world_size`` rank processes here would swamp the host's CPU cores (at most
    RANKS_PER_CORE per core); under torchrun the ranks already run, placed by its user."""
    if _under_torchrun():
        return
    cores = usable_cores()
    limit = cores * RANKS_PER_CORE
    if world_size > limit:
        raise UsageError(
            f"--world-size {world_size} would start {world_size} rank processes on this host, which has "
            f"{cores} CPU core(s): at most {limit} ({RANKS_PER_CORE} per core) share them without the "
            "collectives timing out; use fewer ranks, or torchrun to spread them over hosts"
        )


def _resolved_backend(backend: str, world_size: int) -> tuple[type[Backend] | None, bool]:
    """(the backend's class, whether its buffers live on GPUs: its process group is nccl). A backend the
    launch will refuse (nccl without GPUs, a class that does not load) counts as on the host: the launch's
    own check gives the message."""
    from commbench.backends import load_backend
    from commbench.run.dist import check_group_devices, resolve_backend

    try:
        chosen = resolve_backend(backend, world_size)[0]
        backend_class, _ = load_backend(chosen)
    except UsageError:
        return None, False
    if backend_class is None:
        return None, False
    try:
        check_group_devices(backend_class.process_group, world_size, chosen)
    except UsageError:
        return backend_class, False
    return backend_class, backend_class.process_group == "nccl"


def _dominant(memory: RankMemory, on_gpu: bool) -> tuple[str, str]:
    """(what holds most of a rank's host memory, the values to lower)."""
    parts = [
        (memory.tables, "routing tables and plans of every rank", "--tokens or --world-size"),
        (memory.timings, f"the timings of --iters {memory.iters}", "--iters"),
        (PROCESS_BYTES, f"the rank process itself (~{format_bytes(PROCESS_BYTES)})", "--world-size"),
    ]
    if not on_gpu:
        parts.append((memory.buffers, "send/receive buffers and verification copies", memory.buffers_hint))
        parts.append((memory.symmetric, "the one-sided backend's symmetric heap", memory.buffers_hint))
    _, label, hint = max(parts, key=lambda part: part[0])
    return label, hint


def _device_parts(memory: RankMemory) -> str:
    """What a rank's device memory holds, for the GPU message."""
    parts = "send/receive buffers and verification copies"
    if memory.symmetric:
        parts += f", of which {format_bytes(memory.symmetric)} the symmetric heap, sized for the busiest rank"
    return parts


def check_launch_fits(jobs: list[Job], world_size: int, backend: str, imbalance_cost: bool) -> None:
    """Before a launch: the rank processes against the CPU cores, then every job's memory per rank, summed
    over the local ranks (+ the launcher), against the host's available memory, and its buffers against
    the GPU memory when they live on GPUs. UsageError naming the case, the estimate and the limit."""
    check_local_ranks(world_size)
    if not jobs:
        return
    backend_class, on_gpu = _resolved_backend(backend, world_size)
    local = local_ranks(world_size)
    estimates = [job_memory(job, world_size, imbalance_cost, backend_class) for job in jobs]

    def host_per_rank(memory: RankMemory) -> int:
        return PROCESS_BYTES + memory.tables + memory.timings + (0 if on_gpu else memory.device)

    worst = max(estimates, key=host_per_rank)
    per_rank = host_per_rank(worst)
    need = local * per_rank + (0 if _under_torchrun() else PROCESS_BYTES)  # + the launcher
    available = host_memory_available()
    if available is not None and need > available[0]:
        label, hint = _dominant(worst, on_gpu)
        raise UsageError(
            f"{worst.what} needs about {format_bytes(need)} of host memory ({local} local rank(s) x "
            f"{format_bytes(per_rank)}, mostly {label}), more than the {format_bytes(available[0])} "
            f"available ({available[1]}); lower {hint}"
        )
    if on_gpu:
        largest = max(estimates, key=lambda memory: memory.device)
        limit = gpu_memory_per_rank(local)
        if limit is not None and largest.device > limit:
            raise UsageError(
                f"{largest.what} needs about {format_bytes(largest.device)} of GPU memory per rank "
                f"({_device_parts(largest)}), more than the {format_bytes(limit)} a GPU here offers (its "
                f"total less {format_bytes(GPU_RESERVE_BYTES)} for CUDA and NCCL); lower "
                f"{largest.buffers_hint}"
            )


def _check_host(what: str, need: int, hint: str) -> None:
    available = host_memory_available()
    if available is not None and need > available[0]:
        raise UsageError(
            f"{what} needs about {format_bytes(need)} of memory, more than the {format_bytes(available[0])} "
            f"available ({available[1]}); {hint}"
        )


# The JSON of a pattern: four [src][dst] matrices as Python ints in lists (~36 B each) and their text.
PATTERN_JSON_BYTES_PER_PAIR = 4 * (36 + 24)


def pattern_bytes(cfg: RoutingConfig, as_json: bool) -> int:
    """``commbench pattern`` in this process: one rank's routing at a time (12 T k + scratch), its counting
    (10 T W), every rank's counts (W (16 W + 8 E)), the pattern (64 W^2) and its JSON (240 W^2)."""
    tokens, world, model = cfg.tokens_per_rank, cfg.world_size, cfg.model
    need = tokens * model.topk * ROUTING_BYTES_PER_SELECTION + routing_scratch_bytes(tokens)
    need += HITS_BYTES_PER_TOKEN_RANK * tokens * world + world * (16 * world + 8 * model.num_experts)
    need += (PATTERN_BYTES_PER_PAIR + (PATTERN_JSON_BYTES_PER_PAIR if as_json else 0)) * world * world
    return need


def check_pattern_fits(cfg: RoutingConfig, as_json: bool) -> None:
    """UsageError when ``commbench pattern`` of ``cfg`` cannot fit in this host's memory."""
    what = f"the pattern of {cfg.model.name} at --tokens {cfg.tokens_per_rank} on {cfg.world_size} ranks"
    _check_host(what, pattern_bytes(cfg, as_json), "lower --tokens or --world-size")


def simulate_bytes(world_size: int, ep_size: int, routed_tokens: int, topk: int) -> int:
    """One world size of ``simulate``: 72 B per (rank, EP peer) for the [group, src, dst] blocks and the
    model's temporaries, 256 B per rank, plus routing ``routed_tokens`` (exact: every token of one EP group;
    sampled: the sample) with their destination hits over the EP ranks (12 k + 10 ep per token)."""
    routing = routed_tokens * (topk * ROUTING_BYTES_PER_SELECTION + HITS_BYTES_PER_TOKEN_RANK * ep_size)
    blocks = world_size * (SIMULATE_BYTES_PER_PAIR * ep_size + SIMULATE_BYTES_PER_RANK)
    return blocks + routing + routing_scratch_bytes(routed_tokens)


def check_simulate_fits(
    model: ModelConfig,
    ranks: list[int],
    ep_size: int | None,
    tokens: int,
    sample_tokens: int,
    exact: bool | None,
) -> None:
    """UsageError when a world size of ``simulate`` cannot fit in this host's memory (sizes run one at a
    time: the largest need counts)."""
    from commbench.fabric.ep_groups import EXACT_LIMIT

    worst: tuple[int, int, int, int] | None = None  # (world, EP size, bytes, routing bytes)
    for world in ranks:
        ep = min(ep_size or min(world, model.num_experts), world)
        use_exact = exact if exact is not None else world * tokens <= EXACT_LIMIT
        routed = ep * tokens if use_exact else sample_tokens
        need = simulate_bytes(world, ep, routed, model.topk)
        if worst is None or need > worst[2]:
            worst = (world, ep, need, simulate_bytes(0, ep, routed, model.topk))
    if worst is not None:
        world, ep, need, routing = worst
        if 2 * routing < need:
            hint = "simulate fewer ranks"
        else:
            hint = "lower --tokens (routed exactly)" if exact else "lower --sample-tokens"
        _check_host(f"simulate --ranks {world} (EP groups of {ep})", need, hint)
