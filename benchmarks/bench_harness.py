"""The harness's own cost inside the timed window: commbench's balanced window against a bare loop in the same
gloo processes, alternated round by round, so that neither process start nor placement differs.

    python benchmarks/bench_harness.py [--world-size 4] [--min-bytes 1M] [--max-bytes 64M] [--factor 2]
        [--iters 50] [--warmup 5] [--rounds 15] [--out bench_harness.md]

One launch of gloo ranks (``commbench.run.dist.launch``, as ``commbench run`` starts them) runs, round after
round in a rotated order, four tools over the same sizes with the same warm-up and iterations:

* **commbench**: ``run_jobs`` of a balanced job (the code ``commbench run --pattern balanced`` times: the
  window, ``--blocking 0``, its verification and in-place run); its time is the row's ``time_us_mean``, the
  slowest rank's window / iterations.
* **commbench-b1**: the same with ``--blocking 1`` (the host waits for each call).
* **bare-async**: per size a float32 input and output, ``--warmup`` calls, a barrier, then bench_param's
  ``bare_window``: ``--iters`` ``dist.all_to_all_single(..., async_op=True)`` calls and one wait for all of
  them between two ``time.perf_counter`` reads (what ``--blocking 0`` issues, and PARAM's default); the max
  over ranks.
* **bare**: the same with blocking calls (what ``--blocking 1`` waits for).

The bare loops run inside ``comm.quiet()`` and with the garbage collector paused, as the harness's timed
loop does, so the two differ only in the code between the timer's reads. The table gives per size each
tool's median over rounds and the median of the per-round ratios commbench / bare-async and commbench-b1 /
bare (a time ratio: 1.02 = 2 % slower) with a distribution-free ~95 % interval (``median_interval``). The
process-level comparison, with PARAM and separately started ranks, is ``bench_param.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_param import bare_window, median_interval, parse_size, size_label, sweep_sizes  # noqa: E402 - this folder's sibling

TOOLS = ("commbench", "commbench-b1", "bare-async", "bare")
PAIRS = (("commbench", "bare-async"), ("commbench-b1", "bare"))  # each harness tool and its bare loop


def _bare_window(comm: Any, size: int, warmup: int, iters: int, issue_async: bool) -> float:
    """The bare loop at ``size``: this rank's seconds per call of one window."""
    import torch
    import torch.distributed as dist

    from commbench.run.timed_calls import collector_paused

    elements = size // 4 // comm.world_size * comm.world_size
    send = torch.ones(elements, dtype=torch.float32)
    received = torch.empty_like(send)
    for _ in range(warmup):
        dist.all_to_all_single(received, send, group=comm.group)
    comm.barrier()
    with comm.quiet(), collector_paused():
        return bare_window(received, send, iters, issue_async, comm.group)


def entry(comm: Any, sizes: list[int], warmup: int, iters: int, rounds: int) -> dict[str, Any]:
    """Every rank: ``rounds`` x each tool; rank 0's {tool: [{size: us} per round]}, the load per round, and
    every #wrong the harness reported."""
    from commbench.backends.torchdist import TorchDistBackend
    from commbench.run.config import RunOptions
    from commbench.run.harness import run_jobs
    from commbench.run.jobs import BalancedJob

    times: dict[str, list[dict[int, float]]] = {tool: [] for tool in TOOLS}
    loads, wrong = [], set()
    for index in range(rounds):
        loads.append(os.getloadavg()[0])
        for tool in TOOLS[index % len(TOOLS) :] + TOOLS[: index % len(TOOLS)]:
            if tool.startswith("commbench"):
                job = BalancedJob("balanced", list(sizes), warmup=warmup, iters=iters)
                opts = RunOptions("gloo", blocking=int(tool == "commbench-b1"))
                rows, _ = run_jobs(comm, [job], opts, TorchDistBackend)
                times[tool].append({int(r["size_bytes"]): float(r["time_us_mean"]) for r in rows})
                wrong |= {r["wrong"] for r in rows}
            else:
                mine = [_bare_window(comm, size, warmup, iters, tool == "bare-async") for size in sizes]
                every = comm.all_gather_object(mine)
                times[tool].append({size: max(r[i] for r in every) * 1e6 for i, size in enumerate(sizes)})
    return {"times": times, "loads": loads, "wrong": sorted(wrong, key=str)}


def table(sizes: list[int], result: dict[str, Any], args: argparse.Namespace) -> str:
    times = result["times"]
    head = [f"{tool} (us)" for tool in TOOLS] + [f"{a}/{b} [CI]" for a, b in PAIRS]
    lines = [
        f"{args.world_size} gloo ranks in one launch, sizes {sizes[0]}..{sizes[-1]} B x{args.factor}, "
        f"{args.warmup} warm-up + {args.iters} timed iterations, {args.rounds} rounds alternated; "
        f"{os.cpu_count()} CPUs; load per round {' / '.join(f'{x:.1f}' for x in result['loads'])}; "
        f"#wrong seen {result['wrong']}.",
        "",
        "| size | " + " | ".join(head) + " |",
        "|---:|" + "---:|" * len(head),
    ]
    for size in sizes:
        cells = [f"{statistics.median(r[size] for r in times[tool]):.1f}" for tool in TOOLS]
        for a, b in PAIRS:
            ratios = [ra[size] / rb[size] for ra, rb in zip(times[a], times[b], strict=True)]
            low, high = median_interval(ratios)
            cells.append(f"{statistics.median(ratios):.3f} [{low:.2f}, {high:.2f}]")
        lines.append(f"| {size_label(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--min-bytes", default="1M")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--factor", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args()
    from commbench.run.dist import launch

    sizes = sweep_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    result = launch(
        args.world_size, entry, (sizes, args.warmup, args.iters, args.rounds), process_group="gloo",
        timeout_s=600,
    )  # fmt: skip
    text = table(sizes, result, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
