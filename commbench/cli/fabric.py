"""``commbench topo`` and ``commbench simulate`` (added to the command group by commbench.cli.main)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from commbench.cli import options as opt
from commbench.errors import UsageError
from commbench.fabric.engines import KERNELS
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
    if calibration or fit:
        _echo_calibration(inputs["tokens_per_rank"], inputs["seed"], as_json, fit)
        return
    if calibrate:
        ctx = click.get_current_context()
        given = ctx.get_parameter_source("ranks_text") != click.core.ParameterSource.DEFAULT
        ranks = _parse_ranks(ranks_text) if given else None
        _echo_rack_fit(calibrate, inputs["model"], ranks, inputs["tokens_per_rank"], inputs["seed"], as_json)
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


def _regime_markdown(summary: Sequence[dict[str, Any]]) -> list[str]:
    from commbench.report.pages.tables import format_table

    headers = ["regime", "cases", "within 15%", "median abs error", "LOSO within 25%", "untrusted"]
    body = [
        [
            s["regime"],
            str(s["cases"]),
            f"{s['within_15']} of {s['cases']}",
            f"{s['median_abs_error_pct']:.1f}%",
            f"{s['loso_within_25']} of {s['loso_cases']}",
            str(s["untrusted"]),
        ]
        for s in summary
    ]
    return [format_table(headers, body, "markdown")]


def _calibration_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The calibration of docs/fabric-calibration.md: accuracy per regime, every case, the untrusted and
    not-modelled figures with their reasons, the parameters and the sources, as Markdown."""
    from commbench.fabric.calibration import regime_summary
    from commbench.fabric.cases import not_modelled
    from commbench.fabric.engines import parameters
    from commbench.report.pages.tables import format_table

    headers = ["case", "regime", "engine", "spec", "ranks", "metric", "published", "model", "error", "LOSO"]
    headers.append("model's bottleneck")
    body = [
        [
            r["case"] + (" (u)" if r["untrusted"] else " (!)" if r["note"] else ""),
            r["regime"],
            r["kernel"],
            r["spec"],
            str(r["ranks"]),
            r["metric"],
            f"{r['published']:.1f}",
            f"{r['predicted']:.1f}",
            f"{r['error_pct']:+.1f}%",
            "" if r["loso_error_pct"] != r["loso_error_pct"] else f"{r['loso_error_pct']:+.1f}%",
            r["bottleneck"],
        ]
        for r in rows
    ]
    lines = ["## Accuracy per regime", "", *_regime_markdown(regime_summary(rows)), ""]
    lines += ["## Parameters", ""]
    table = [[p.name, f"{p.value:g}", p.unit, p.source] for p in parameters().values()]
    lines += [format_table(["parameter", "value", "unit", "source"], table, "markdown"), ""]
    lines += ["## Cases", "", format_table(headers, body, "markdown"), ""]
    lines += ["## Flagged and untrusted cases (listed, never fitted or scored)", ""]
    lines += [f"- (!) {r['case']}: {r['note']}" for r in rows if r["note"]]
    lines += [f"- (u) {r['case']}: {r['untrusted']}" for r in rows if r["untrusted"]]
    skipped = not_modelled()
    lines += ["", f"## Not modelled ({len(skipped)} published figures)", ""]
    reasons: dict[str, list[str]] = {}
    for item in skipped:
        reasons.setdefault(item.reason, []).append(item.label)
    lines += [f"- {reason}: {len(labels)} (e.g. {labels[0]})" for reason, labels in sorted(reasons.items())]
    sources = "; ".join(sorted({r["source"] for r in rows}))
    return "\n".join([*lines, "", f"Sources: {sources}."])


def _echo_calibration(tokens: int, seed: int, as_json: bool, fit: bool) -> None:
    from commbench.fabric.calibration import calibration_rows, case_traffic, fit_table
    from commbench.fabric.cases import calibration_cases
    from commbench.fabric.engines import parameters

    if fit:
        traffics = [case_traffic(case, tokens, seed) for case in calibration_cases()]
        result = fit_table([t for t in traffics if not t.case.untrusted])
        table = parameters()
        if as_json:
            click.echo(json.dumps({"values": result.values, "relative_sigma": result.relative_sigma}))
            return
        for name, value in result.values.items():
            sigma = result.relative_sigma[name]
            unit, listed = table[name].unit, table[name].value
            click.echo(f"{name} = {value:.4g} +- {100 * sigma:.0f}% {unit} (table: {listed:g})")
        for name in result.held:
            click.echo(f"{name}: not constrained by the trusted cases, held at {table[name].value:g}")
        return
    rows = calibration_rows(tokens=tokens, seed=seed)
    click.echo(json.dumps(rows, indent=2) if as_json else _calibration_markdown(rows))


def _cell(value: Any) -> str:
    """A CSV cell as a key: whole numbers alike whether read as int or float, empty cells as ""."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _rack_phases(folders: Sequence[str]) -> tuple[list[Any], int, int, bool]:
    """Every measured phase of the report folders as the fabric stage's plain MeasuredPhase (the report
    stage reads the folder here: commbench.fabric never imports it), the folders' domain and host sizes, and
    whether they were CPU runs."""
    import numpy as np

    from commbench.fabric.rackfit import MeasuredPhase, pair_phase
    from commbench.report.folder.reading import read_folder

    phases: list[MeasuredPhase] = []
    layouts: set[tuple[int, int, int]] = set()
    cpu = False
    for path in folders:
        folder = read_folder(path)
        topology = folder.meta.get("topology") or {}
        domains = np.asarray(topology.get("domain_of_rank") or [], dtype=np.int64)
        hosts = np.asarray(topology.get("host_of_rank") or [], dtype=np.int64)
        if domains.size == 0:
            raise UsageError(f"--calibrate {path}: meta.json has no topology (domain_of_rank); run it again")
        world = int(domains.size)
        per_domain, per_host = int((domains == domains[0]).sum()), int((hosts == hosts[0]).sum())
        contiguous = np.array_equal(domains, np.arange(world) // per_domain) and world % per_domain == 0
        if not contiguous:
            raise UsageError(
                f"--calibrate {path}: NVLink domains of unequal size or not contiguous; the fit needs equal "
                "contiguous domains (run with --ranks-per-domain)"
            )
        layouts.add((world, per_domain, per_host))
        spec = folder.meta.get("system_spec") or {}
        cpu = cpu or spec.get("name") in (None, "none") or "gloo" in set(folder.results.get("backend", []))
        # A result row's ranks: the same case (pattern, phase, skew, tokens, send mode, repeat, job) and,
        # where ranks.csv states it (the balanced sweep), the same size; empty cells compare as "".
        results, ranks = folder.results, folder.ranks
        keys = [
            key
            for key in ("pattern", "phase", "skew", "tokens_per_rank", "send_mode", "repeat", "job_index")
            if key in results.columns and key in ranks.columns
        ]
        sized = "size_bytes" in ranks.columns and ranks["size_bytes"].notna().any()
        keys += ["size_bytes"] if sized else []
        cells = ranks.assign(**{c: ranks[c].map(_cell) for c in keys}) if len(ranks) else ranks
        by_key = {k: f for k, f in cells.groupby(keys, sort=False)} if len(ranks) else {}
        for row in results.itertuples(index=False):
            key = tuple(_cell(getattr(row, c)) for c in keys)
            frame = by_key.get(key if len(keys) > 1 else key[0])
            if frame is None or len(frame) != world or not np.isfinite(row.time_us_p50):
                continue
            frame = frame.sort_values("rank")
            loads = np.zeros((world, 2, 2))
            for c, name in enumerate(("nvlink", "scaleout")):
                loads[:, c, 0] = frame[f"{name}_sent_bytes"].to_numpy(dtype=float)
                loads[:, c, 1] = frame[f"{name}_recv_bytes"].to_numpy(dtype=float)
            peers = np.zeros((world, 2, 2), dtype=np.int64)
            peers[:, 0, :] = np.where(loads[:, 0, :] > 0, per_domain - 1, 0)
            peers[:, 1, :] = np.where(loads[:, 1, :] > 0, world - per_domain, 0)
            label = f"{row.pattern} {row.phase} {int(row.size_bytes)} B"
            phases.append(MeasuredPhase(label, loads, peers, float(row.time_us_p50) * 1e-6))
        pairs = folder.extras.pairs
        if len(pairs):
            for pair in pairs[pairs["test"].isin(["latency", "bandwidth"])].itertuples(index=False):
                if pair.link_class == "self" or not np.isfinite(pair.time_us):
                    continue
                label = f"pair {pair.test} {int(pair.src)}->{int(pair.dst)} {int(pair.size_bytes)} B"
                phases.append(
                    pair_phase(
                        label,
                        world,
                        int(pair.src),
                        int(pair.dst),
                        pair.link_class == "scaleout",
                        float(pair.size_bytes),
                        float(pair.time_us) * 1e-6,
                    )
                )
    if len({(d, h) for _, d, h in layouts}) > 1:
        raise UsageError("--calibrate: the folders have different NVLink domain or host sizes; fit one rack")
    _, per_domain, per_host = next(iter(layouts))
    return phases, per_domain, per_host, cpu


def _echo_rack_fit(
    folders: Sequence[str], model_name: str, ranks: list[int] | None, tokens: int, seed: int, as_json: bool
) -> None:
    from commbench.fabric.rackfit import DEFAULT_RACKS, RACK_PARAMETERS, RACK_UNITS, fit_rack, predict_racks
    from commbench.inputs.models import load_model
    from commbench.report.pages.tables import format_table

    model = load_model(model_name)
    phases, per_domain, per_host, cpu = _rack_phases(folders)
    fit = fit_rack(phases, per_domain, per_host)
    sizes = ranks or [k * per_domain for k in DEFAULT_RACKS]
    predicted = predict_racks(fit, model, sizes, tokens, seed)
    whose = (
        "this host's CPU processes over gloo, not a GPU fabric: the figures describe this host's memory and "
        "loopback"
        if cpu
        else "this rack's GPUs"
    )
    if as_json:
        click.echo(json.dumps({**fit.as_dict(), "prediction": predicted, "measured_on": whose}, indent=2))
        return
    click.echo(
        f"fit to {len(phases)} measured phases of {', '.join(folders)} ({whose}); racks of "
        f"{per_domain} ranks, hosts of {per_host}"
    )
    body = [
        [name, f"{value:.4g}", f"+-{100 * sigma:.1f}%", unit]
        for name, value, sigma, unit in zip(
            RACK_PARAMETERS, fit.values, fit.relative_sigma, RACK_UNITS, strict=True
        )
    ]
    click.echo(format_table(["parameter", "fitted", "1 sigma", "unit"], body))
    residuals = [
        [label, f"{m * 1e6:.1f}", f"{f * 1e6:.1f}", f"{r:+.1f}%"]
        for label, m, f, r in zip(fit.labels, fit.measured_s, fit.fitted_s, fit.residual_pct, strict=True)
    ]
    click.echo("\n" + format_table(["phase", "measured(us)", "fitted(us)", "residual"], residuals))
    rows = [
        [
            str(r["ranks"]),
            f"{r['racks']:g}",
            r["phase"],
            f"{r['time_us']:.1f}",
            f"{r['low_us']:.1f} - {r['high_us']:.1f}",
        ]
        for r in predicted
    ]
    click.echo(f"\n{model.name}, {tokens} tokens per rank, on the fitted rack:")
    click.echo(format_table(["ranks", "racks", "phase", "time(us)", "16-84% of the fit's draws"], rows))
    click.echo(
        f"note: predictions of the fitted model (docs/fabric-model.md, 'Fit to your rack') for {whose}; "
        "error bars from the fit's covariance only (not from what the model leaves out)"
    )
