"""``commbench topo`` and ``commbench simulate`` (registered into the main CLI group by commbench.cli)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from commbench.errors import UsageError


def _parse_ranks(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--ranks {text!r}: give comma-separated world sizes, e.g. 72,256,1024") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--ranks {text!r}: world sizes must be positive integers, e.g. 72,256,1024")
    return sizes


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


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


@click.command()
@click.option(
    "--model", "model_name", default="deepseek-v3", show_default=True, help="Model preset or YAML path."
)
@click.option(
    "--ranks",
    "ranks_text",
    default="72,256,1024",
    show_default=True,
    help="Comma-separated world sizes (GPUs).",
)
@click.option("--spec", default="gb300-nvl72", show_default=True, help="System spec name or YAML path.")
@click.option(
    "--tokens", type=click.IntRange(min=1), default=4096, show_default=True, help="Tokens per rank."
)
@click.option(
    "--skew",
    default="uniform",
    show_default=True,
    help="uniform | zipf:S | hot:N:F | rank-imbalance:R | trace:PATH.",
)
@click.option(
    "--ep-size",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks per EP group [default: min(ranks, experts)].",
)
@click.option(
    "--ranks-per-domain",
    type=click.IntRange(min=1),
    default=None,
    help="NVLink domain size [default: the spec's].",
)
@click.option(
    "--ranks-per-host", type=click.IntRange(min=1), default=None, help="Ranks per host [default: the spec's]."
)
@click.option(
    "--send-mode",
    type=click.Choice(["token", "selection"]),
    default="token",
    show_default=True,
    help="token: once per destination rank (DeepEP); selection: once per (token, expert).",
)
@click.option(
    "--fabric",
    "fabric_kind",
    type=click.Choice(["rail", "rail-no-pxn", "fat-tree"]),
    default=None,
    help="Scale-out fabric [default: the spec's; rail = rail-optimized with PXN forwarding over NVLink].",
)
@click.option(
    "--oversubscription", type=float, default=None, help="Leaf-to-spine oversubscription (1 = non-blocking)."
)
@click.option(
    "--pod-gpus",
    type=click.IntRange(min=0),
    default=None,
    help="GPUs under one leaf group (with --oversubscription).",
)
@click.option(
    "--sample-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Routed tokens behind the sampled fast path.",
)
@click.option("--exact", "exact", flag_value=True, default=None, help="Route every token (slow at scale).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print rows and notes as JSON.")
def simulate(
    model_name: str,
    ranks_text: str,
    spec: str,
    tokens: int,
    skew: str,
    ep_size: int | None,
    ranks_per_domain: int | None,
    ranks_per_host: int | None,
    send_mode: str,
    fabric_kind: str | None,
    oversubscription: float | None,
    pod_gpus: int | None,
    sample_tokens: int,
    exact: bool | None,
    seed: int,
    as_json: bool,
) -> None:
    """Predict dispatch/combine time per world size with the fabric model (no GPUs needed).

    Experts live in EP groups of --ep-size contiguous ranks; larger worlds replicate the EP groups
    data-parallel, and all groups communicate at once, sharing the scale-out fabric. Per-GPU GB/s = bytes
    a GPU moves (self included) / phase time; efficiency = per-GPU tokens/s relative to the smallest size.
    """
    from commbench.fabric.model import simulate as run_simulation

    overrides: dict[str, Any] = {"oversubscription": oversubscription, "pod_gpus": pod_gpus}
    if fabric_kind is not None:
        overrides["rail_optimized"] = fabric_kind != "fat-tree"
        overrides["pxn"] = fabric_kind == "rail"
    result = run_simulation(
        model_name,
        _parse_ranks(ranks_text),
        spec=spec,
        tokens_per_rank=tokens,
        skew=skew,
        ranks_per_domain=ranks_per_domain,
        ranks_per_host=ranks_per_host,
        ep_size=ep_size,
        send_mode=send_mode,
        seed=seed,
        sample_tokens=sample_tokens,
        exact=exact,
        **overrides,
    )
    if as_json:
        click.echo(json.dumps({"rows": result.rows, "notes": result.notes}, indent=2, default=float))
        return
    headers = [
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
    ]
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
    click.echo(_table(headers, body))
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(
        "note: predictions of the fabric model (docs/fabric-model.md), not measurements; GB = 1e9 bytes, "
        "bandwidths per direction"
    )
