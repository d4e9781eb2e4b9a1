"""``commbench pattern``: build a traffic pattern without running it and print its statistics or its JSON."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import click

from commbench.cli.inputs import MoeInputs, build_routing_config
from commbench.cli.options import moe_options

if TYPE_CHECKING:
    from commbench.traffic.pattern import Pattern


@click.command()
@moe_options
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    required=True,
    help="Number of ranks the experts are spread over.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the pattern (matrices and statistics) as JSON.")
def pattern(world_size: int, as_json: bool, **params: Any) -> None:
    """Build a traffic pattern without running it and print its statistics (no processes are started)."""
    from commbench.cli.resources import check_pattern_fits
    from commbench.traffic.pattern import build_pattern, pattern_to_json

    cap_cpu_threads()
    inputs = MoeInputs.from_params(params)
    cfg = build_routing_config(inputs, world_size, dry_run=False)
    check_pattern_fits(cfg, as_json)  # routes every rank here: 10^9 tokens would fill the host first
    built = build_pattern(cfg, inputs.send_mode)
    if as_json:
        click.echo(json.dumps(pattern_to_json(built), indent=2))
    else:
        click.echo(describe_pattern(built))


def cap_cpu_threads(threads: int = 1) -> None:
    """Run torch's CPU ops (OpenMP and MKL) on ``threads`` threads unless the user set OMP_NUM_THREADS.

    Routing a pattern is many small tensor ops per rank: extra intra-op threads only add hand-offs, and on a
    busy host their spin-waiting costs more than they compute. Measured on 2 cores, 64 ranks x 4,096
    deepseek-v3 tokens: idle, 2.6-2.8 s (3.0 s CPU) with 2 threads vs 2.3-2.6 s (2.0-2.4 s CPU) with 1;
    beside other busy processes 5-22 s (4.8-8.5 s CPU) vs 3.2-11 s (1.6-2.4 s CPU)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(threads)


def describe_pattern(built: Pattern, top: int = 5) -> str:
    """Human-readable statistics of a Pattern: bytes per phase, imbalance, busiest destination ranks."""
    import numpy as np

    from commbench.report.tables import format_table

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
    headers = ["phase", "total(B)", "self(B)", "link(B)", "size(B)", "link max(B)", "recv max/mean"]
    lines += ["", format_table(headers, rows)]
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
    return f"{value:.4g}" if isinstance(value, float) else str(value)
