"""``commbench pattern``: build a traffic pattern without running it and print its statistics or its JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from commbench.cli.inputs import build_routing_config, cap_cpu_threads
from commbench.cli.options import config_options, config_values
from commbench.errors import UsageError
from commbench.run.config import MoeConfig

if TYPE_CHECKING:
    from commbench.inputs.layout import Layout
    from commbench.traffic.pattern import Pattern


@click.command()
@config_options("pattern")
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    required=True,
    help="Number of ranks the experts are spread over.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the pattern (matrices and statistics) as JSON.")
@click.option(
    "--pattern",
    "pattern_kind",
    type=click.Choice(["moe", "kineto"]),
    default="moe",
    show_default=True,
    help="moe: the model's routed traffic; kineto: the all-to-all calls of a torch.profiler trace "
    "(--kineto-trace), each call's [src][dst] bytes.",
)
@click.option("--kineto-trace", default=None, metavar="PATH", help="With --pattern kineto: as in `run`.")
def pattern(
    world_size: int,
    as_json: bool,
    pattern_kind: str,
    kineto_trace: str | None,
    **params: Any,
) -> None:
    """Build a traffic pattern without running it and print its statistics (no processes are started)."""
    values = config_values("pattern", params)
    nccl_tests_matrix = values.pop("nccl_tests_matrix", None)
    per_domain, per_host = values.pop("ranks_per_domain", None), values.pop("ranks_per_host", None)
    inputs = MoeConfig(**values)
    if pattern_kind == "kineto" or kineto_trace is not None:
        click.echo(kineto_pattern(kineto_trace, world_size, as_json, pattern_kind, nccl_tests_matrix))
        return
    from commbench.cli.resources import check_pattern_fits
    from commbench.inputs.layout import build_layout
    from commbench.report.analysis.replicas import replicas_summary
    from commbench.report.interop.nccl_tests_export import (
        check_export_paths,
        export_summary,
        plan_export,
        write_export,
    )
    from commbench.traffic.links import link_class_bytes
    from commbench.traffic.nodes import Nodes
    from commbench.traffic.pattern import build_pattern, check_nodes, pattern_to_json

    cap_cpu_threads()
    cfg = build_routing_config(inputs, world_size, dry_run=False)
    layout = build_layout(world_size, per_domain, per_host)
    nodes = None
    if inputs.send_mode == "node" and (per_domain is not None or per_host is not None):
        nodes = Nodes.of(layout.domain_of_rank)
    check_nodes(inputs.send_mode, nodes, world_size)
    if nccl_tests_matrix is not None:
        if inputs.send_mode == "node":
            raise UsageError(
                "--nccl-tests-matrix writes one all-to-all, --send-mode node has two (scale-out, then "
                "NVLink); use --send-mode token or selection"
            )
        check_export_paths(nccl_tests_matrix)  # before the routing, which can take a while
    check_pattern_fits(cfg, as_json)  # routes every rank here: 10^9 tokens would fill the host first
    built = build_pattern(cfg, inputs.send_mode, nodes)
    exports = plan_export(built, nccl_tests_matrix) if nccl_tests_matrix is not None else []
    eplb = replicas_summary(cfg, inputs.send_mode, built) if cfg.replicas else None  # --replicas N
    write_export(exports)  # last: a refusal above leaves nothing written
    if as_json:
        data = pattern_to_json(built)
        data["layout"] = layout.describe()
        data["link_class_bytes"] = {name: link_class_bytes(matrix, layout.domain_of_rank) for name, matrix in
                                    phase_matrices(built)}  # fmt: skip
        if eplb is not None:
            data["eplb_replicas"] = eplb[1]
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(describe_pattern(built, layout) + (f"\n\n{eplb[0]}" if eplb is not None else ""))
    if exports:  # after the statistics; on stderr when stdout is the JSON
        click.echo(("" if as_json else "\n") + export_summary(exports), err=as_json)


def kineto_pattern(
    path: str | None, world_size: int, as_json: bool, pattern_kind: str, export: str | None
) -> str:
    """``pattern --pattern kineto``: every all-to-all call of the trace, each its [src][dst] bytes (the
    matrices ``run --pattern kineto`` moves), as tables or JSON."""
    from commbench.inputs.kineto import read_kineto
    from commbench.report.pages.tables import format_table
    from commbench.run.jobs import MatrixCall

    if pattern_kind != "kineto" or path is None or export is not None:
        raise UsageError("--pattern kineto takes --kineto-trace PATH (and no --nccl-tests-matrix)")
    trace = read_kineto(path)
    if trace.group_size != world_size:
        raise UsageError(
            f"the trace's process group has {trace.group_size} ranks; give --world-size {trace.group_size}"
        )
    calls = [(call, MatrixCall(call.name, call.matrix).row_bytes) for call in trace.calls]
    if as_json:
        return json.dumps(
            {
                "pattern": "kineto",
                "source": trace.source,
                "group": trace.group,
                "group_ranks": trace.group_ranks,
                "world": trace.group_size,
                "read_from": trace.form,
                "calls": [
                    {"name": call.name, "dtype": call.dtype, "element_bytes": call.element_bytes,
                     "row_bytes": rows, "bytes": call.matrix.tolist()}
                    for call, rows in calls
                ],
            },
            indent=2,
        )  # fmt: skip
    lines = [
        f"pattern kineto: {trace.source}, process group {trace.group!r} of {trace.group_size} ranks, "
        f"{len(calls)} all-to-all calls (read from {trace.form}); bytes [src][dst], rows = sender"
    ]
    for call, rows in calls:
        sent = call.matrix.sum(axis=1)
        lines += ["", f"{call.name}: {call.dtype}, {int(sent.sum())} B in rows of {rows} B"]
        table = [
            [f"rank {src}", *map(str, row), str(int(sent[src]))]
            for src, row in enumerate(call.matrix.tolist())
        ]
        lines.append(format_table(["src", *(f"->{dst}" for dst in range(trace.group_size)), "sent"], table))
    return "\n".join(lines)


def phase_matrices(built: Pattern) -> list[tuple[str, Any]]:
    """(row phase, [src][dst] bytes) of every phase, each node-mode stage after its phase."""
    from commbench.traffic.nodes import stage_phase

    out = []
    for phase, matrix in (("dispatch", built.dispatch_bytes), ("combine", built.combine_bytes)):
        out.append((phase, matrix))
        out += [(stage_phase(phase, stage), part) for stage, part in built.stages.get(phase, {}).items()]
    return out


def describe_pattern(built: Pattern, layout: Layout | None = None, top: int = 5) -> str:
    """Human-readable statistics of a Pattern: bytes per phase (and node-mode stage) and link class on
    ``layout`` (default: every rank in one NVLink domain), imbalance, busiest destination ranks."""
    import numpy as np

    from commbench.inputs.layout import build_layout
    from commbench.report.pages.tables import format_table
    from commbench.traffic.links import link_class_bytes

    layout = layout or build_layout(built.world_size)

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
    for phase, matrix in phase_matrices(built):
        matrix = np.asarray(matrix, dtype=np.int64)
        sent, received, self_bytes = matrix.sum(1), matrix.sum(0), np.diag(matrix)
        classes = link_class_bytes(matrix, layout.domain_of_rank)
        link_max = int(np.maximum(sent - self_bytes, received - self_bytes).max())
        mean_received = float(received.mean())
        rows.append(
            [
                phase,
                str(classes["total"]),
                str(classes["self"]),
                str(classes["link"]),
                str(classes["nvlink"]),
                str(classes["scaleout"]),
                str(int(np.maximum(sent, received).max())),
                str(link_max),
                f"{received.max() / mean_received:.3f}" if mean_received else "-",
            ]
        )
    headers = [
        "phase",
        "total(B)",
        "self(B)",
        "link(B)",
        "nvlink(B)",
        "scaleout(B)",
        "size(B)",
        "link max(B)",
    ]
    lines += ["", format_table([*headers, "recv max/mean"], rows)]
    lines.append(
        "size = the bottleneck rank's max(sent, received), self traffic included; link max = its bytes "
        f"excluding self traffic, one direction; link classes on {layout.describe()}"
    )
    if built.nodes is not None:
        stats = built.stats
        fewer = stats["rank_scaleout_rows"] / stats["scaleout_rows"] if stats["scaleout_rows"] else 1.0
        lines.append(
            f"node mode on {built.nodes.describe()}: a token crosses once to each other node holding its "
            f"experts ({stats['scaleout_rows']} scale-out rows; token mode sends "
            f"{stats['rank_scaleout_rows']} between nodes, {fewer:.2f}x), then once to each rank of the node "
            "holding them (NVLink); a phase row adds both stages' bytes"
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
