"""commbench's balanced all-to-all sweep beside PARAM's comms benchmark and a bare ``all_to_all_single`` loop,
on gloo, alternated round by round: per-size medians, the ratios, each sweep's wall time and the host load.

    python benchmarks/bench_param.py --param DIR [--rounds 5] [--min-bytes 1K] [--max-bytes 64M]
        [--factor 2] [--iters 20] [--warmup 5] [--world-size 4] [--tools commbench,bare,PARAM]
        [--out bench_param.md] [--json rounds.json]
    python benchmarks/bench_param.py --pool A.json B.json ...   # one table of the rounds of several runs

PARAM is not part of commbench: ``--param DIR`` is a checkout of https://github.com/facebookresearch/param
(``git clone https://github.com/facebookresearch/param DIR``; its ``train/comms/pt/comms.py`` is run). PARAM
imports itself as the package ``param_bench``, so the script runs it with a temporary folder holding a link
``param_bench -> DIR`` on PYTHONPATH; nothing is installed.

The three, each a whole command as a user would start it, every size with the same warm-up and iterations:

* **commbench**: ``commbench run --pattern balanced --backend gloo`` (spawned ranks, every size verified,
  then timed in place too as nccl-tests does, the report written). Its time: ``time_us_mean`` of
  results.csv, the window's seconds per iteration of the slowest rank (window timing, nccl-tests' way),
  its calls issued without waiting for each (``--blocking 0``, its default and nccl-tests' ``-z 0``: on
  gloo async calls, as PARAM's default issues them).
* **PARAM**: ``torchrun --standalone --nproc_per_node N comms.py --backend gloo --device cpu --collective
  all_to_all_single --blocking 0`` (its default: every call issued with ``async_op=True``, so on gloo two
  of them run at once on the process group's two worker threads, ``ProcessGroupGloo::Options::threads``,
  as commbench's ``--blocking 0`` calls do, where the bare loop's blocking calls run one after another;
  ``--tools ...,PARAM-b1`` adds PARAM's per-call timing, below). PARAM times a window too
  (``run_coll_non_graph`` in train/comms/pt/comms.py: after its warm-up it adds up the time to issue
  ``--num_iters`` calls and the final wait for all of them, then divides by the iterations), on every rank;
  its table prints p50, p75, p95, min and max over ranks. Its time here: the max over ranks (``Max``), the
  same convention as commbench's. PARAM's bandwidth (AlgBW = bytes / p50 time, BusBW = AlgBW x (n-1)/n for
  all-to-all, in getBusBW of train/comms/pt/pytorch_backend_utils.py) is not used: only times are compared.
* **bare**: this script under torchrun (``--bare``): per size a float32 input and output of the size,
  ``--warmup`` calls, a barrier, then ``--iters`` back-to-back ``dist.all_to_all_single`` calls between two
  ``time.perf_counter`` reads; the max over ranks of window / iters.

More can be added with ``--tools`` to test why PARAM differs from the bare loop: **commbench-b1** (commbench
``--blocking 1``: the host waits for each call of the window, as the bare loop's blocking calls do);
**PARAM-b1** (PARAM with ``--blocking 1``: ``run_coll_non_graph`` then makes a barrier before every call,
untimed, and times the call alone up to its wait; each rank adds up its own calls, and the time here is the
max over ranks); **commbench-iter**, its like in commbench (``--timing iteration``: a barrier before every
timed call, the call timed alone, per call the max over ranks, ``time_us_mean`` over the calls); and
**bare-async** (the bare loop with every call issued ``async_op=True`` and one wait for all of them at the end
of the window, PARAM's ``--blocking 0`` and nccl-tests' ``-z 0``). On a CUDA stream such calls still run one
after another; on gloo they do not, so their window measures two collectives in flight at once. **bare-iter**
and **bare-iter-rank** are the bare loop timed as PARAM-b1 and commbench-iter are (an untimed barrier, then
one call), one command per round for both, its calls reported with the two statistics: bare-iter as
commbench's (per call the max over ranks, then the mean over calls), bare-iter-rank as PARAM's (each rank's
mean call, then the max over ranks); their ratio is of the very same calls, and both show that command's wall
time. The first tool is the one the ratios are of: ``commbench`` (window timing), ``commbench-b1`` or
``commbench-iter``.

Rounds rotate the order (A B C, B C A, C A B, ...) so a drift in the host's load spreads over every tool;
``os.getloadavg()`` is recorded before each command. The table gives per size the median over rounds of each
time and of the per-round ratios of the first tool to each other one (a time ratio: 1.02 = the first 2 %
slower) with a distribution-free ~95 % confidence interval of that median in brackets (``median_interval``:
order statistics of the rounds; with 5 rounds it is their min..max), the median whole-command wall time of
each sweep and the load per round. The wall times include each tool's start-up; commbench's includes verifying
every size, its in-place run of every size (twice PARAM's timed calls) and its report.

``--json PATH`` also writes every round's raw times (per tool and size, its wall and the load before it);
``--pool A.json B.json ...`` reads such files of one setting (the same tools, sizes, iterations and ranks) and
prints the table over all their rounds, running nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commbench.report.folder.claim import write_atomic

TOOLS = (
    "commbench",
    "commbench-b1",
    "commbench-iter",
    "bare",
    "PARAM",
    "PARAM-b1",
    "bare-async",
    "bare-iter",
    "bare-iter-rank",
)
# The bare loop's modes: one window of calls, async calls, or an untimed barrier before each call.
BARE_MODE = {"bare": "window", "bare-async": "async", "bare-iter": "iteration", "bare-iter-rank": "iteration"}
# How each commbench tool is run (--timing, --blocking); the first tool is one: the one every ratio is of.
COMMBENCH = {"commbench": ("window", 0), "commbench-b1": ("window", 1), "commbench-iter": ("iteration", 0)}
DEFAULT_TOOLS = "commbench,bare,PARAM"
COMMAND_TIMEOUT_S = 3600


def parse_size(text: str) -> int:
    """1K = 1024, 64M = 64 MiB (as commbench and PARAM read sizes)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sweep_sizes(low: int, high: int, factor: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's rank variables (each tool starts its own ranks)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _run(argv: list[str], env: dict[str, str], results_marker: str = "") -> tuple[str, float]:
    """(stdout, wall seconds); a failed command stops the benchmark, unless it printed its results
    (``results_marker``) first: PARAM's ranks sometimes abort in their teardown ("terminate called without
    an active exception", SIGABRT) after the table is out."""
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    wall = time.monotonic() - started
    if done.returncode != 0 and results_marker and results_marker in done.stdout:
        print(f"bench_param: {argv[4:6]} exited {done.returncode} after its results", file=sys.stderr)
        return done.stdout, wall
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise SystemExit(f"bench_param: {argv[:4]}... exited {done.returncode}:\n{tail}")
    return done.stdout, wall


def run_commbench(args: argparse.Namespace, work: Path, tool: str) -> tuple[dict[int, float], float]:
    out = Path(tempfile.mkdtemp(prefix="commbench-", dir=work)) / "report"
    timing, blocking = COMMBENCH[tool]
    argv = [
        sys.executable, "-m", "commbench", "run", "--pattern", "balanced", "--backend", "gloo",
        "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
        "--step-factor", str(args.factor), "--iters", str(args.iters), "--warmup", str(args.warmup),
        "--world-size", str(args.world_size), "--timing", timing, "--blocking", str(blocking),
        "--out", str(out),
    ]  # fmt: skip
    _, wall = _run(argv, _clean_env())
    with (out / "results.csv").open() as handle:
        times = {int(row["size_bytes"]): float(row["time_us_mean"]) for row in csv.DictReader(handle)}
    return times, wall


def run_param(args: argparse.Namespace, work: Path, blocking: int) -> tuple[dict[int, float], float]:
    comms = Path(args.param) / "train" / "comms" / "pt" / "comms.py"
    root = work / "param-path"
    if not (root / "param_bench").exists():
        root.mkdir(exist_ok=True)
        (root / "param_bench").symlink_to(Path(args.param).resolve())
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(args.world_size), str(comms), "--backend", "gloo", "--device", "cpu",
        "--collective", "all_to_all_single", "--begin-size", str(args.min_bytes),
        "--end-size", str(args.max_bytes), "--f", str(args.factor), "--num_iters", str(args.iters),
        "--w", str(args.warmup), "--blocking", str(blocking),
    ]  # fmt: skip
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    stdout, wall = _run(argv, _clean_env(PYTHONPATH=pythonpath), "COMMS-RES-all_to_all_single")
    times = {}
    for line in stdout.splitlines():
        fields = line.split()
        # COMMS-RES-all_to_all_single-float32  size  elements  p50  p75  p95  min  max  algbw  busbw  total
        if fields and fields[0].startswith("COMMS-RES-all_to_all_single") and fields[1].isdigit():
            times[int(fields[1])] = float(fields[7])
    if not times:
        raise SystemExit(f"bench_param: no COMMS-RES rows in PARAM's output:\n{stdout[-2000:]}")
    return times, wall


def run_bare(args: argparse.Namespace, sizes: list[int], mode: str) -> tuple[dict[int, dict], float]:
    """One bare-loop command in ``mode``: per size its record (both statistics), and the wall time."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(args.world_size), str(Path(__file__).resolve()), "--bare", "--sizes", ",".join(map(str, sizes)),
        "--iters", str(args.iters), "--warmup", str(args.warmup), "--bare-mode", mode,
    ]  # fmt: skip
    stdout, wall = _run(argv, _clean_env())
    records = {}
    for line in stdout.splitlines():
        if line.startswith("BARE "):
            record = json.loads(line[5:])
            records[int(record["size"])] = record
    return records, wall


def bare_times(records: dict[int, dict], tool: str) -> dict[int, float]:
    """A bare tool's time per size: bare-iter-rank reads PARAM-b1's statistic (each rank's mean call, the
    max over ranks), the others the max over ranks per call (commbench's; a window is one call of iters)."""
    key = "rank_max_us" if tool == "bare-iter-rank" else "max_us"
    return {size: float(record[key]) for size, record in records.items()}


def bare_window(received: Any, send: Any, iters: int, issue_async: bool, group: Any = None) -> float:
    """One window of ``iters`` back-to-back ``all_to_all_single(received, send)`` calls between two clock
    reads, this rank's seconds per call; ``issue_async``: every call ``async_op=True``, then one wait for all
    of them (PARAM's ``--blocking 0``, nccl-tests' ``-z 0``), else blocking calls."""
    import torch.distributed as dist

    start = time.perf_counter()
    if issue_async:
        works = [dist.all_to_all_single(received, send, group=group, async_op=True) for _ in range(iters)]
        for work in works:
            work.wait()
    else:
        for _ in range(iters):
            dist.all_to_all_single(received, send, group=group)
    return (time.perf_counter() - start) / iters


def bare_rank(sizes: list[int], iters: int, warmup: int, mode: str = "window") -> None:
    """One rank of the bare loop (under torchrun): rank 0 prints one ``BARE {json}`` line per size.
    ``mode``: ``window`` (back-to-back calls between two clock reads), ``async`` (the timed calls issued with
    ``async_op=True``, then one wait for all of them) or ``iteration`` (an untimed barrier before every call,
    each call timed alone, as commbench's ``--timing iteration`` and PARAM's ``--blocking 1``)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as commbench's spawned gloo ranks
    for size in sizes:
        elements = size // 4 // world * world
        send = torch.ones(elements, dtype=torch.float32)
        received = torch.empty_like(send)
        for _ in range(warmup):
            dist.all_to_all_single(received, send)
        calls = []  # this rank's seconds per timed call (one entry: a window's mean)
        dist.barrier()
        if mode == "iteration":
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_to_all_single(received, send)
                calls.append(time.perf_counter() - start)
        else:
            calls.append(bare_window(received, send, iters, mode == "async"))
        every: list = [None] * world
        dist.all_gather_object(every, calls)
        if dist.get_rank() == 0:
            per_call_max = [max(rank[i] for rank in every) for i in range(len(calls))]
            record = {
                "size": size,
                "max_us": statistics.fmean(per_call_max) * 1e6,
                "rank_max_us": max(statistics.fmean(rank) for rank in every) * 1e6,
            }
            print("BARE " + json.dumps(record), flush=True)
    dist.destroy_process_group()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics (k, n + 1 - k) with the
    largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is still >= ``level`` (n = 5: min..max, 94 %;
    n = 9: 2nd..8th, 96 %). (nan, nan) for fewer than two values."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 2:
        return float("nan"), float("nan")
    k, below = 1, 1 / 2**n  # below = P(B < k)
    while k + 1 <= n // 2:
        next_below = below + math.comb(n, k) / 2**n  # P(B < k + 1)
        if 1 - 2 * next_below < level:
            break
        k, below = k + 1, next_below
    return ordered[k - 1], ordered[n - k]


def _ratio_cell(ratios: list[float]) -> str:
    low, high = median_interval(ratios)
    interval = f" [{low:.2f}, {high:.2f}]" if math.isfinite(low) else ""
    return f"{_median(ratios):.3f}{interval}"


def size_label(size: int) -> str:
    """1 MiB, 4 KiB, 8 B: a size as the tables show it."""
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"


def table(sizes: list[int], tools: tuple[str, ...], runs: list[dict], loads: list[list[float]]) -> str:
    """The Markdown result: per size each tool's median and the first tool's (a commbench) ratio to every
    other tool, the sweeps' walls, the load per round."""

    first, peers = tools[0], list(tools[1:])
    lines = [
        "| size | "
        + " | ".join(f"{tool} (us)" for tool in tools)
        + " | "
        + " | ".join(f"{first}/{peer} [CI]" for peer in peers)
        + " |",
        "|---:|" + "---:|" * (len(tools) + len(peers)),
    ]
    for size in sizes:
        per = {tool: [run[tool][0].get(size) for run in runs] for tool in tools}
        cells = [f"{_median([t for t in per[tool] if t]):.1f}" for tool in tools]
        for peer in peers:
            ratios = [c / p for c, p in zip(per[first], per[peer], strict=True) if c and p]
            cells.append(_ratio_cell(ratios))
        lines.append(f"| {size_label(size)} | " + " | ".join(cells) + " |")
    walls = {tool: _median([run[tool][1] for run in runs]) for tool in tools}
    reference = "PARAM" if "PARAM" in tools else peers[0] if peers else first
    lines += [
        "",
        "| sweep wall (s, median) | " + " | ".join(tools) + f" | {first}/{reference} |",
        "|---|" + "---:|" * (len(tools) + 1),
        "| whole command | "
        + " | ".join(f"{walls[tool]:.1f}" for tool in tools)
        + f" | {walls[first] / walls[reference]:.2f} |",
        "",
        "| round | order | load before each (1-min avg) |",
        "|---:|---|---|",
    ]
    for index, (run, load) in enumerate(zip(runs, loads, strict=True)):
        lines.append(f"| {index + 1} | {' '.join(run['order'])} | {' / '.join(f'{v:.1f}' for v in load)} |")
    return "\n".join(lines)


MAX_POOL_BYTES = 16 << 20  # a rounds file is a few KiB; anything this large is not one


def refuse(message: str) -> SystemExit:
    """Bad input: the one line on stderr, exit status 2 (raise what this returns)."""
    print(message, file=sys.stderr)
    return SystemExit(2)


def rounds_json(
    args: argparse.Namespace,
    sizes: list[int],
    tools: tuple[str, ...],
    runs: list[dict],
    loads: list[list[float]],
) -> dict:
    """What --json writes: the setting, and per round each tool's times (us, by size) and wall (s)."""
    setting = {
        k: getattr(args, k) for k in ("world_size", "iters", "warmup", "min_bytes", "max_bytes", "factor")
    }
    return {
        "setting": setting,
        "sizes": sizes,
        "tools": list(tools),
        "rounds": [
            {
                "order": list(run["order"]),
                "load": load,
                "tools": {
                    tool: {"times_us": {str(s): t for s, t in run[tool][0].items()}, "wall_s": run[tool][1]}
                    for tool in tools
                },
            }
            for run, load in zip(runs, loads, strict=True)
        ],
    }


def pooled(paths: list[Path]) -> tuple[dict, list[int], tuple[str, ...], list[dict], list[list[float]]]:
    """The rounds of several --json files of one setting, as ``table`` takes them (exit 2, one line, on
    a file that is not one or a setting that differs)."""
    first: dict | None = None
    runs: list[dict] = []
    loads: list[list[float]] = []
    for path in paths:
        try:
            if path.stat().st_size > MAX_POOL_BYTES:
                raise ValueError(f"over {MAX_POOL_BYTES >> 20} MiB")
            data = json.loads(path.read_text())
            key = (data["setting"], data["sizes"], data["tools"])
            rounds = [
                (
                    {"order": tuple(r["order"])}
                    | {
                        tool: (
                            {int(s): float(t) for s, t in r["tools"][tool]["times_us"].items()},
                            float(r["tools"][tool]["wall_s"]),
                        )
                        for tool in data["tools"]
                    },
                    [float(v) for v in r["load"]],
                )
                for r in data["rounds"]
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise refuse(f"bench_param: --pool {path}: not a rounds file of --json ({exc})") from None
        if first is None:
            first = {"setting": key[0], "sizes": key[1], "tools": key[2]}
        elif key != (first["setting"], first["sizes"], first["tools"]):
            raise refuse(f"bench_param: --pool {path}: another setting, sizes or tools than {paths[0]}")
        runs += [run for run, _ in rounds]
        loads += [load for _, load in rounds]
    assert first is not None
    return first["setting"], list(first["sizes"]), tuple(first["tools"]), runs, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param", help="a checkout of facebookresearch/param (see the docstring)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--factor", type=int, default=2, help="size step factor (nccl-tests and PARAM -f)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--tools",
        default=DEFAULT_TOOLS,
        help=f"comma-separated, a commbench first, of {', '.join(TOOLS)}: PARAM is its default --blocking 0 "
        "(every timed call async_op=True, one wait; on gloo two then run at once on the process group's two "
        "worker threads), PARAM-b1 its --blocking 1 (an untimed barrier before each call, each timed alone), "
        "commbench-b1 commbench's --blocking 1 (each call of its window waited for, as the bare loop does), "
        "commbench-iter commbench's --timing iteration (as PARAM-b1), bare-async the bare loop issuing its "
        "calls as PARAM's --blocking 0 does, bare-iter / bare-iter-rank the bare loop timed per call with "
        "commbench's / PARAM's statistic",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's raw times here")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        help="instead, the table over the rounds of --json files",
    )
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one rank of the bare loop
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bare-mode", default="window", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_rank([int(s) for s in args.sizes.split(",")], args.iters, args.warmup, args.bare_mode)
        return
    if args.pool:
        setting, sizes, tools, runs, loads = pooled(args.pool)
        head = (
            f"{len(runs)} rounds pooled from {len(args.pool)} runs ({', '.join(str(p) for p in args.pool)}): "
            f"{setting['world_size']} gloo ranks, sizes {setting['min_bytes']}..{setting['max_bytes']} "
            f"x{setting['factor']}, {setting['warmup']} warm-up + {setting['iters']} timed iterations each."
        )
        text = head + "\n\n" + table(sizes, tools, runs, loads) + "\n"
        print(text)
        if args.out is not None:
            write_atomic(args.out, text)
        return
    tools = tuple(t.strip() for t in args.tools.split(",") if t.strip())
    if not tools or tools[0] not in COMMBENCH or len(set(tools)) != len(tools) or set(tools) - set(TOOLS):
        raise refuse(
            f"bench_param: --tools must start with one of {tuple(COMMBENCH)}, each of {TOOLS} at most once"
        )
    if not args.param or not (Path(args.param) / "train" / "comms" / "pt" / "comms.py").is_file():
        raise refuse(
            "bench_param: --param DIR must be a facebookresearch/param checkout (train/comms/pt/comms.py)"
        )
    sizes = sweep_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    runs: list[dict] = []
    loads: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-param-") as folder:
        work = Path(folder)
        for round_index in range(args.rounds):
            shift = round_index % len(tools)
            order = tools[shift:] + tools[:shift]
            run: dict = {"order": order}
            load: list[float] = []
            bare_runs: dict[str, tuple[dict[int, dict], float]] = {}  # one command per mode and round
            for tool in order:
                load.append(os.getloadavg()[0])
                if tool in COMMBENCH:
                    run[tool] = run_commbench(args, work, tool)
                elif tool in ("PARAM", "PARAM-b1"):
                    run[tool] = run_param(args, work, blocking=int(tool == "PARAM-b1"))
                else:
                    mode = BARE_MODE[tool]
                    if mode not in bare_runs:
                        bare_runs[mode] = run_bare(args, sizes, mode)
                    records, wall = bare_runs[mode]
                    run[tool] = (bare_times(records, tool), wall)
                print(
                    f"round {round_index + 1} {tool}: {run[tool][1]:.1f} s wall", file=sys.stderr, flush=True
                )
            runs.append(run)
            loads.append(load)
    head = (
        f"{args.world_size} gloo ranks, sizes {args.min_bytes}..{args.max_bytes} x{args.factor}, "
        f"{args.warmup} warm-up + {args.iters} timed iterations each, {args.rounds} rounds alternated; "
        f"{os.cpu_count()} CPUs. Times (us): the slowest rank's window / iterations; commbench-iter and "
        "PARAM-b1 per call (see the script)."
    )
    text = head + "\n\n" + table(sizes, tools, runs, loads) + "\n"
    print(text)
    if args.out is not None:
        write_atomic(args.out, text)
    if args.json is not None:
        write_atomic(args.json, json.dumps(rounds_json(args, sizes, tools, runs, loads), indent=1) + "\n")


if __name__ == "__main__":
    main()
