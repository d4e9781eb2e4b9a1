"""``commbench topo`` and ``commbench simulate`` (added to the command group by commbench.cli.main)."""

from __future__ import annotations

import json
from typing import Any

import click

from commbench.cli import options as opt
from commbench.errors import UsageError
from commbench.fabric.engines import KERNELS, LIBRARIES
from commbench.inputs.specs import TRANSPORTS
from commbench.run.declare import MAX_RANKS, MAX_TOKENS, SKEW_HELP

# --fabric choices as fabric-model knobs (FabricParams); no choice keeps the spec's.
FABRIC_KINDS: dict[str, dict[str, bool]] = {
    "rail": {"rail_optimized": True, "pxn": True},
    "rail-no-pxn": {"rail_optimized": True, "pxn": False},
    "fat-tree": {"rail_optimized": False, "pxn": False},
}
SIMULATE_HEADERS = (
    "ranks",
    "EP",
    "groups",
    "domains",
    "phase",
    "time(us)",
    "GB/s/GPU",
    "Mtok/s/GPU",
    "eff",
    "bottleneck",
)


def _parse_ranks(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--ranks {text!r}: give comma-separated world sizes, e.g. 72,256,1024") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--ranks {text!r}: world sizes must be positive integers, e.g. 72,256,1024")
    return sizes


def _count_option(
    name: str,
    help_text: str,
    default: int | None = None,
    minimum: int = 1,
    dest: str | None = None,
    maximum: int = MAX_RANKS,
) -> opt.Decorator:
    """An integer option in [minimum, maximum]; its default is shown when it has one."""
    return click.option(
        name,
        *([dest] if dest else []),
        type=click.IntRange(min=minimum, max=maximum),
        default=default,
        show_default=default is not None,
        help=help_text,
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print everything discovered as JSON.")
def topo(as_json: bool) -> None:
    """Show what this machine exposes: GPUs, NVLink state and link counts, the GPU fabric clique (multi-node
    NVLink domain), RDMA NICs, NCCL/NVSHMEM versions and NCCL_/NVSHMEM_/UCX_ environment variables.

    Works on a CPU machine, saying what it cannot see."""
    from commbench.hardware.probes import discover_local

    found = discover_local()
    if as_json:
        click.echo(json.dumps(found, indent=2, default=str))
        return
    click.echo(f"host: {found['host']}")
    driver = found.get("driver_version")
    if driver:
        click.echo(f"driver: {driver} (CUDA {found.get('cuda_driver_version') or '?'})")
    gpus = found["gpus"]
    click.echo(f"GPUs: {len(gpus)}")
    for gpu in gpus:
        version = gpu.get("nvlink_version")
        clique = (
            f"fabric cluster {gpu['fabric_cluster_uuid']} clique {gpu['fabric_clique_id']}"
            if gpu.get("fabric_cluster_uuid")
            else f"fabric {gpu.get('fabric_state') or gpu.get('fabric', 'not reported')}"
        )
        click.echo(
            f"  [{gpu['index']}] {gpu.get('name', '?')} {gpu.get('pci_bus_id', '')}: NVLink "
            f"{gpu.get('nvlink_links_active', 0)}/{gpu.get('nvlink_links', 0)} links active"
            + (f" (NVLink {version})" if version else "")
            + f"; {clique}"
        )
    click.echo(f"NVLink domain(s) seen from here: {', '.join(found['nvlink_domains'])}")
    nics = found["nics"]
    rdma = nics.get("rdma", [])
    click.echo(f"RDMA ports: {len(rdma)}")
    for port in rdma:
        click.echo(
            f"  {port['device']} port {port['port']}: {port['state'] or '?'}, {port['rate'] or '?'}, "
            f"{port['link_layer'] or '?'}"
        )
    net = ", ".join(
        f"{i['name']} ({i['state'] or '?'}"
        + (f", {i['speed_Mbps'] / 1000:g} Gb/s)" if i["speed_Mbps"] else ")")
        for i in nics.get("net", [])
    )
    click.echo(f"network interfaces: {net or 'none'}")
    libs = found["libraries"]
    lib_text = ", ".join(f"{k} {v}" for k, v in libs.items() if v not in (None, False, ""))
    click.echo(f"libraries: {lib_text or 'none found'}")
    env_text = ", ".join(f"{k}={v}" for k, v in found["env"].items())
    click.echo(f"environment: {env_text or 'no NCCL_/NVSHMEM_/UCX_ variables set'}")
    for note in found["notes"]:
        click.echo(f"note: {note}")


# What --calibration / --fit and --calibrate read; any other option given with them would be ignored.
_CALIBRATION_USES = ("calibration", "fit", "tokens_per_rank", "seed", "as_json")
_CALIBRATE_USES = ("calibrate", "model", "ranks_text", "tokens_per_rank", "seed", "as_json")


def _refuse_unused_options(calibrate: tuple[str, ...]) -> None:
    """UsageError naming an option given on the command line that the chosen mode does not read."""
    ctx = click.get_current_context()
    mode, uses = ("--calibrate", _CALIBRATE_USES) if calibrate else ("--calibration", _CALIBRATION_USES)
    if calibrate and (ctx.params.get("calibration") or ctx.params.get("fit")):
        raise UsageError("--calibrate and --calibration/--fit are two modes; choose one")
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name or "")
        if param.name in uses or source != click.core.ParameterSource.COMMANDLINE:
            continue
        used = ", ".join(o.opts[0] for o in ctx.command.params if o.name in uses and o.name != mode[2:])
        raise UsageError(
            f"{param.opts[0]} does not apply with {mode}, which reads only {used}; drop {param.opts[0]}"
        )


@click.command()
@click.option("--model", default="deepseek-v3", show_default=True, help="Model preset or YAML path.")
@click.option(
    "--ranks",
    "ranks_text",
    default="72,256,1024",
    show_default=True,
    help="Comma-separated world sizes (GPUs).",
)
@click.option("--spec", default="gb300-nvl72", show_default=True, help="System spec name or YAML path.")
@_count_option("--tokens", "Tokens per rank.", default=4096, dest="tokens_per_rank", maximum=MAX_TOKENS)
@click.option("--skew", default="uniform", show_default=True, help=SKEW_HELP)
@_count_option("--ep-size", "Ranks per EP group [default: min(ranks, experts)].")
@_count_option("--ranks-per-domain", "NVLink domain size [default: the spec's].")
@_count_option("--ranks-per-host", "Ranks per host [default: the spec's].")
@click.option(
    "--send-mode",
    type=click.Choice(["token", "selection", "node"]),
    default=None,
    help="token: once per destination rank; selection: once per (token, expert); node: once per other "
    "NVLink domain over scale-out (to the rank of the same local index), then once per destination rank "
    "inside it over NVLink (DeepEP internode, Hybrid-EP, UCCL-EP) [default: the --kernel's: nccl token, "
    "normal node, low-latency selection].",
)
@click.option(
    "--kernel",
    type=click.Choice(list(KERNELS)),
    default="nccl",
    show_default=True,
    help="Transfer engine: nccl = host-initiated collectives (a latency per peer in sequence); normal = "
    "GPU-initiated throughput kernels (DeepEP normal, Hybrid-EP, UCCL-EP: per-node dedup, peers in flight "
    "at once, a per-SM bound); low-latency = GPU-initiated per-selection messages whose latencies overlap.",
)
@_count_option(
    "--sms", "SMs a GPU-initiated kernel runs on [default: the library's usual, calibration.yaml]."
)
@click.option(
    "--library",
    type=click.Choice(list(LIBRARIES)),
    default=None,
    help="Whose kernels run the GPU-initiated engine: its fixed latency and bytes per SM, as fitted on that "
    "library's published figures [default: deepep].",
)
@click.option(
    "--transport",
    type=click.Choice(list(TRANSPORTS)),
    default=None,
    help="Scale-out transport [default: the spec's]; efa is driven through a CPU proxy with a per-message "
    "cost.",
)
@click.option(
    "--cuda-graph",
    "cuda_graph",
    flag_value=True,
    default=None,
    help="Phases replayed from a CUDA graph: no per-call launch cost.",
)
@click.option(
    "--fabric",
    "fabric_kind",
    type=click.Choice(list(FABRIC_KINDS)),
    default=None,
    help="Scale-out fabric [default: the spec's; rail = rail-optimized with PXN forwarding over NVLink].",
)
@click.option(
    "--oversubscription",
    type=opt.finite_float(1.0),
    default=None,
    help="Leaf-to-spine oversubscription, >= 1 (1 = non-blocking).",
)
@_count_option("--pod-gpus", "GPUs under one leaf group (with --oversubscription).", minimum=0)
@_count_option(
    "--sample-tokens", "Routed tokens behind the sampled fast path.", default=4096, maximum=MAX_TOKENS
)
@click.option("--exact", "exact", flag_value=True, default=None, help="Route every token (slow at scale).")
@opt.config_options("simulate")
@click.option(
    "--tflops",
    type=opt.finite_float(0.0, 1e6, min_open=True),
    default=1648.0,
    show_default=True,
    help="Per-GPU TFLOP/s of the comm/compute budget (default: the 1,648 record, delivered DeepSeek-V3 "
    "training throughput per GPU on GB300 NVL72); the spec's dense BF16/FP8 peaks are shown too.",
)
@click.option("--json", "as_json", is_flag=True, help="Print rows and notes as JSON.")
@click.option(
    "--calibration",
    is_flag=True,
    help="Instead, print the model against published all-to-all and EP-kernel figures: accuracy per "
    "regime, every case with its leave-one-source-out error, the parameters (docs/fabric-calibration.md; "
    "Markdown, or rows with --json). --tokens and --seed set the EP cases' routing; the other options do "
    "not apply.",
)
@click.option(
    "--calibrate",
    "calibrate",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Instead, fit the model's link parameters to report folder(s) of this rack (balanced sweep, MoE "
    "phases, pairwise test; repeat for several folders of one rack), print them with uncertainties and the "
    "residuals, and predict --model at 1, 2, 4, 8, 16 racks (or --ranks) with error bars.",
)
@click.option(
    "--fit",
    "fit",
    is_flag=True,
    help="With --calibration: fit the model's parameters to the trusted published cases and print them "
    "with their uncertainties (what calibration.yaml's fitted values come from).",
)
def simulate(
    ranks_text: str,
    fabric_kind: str | None,
    tflops: float,
    as_json: bool,
    calibration: bool,
    fit: bool,
    calibrate: tuple[str, ...],
    **inputs: Any,
) -> None:
    """Predict dispatch/combine time per world size with the fabric model (no GPUs needed).

    Experts live in EP groups of --ep-size contiguous ranks; larger worlds replicate the EP groups
    data-parallel, and all groups communicate at once, sharing the scale-out fabric. Per-GPU GB/s = bytes
    a GPU moves (self included) / phase time; efficiency = per-GPU tokens/s relative to the smallest size.
    """
    # ``inputs`` are named as commbench.fabric.ep_groups.simulate's parameters.
    if calibration or fit or calibrate:
        _refuse_unused_options(calibrate)
    if calibration or fit:
        from commbench.cli.fabric_fit import echo_calibration

        echo_calibration(inputs["tokens_per_rank"], inputs["seed"], as_json, fit)
        return
    if calibrate:
        ctx = click.get_current_context()
        given = ctx.get_parameter_source("ranks_text") != click.core.ParameterSource.DEFAULT
        ranks = _parse_ranks(ranks_text) if given else None
        from commbench.cli.fabric_fit import echo_rack_fit

        echo_rack_fit(calibrate, inputs["model"], ranks, inputs["tokens_per_rank"], inputs["seed"], as_json)
        return
    from commbench.cli.resources import check_simulate_fits
    from commbench.fabric.budget import simulated_budgets
    from commbench.fabric.ep_groups import simulate as run_simulation
    from commbench.inputs.models import load_model
    from commbench.report.profiler.budget import budgets_json, modelled_budget_text

    ranks = _parse_ranks(ranks_text)
    model = load_model(inputs.pop("model"))
    # Before any layout or routing is built: 10^8 ranks would fill the host's memory first.
    check_simulate_fits(
        model, ranks, inputs["ep_size"], inputs["tokens_per_rank"], inputs["sample_tokens"], inputs["exact"]
    )
    fabric = FABRIC_KINDS.get(fabric_kind or "", {})
    result = run_simulation(model=model, ranks=ranks, **inputs, **fabric)
    budgets = simulated_budgets(model, result, tflops, **inputs)  # the same traffic, against expert compute
    if as_json:
        rows = {"rows": result.rows, "notes": result.notes, "budget": budgets_json(budgets)}
        click.echo(json.dumps(rows, indent=2, default=float))
        return
    body = [
        [
            str(r["ranks"]),
            str(r["ep_size"]),
            str(r["ep_groups"]),
            str(r["domains"]),
            r["phase"],
            f"{r['time_us']:.1f}",
            f"{r['per_gpu_GBps']:.1f}" if "per_gpu_GBps" in r else "",
            f"{r['tokens_per_s_per_gpu'] / 1e6:.3f}",
            f"{100 * r['scaling_efficiency']:.1f}%",
            r.get("bottleneck", ""),
        ]
        for r in result.rows
    ]
    from commbench.report.pages.tables import format_table  # pandas: not for --help

    click.echo(format_table(SIMULATE_HEADERS, body))
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(
        "note: predictions of the fabric model (docs/fabric-model.md), not measurements; GB = 1e9 bytes, "
        "bandwidths per direction"
    )
    click.echo("\n" + modelled_budget_text(budgets))  # the comm/compute budget of each size
