"""``commbench simulate --calibration`` and ``--calibrate``: the fabric model against published figures, and
fitted to the user's own report folders (the report stage reads the folders here, above the fabric stage)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from commbench.errors import UsageError


def regime_markdown(summary: Sequence[dict[str, Any]]) -> list[str]:
    from commbench.report.pages.tables import format_table

    headers = ["regime", "cases", "within 15%", "median abs error", "LOSO within 25%", "untrusted"]
    body = [
        [
            s["regime"],
            str(s["cases"]),
            f"{s['within_15']} of {s['cases']}",
            f"{s['median_abs_error_pct']:.1f}%",
            f"{s['loso_within_25']} of {s['loso_cases']}" if s["loso_cases"] else "n/a",
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
    lines = ["## Accuracy per regime", "", *regime_markdown(regime_summary(rows)), ""]
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


def echo_calibration(tokens: int, seed: int, as_json: bool, fit: bool) -> None:
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
    import pandas as pd

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
        # A sweep's ranks.csv rows state their size, a MoE run's do not ("" here); a suite's folder has both.
        by_key: dict[tuple[str, ...], Any] = {}
        if len(ranks):
            sizes = (
                ranks["size_bytes"] if "size_bytes" in ranks.columns else pd.Series(None, index=ranks.index)
            )
            cells = ranks.assign(**{c: ranks[c].map(_cell) for c in keys}, size_key=sizes.map(_cell))
            by_key = dict(iter(cells.groupby([*keys, "size_key"], sort=False)))
        num_domains = world // per_domain
        for row in results.itertuples(index=False):
            node_mode = getattr(row, "send_mode", "") == "node"
            stage = str(row.phase).partition(":")[2]
            if node_mode and not stage:
                continue  # a node-mode phase runs as two stages in sequence: its stage rows are fitted
            key = tuple(_cell(getattr(row, c)) for c in keys)
            frame = by_key.get((*key, _cell(getattr(row, "size_bytes", None))))
            frame = by_key.get((*key, "")) if frame is None else frame
            if frame is None or len(frame) != world or not np.isfinite(row.time_us_p50):
                continue
            frame = frame.sort_values("rank")
            loads = np.zeros((world, 2, 2))
            for c, name in enumerate(("nvlink", "scaleout")):
                loads[:, c, 0] = frame[f"{name}_sent_bytes"].to_numpy(dtype=float)
                loads[:, c, 1] = frame[f"{name}_recv_bytes"].to_numpy(dtype=float)
            peers = np.zeros((world, 2, 2), dtype=np.int64)
            peers[:, 0, :] = np.where(loads[:, 0, :] > 0, per_domain - 1, 0)
            # A node-mode scale-out stage pairs the ranks of one local index: a peer on every other node.
            scaleout_peers = num_domains - 1 if node_mode else world - per_domain
            peers[:, 1, :] = np.where(loads[:, 1, :] > 0, scaleout_peers, 0)
            # A suite runs one model under several skews, and repeats its cases.
            skew, repeat = _cell(getattr(row, "skew", "")), _cell(getattr(row, "repeat", ""))
            words = (str(row.pattern), skew, str(row.phase), f"{int(row.size_bytes)} B")
            label = " ".join(w for w in words if w) + (f" repeat {repeat}" if repeat not in ("", "0") else "")
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


def echo_rack_fit(
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
