"""``commbench baseline`` (per-case median and spread of known-good runs) and ``commbench compare`` (two
runs, or a baseline and a run, side by side)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from commbench.cli.options import finite_float
from commbench.errors import UsageError


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR [RUN_DIR...]")
@click.option("--out", required=True, metavar="FILE", help="The baseline JSON file to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists (refused otherwise).")
def baseline(run_dirs: tuple[str, ...], out: str, force: bool) -> None:
    """Make a baseline from one or more known-good report folders: per case (pattern, phase, model, skew,
    tokens, send mode, size of the balanced all-to-all, backend, ranks, knobs, check mode, timing) the median,
    min, max, MAD and robust run-to-run spread (3 scaled MADs, in % of the median) of the time p50, busbw and
    algbw over every run's repeats; not a mean, so one bad run does not skew it.

    Each folder is read with checks (CSV and JSON only); a folder that is INCOMPLETE, has #wrong > 0, or is
    not a report is refused with one line (exit 2) and nothing is written. Use 3 or more runs: with one the
    spread is unknown, with two it is wide. The file is written atomically.

    \b
    Example:
      commbench baseline reports/good1 reports/good2 reports/good3 --out rack-a.baseline.json
    """
    from commbench.report.judge.baseline import build_baseline, check_out_file, read_runs, write_baseline
    from commbench.report.pages.tables import fmt_time, format_bandwidth, format_table

    path = check_out_file(out, force)
    runs = read_runs(run_dirs, known_good=True)
    made = build_baseline(runs)
    rows = []
    for entry in made["cases"]:
        time, busbw = entry["figures"]["time_us"], entry["figures"]["busbw_GBps"]
        spread = busbw.get("spread_pct") if (busbw.get("median") or 0) > 0 else time.get("spread_pct")
        rows.append(
            [
                entry["label"],
                str(entry["runs"]),
                str(entry["repeats"]),
                fmt_time(time["median"]),
                fmt_time(time["min"]),
                fmt_time(time["max"]),
                format_bandwidth(busbw["median"]),
                "unknown" if spread is None else f"+-{spread:.1f}%",
            ]
        )
    headers = ["case", "runs", "repeats", "time p50(us)", "min", "max", "busbw(GB/s)", "busbw spread"]
    click.echo(format_table(headers, rows, "text", text_columns={0}))
    write_baseline(made, path)
    click.echo(f"commbench: baseline of {len(rows)} case(s) from {len(runs)} run(s) written to {path}")


@click.command()
@click.argument("run_a", metavar="RUN_A|BASELINE")
@click.argument("run_b", metavar="RUN_B")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines instead of Markdown.")
@click.option(
    "--warn-pct",
    type=finite_float(min=0),
    default=5.0,
    show_default=True,
    help="Against a BASELINE file: WARN when a case is more than this % worse than the baseline median.",
)
@click.option(
    "--fail-pct",
    type=finite_float(min=0),
    default=10.0,
    show_default=True,
    help="Against a BASELINE file: FAIL when a case is more than this % worse than the baseline median.",
)
def compare(run_a: str, run_b: str, as_json: bool, warn_pct: float, fail_pct: float) -> None:
    """Compare two report folders case by case: time p50 and busbw of A and B, the difference of B against
    A in %, and whether it is beyond the spread (the windows' spread when both runs repeated the case, else
    the timed iterations' [min, p99] in each run: then the run-to-run spread is unknown and the output says
    so). Cases only one run has are listed. Markdown on stdout, --json for machines; exit 0.

    With a baseline file (from 'commbench baseline') as the first argument, each case of RUN_B gets PASS,
    WARN or FAIL: more than --warn-pct / --fail-pct worse than the baseline median AND beyond the baseline's
    run-to-run spread (a drop inside the spread is PASS, "within run-to-run spread"). Exit 1 when a case
    FAILs, else 0.

    Bad input (a missing folder, not a report, a malformed file, no common case): one line, exit 2.

    \b
    Examples:
      commbench compare reports/before reports/after
      commbench compare rack-a.baseline.json reports/today --json
    """
    from commbench.plain import plain
    from commbench.report.judge.baseline import read_baseline, read_run
    from commbench.report.judge.compare import (
        compare_runs,
        compare_to_baseline,
        comparison_markdown,
        findings_markdown,
    )

    if warn_pct > fail_pct:
        raise UsageError(f"--warn-pct {warn_pct:g} is above --fail-pct {fail_pct:g}; give warn <= fail")
    if Path(run_a).is_file():
        known = read_baseline(run_a)
        run = read_run(run_b)
        findings = compare_to_baseline(run.frame, known, warn_pct, fail_pct)
        if all(finding.status == "SKIP" for finding in findings):
            raise UsageError(
                f"{run_b} has no case the baseline {run_a} has (a case: pattern, phase, skew, tokens, size, "
                "backend, ranks, knobs, check); run the same cases as the baseline runs"
            )
        counts = {s: sum(f.status == s for f in findings) for s in ("PASS", "WARN", "FAIL", "SKIP")}
        overall = "FAIL" if counts["FAIL"] else "WARN" if counts["WARN"] else "PASS"
        if as_json:
            document = {
                "schema": "commbench.baseline-check/1",
                "baseline": run_a,
                "run": run_b,
                "status": overall,
                "warn_pct": warn_pct,
                "fail_pct": fail_pct,
                "counts": counts,
                "findings": [finding.as_dict() for finding in findings],
            }
            click.echo(json.dumps(plain(document), indent=2))
        else:
            click.echo(f"# commbench compare: {run_b} against baseline {run_a}\n")
            click.echo(findings_markdown(findings))
            summary = ", ".join(f"{count} {status}" for status, count in counts.items() if count)
            wide = sum(f.spread_pct is not None and f.spread_pct > fail_pct for f in findings)
            if wide:
                click.echo(
                    f"\nNote: {wide} case(s) have a baseline spread wider than --fail-pct {fail_pct:g}%: "
                    "a drop that large cannot be told from noise there; rebuild the baseline from quieter "
                    "runs (more iterations, an idle machine)"
                )
            click.echo(
                f"\n{overall} ({summary}); WARN/FAIL: more than {warn_pct:g}% / {fail_pct:g}% worse than "
                "the baseline median and beyond its run-to-run spread"
            )
        if overall == "FAIL":
            click.get_current_context().exit(1)
        return
    comparison = compare_runs(read_run(run_a), read_run(run_b))
    if not comparison["cases"]:
        a, b = comparison["a"], comparison["b"]
        raise UsageError(
            f"{run_a} and {run_b} have no case in common (A: backend {a['backend']}, {a['world_size']} "
            f"ranks; B: backend {b['backend']}, {b['world_size']} ranks; a case: pattern, phase, skew, "
            "tokens, size, backend, ranks, knobs, check); compare runs of the same cases"
        )
    if as_json:
        click.echo(json.dumps(comparison, indent=2))
    else:
        click.echo(comparison_markdown(comparison), nl=False)
