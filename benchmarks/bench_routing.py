"""Routing generation speed against the floor of a bare ``torch.topk`` over a score matrix of the same shape.

    python benchmarks/bench_routing.py [--tokens N] [--model deepseek-v3] [--skew zipf:1.2] [--repeats 5]

Both are timed in the same run (median of the repeats). The routing side is ``route_rank`` for one rank,
calibration and popularity excluded (computed once per run and cached); the floor only runs ``torch.topk``
on a ready-made [tokens, experts] float32 matrix, as a real router does after its gate GEMM. Target: the
ratio stays at or below 2.

route_rank runs a few hundred vectorized torch ops per chunk where topk runs one. On a machine shared with
other busy processes, OpenMP workers that spin between ops (the default wait policy) slow the routing far
more than the single topk; compare with --threads 1 or OMP_WAIT_POLICY=PASSIVE to see that effect.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.routing import RoutingConfig, expert_popularity, route_rank


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the routed rank (default 1M)")
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--skew", default="zipf:1.2")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model(args.model)
    cfg = RoutingConfig(model, parse_skew(args.skew), args.world_size, args.tokens, seed=0)
    start = time.perf_counter()
    expert_popularity(cfg)
    setup = time.perf_counter() - start
    route_rank(cfg, 0)  # warm-up
    routing = median_seconds(lambda: route_rank(cfg, 0), args.repeats)

    scores = torch.rand(args.tokens, model.num_experts)
    torch.topk(scores, model.topk)  # warm-up
    floor = median_seconds(lambda: torch.topk(scores, model.topk), args.repeats)

    print(
        f"model {model.name}  skew {args.skew}  tokens {args.tokens}  experts {model.num_experts}"
        f"  top-{model.topk}  torch threads {torch.get_num_threads()}"
        f"  OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', '(default)')}  repeats {args.repeats}"
    )
    print(f"popularity/calibration (once per run): {setup:.3f} s")
    print(f"route_rank:                     {routing:.3f} s  ({routing / args.tokens * 1e9:.0f} ns/token)")
    print(f"torch.topk floor:               {floor:.3f} s  ({floor / args.tokens * 1e9:.0f} ns/token)")
    print(f"ratio route_rank / floor:       {routing / floor:.2f}  (target <= 2)")


if __name__ == "__main__":
    main()
