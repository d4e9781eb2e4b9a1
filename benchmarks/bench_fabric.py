"""Speed of the fabric model's fast path, and its error against the exact pattern build.

    python benchmarks/bench_fabric.py          # speed: deepseek-v3 pattern + prediction, 1,024 and 8,192
    python benchmarks/bench_fabric.py --error  # sampled fast path vs exact build on small sizes (markdown)

Targets (issue 3): a 1,024-rank deepseek-v3 pattern in under 1 s and 8,192 ranks in under 10 s on 2 cores.
The speed table times token mode (the baseline) and node mode (``--send-mode node``: the per-node stages on
the spec's NVLink domains) side by side, with node mode's total over token mode's.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from commbench.fabric.ep_groups import grouped_pattern
from commbench.fabric.model import make_fabric, predict_phase

SPEED_SIZES = (1024, 8192)
TARGET_S = {1024: 1.0, 8192: 10.0}
ERROR_CASES = (
    ("deepseek-v3", 32, 1024, "uniform"),
    ("deepseek-v3", 64, 512, "uniform"),
    ("deepseek-v3", 72, 512, "uniform"),
    ("deepseek-v3", 32, 1024, "zipf:1.2"),
    ("deepseek-v3", 32, 1024, "hot:8:0.3"),
    ("qwen3-30b-a3b", 16, 2048, "uniform"),
)


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def speed(spec: str, repeats: int) -> None:
    print(f"cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, spec {spec}")
    print(
        "| ranks | run | send mode | pattern (s) | model, both phases (s) | total (s) | vs token | target |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for world in SPEED_SIZES:
        fabric = make_fabric(spec, world)
        for run in range(repeats):
            baseline = None
            for mode in ("token", "node"):
                # A new seed each run, so no routing result is reused from a cache.
                pattern, t_pattern = _timed(
                    lambda world=world, run=run, mode=mode, fabric=fabric: grouped_pattern(
                        "deepseek-v3",
                        world,
                        seed=run,
                        send_mode=mode,
                        domain_of_rank=fabric.layout.domain_of_rank,
                    )
                )

                def both(pattern=pattern, fabric=fabric):
                    return predict_phase(pattern.dispatch_bytes, fabric), predict_phase(
                        pattern.combine_bytes, fabric
                    )

                _, t_model = _timed(both)
                total = t_pattern + t_model
                baseline = baseline or total
                label = "first (cold)" if run == 0 else f"repeat {run}"
                print(
                    f"| {world} | {label} | {mode} | {t_pattern:.2f} | {t_model:.2f} | {total:.2f} | "
                    f"{total / baseline:.2f} | < {TARGET_S[world]:g} s "
                    f"{'ok' if total < TARGET_S[world] else 'MISSED'} |"
                )


def _stats(pattern, fabric) -> np.ndarray:
    dispatch = pattern.dispatch_bytes
    return np.array(
        [
            dispatch.sum(),
            dispatch.sum(1).max(),  # busiest receiver
            dispatch.sum(2).max(),  # busiest sender
            predict_phase(dispatch, fabric).time_s,
            predict_phase(pattern.combine_bytes, fabric).time_s,
        ]
    )


def error(seeds: int) -> None:
    print(
        f"Sampled fast path vs exact build, mean over {seeds} seeds (same seed for both), gb300-nvl72 rates "
        "with NVLink domains of 8 ranks so that both link classes carry traffic."
    )
    print(
        "| model | ranks | tokens | skew | total bytes | busiest receiver | busiest sender | dispatch time | "
        "combine time | exact seed-to-seed spread (dispatch time) |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for model, world, tokens, skew in ERROR_CASES:
        fabric = make_fabric("gb300-nvl72", world, ranks_per_domain=8, ranks_per_host=4)
        exact = np.array(
            [
                _stats(grouped_pattern(model, world, tokens, skew, seed=s, exact=True), fabric)
                for s in range(seeds)
            ]
        )
        fast = np.array(
            [
                _stats(grouped_pattern(model, world, tokens, skew, seed=s, exact=False), fabric)
                for s in range(seeds)
            ]
        )
        err = 100 * (fast.mean(0) / exact.mean(0) - 1)
        spread = 100 * exact[:, 3].std() / exact[:, 3].mean()
        cells = " | ".join(f"{e:+.2f}%" for e in err)
        print(f"| {model} | {world} | {tokens} | {skew} | {cells} | {spread:.2f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--error", action="store_true", help="fast path vs exact build instead of speed")
    parser.add_argument("--spec", default="gb300-nvl72")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.error:
        error(args.seeds)
    else:
        speed(args.spec, args.repeats)


if __name__ == "__main__":
    main()
