"""``commbench report``: re-render a saved report folder from its CSVs and meta.json, and print its table."""

from __future__ import annotations

import click


@click.command()
@click.argument("report_dir", type=click.Path(file_okay=False))
def report(report_dir: str) -> None:
    """Re-render a saved report folder (results.parquet, results.json, summary.md, report.html) from its
    results.csv, ranks.csv and meta.json, and print the table.

    Every file is checked first: a folder whose files are cut or malformed is refused with one line naming
    the file (exit 2), and nothing in it changes. results.csv, ranks.csv and meta.json are never rewritten.
    A run that was stopped is re-rendered and said to be INCOMPLETE. The pages open with the folder's own
    verdict.json (never rewritten), whose line is printed last; a folder without one says it has no
    verdict. A run no process of which got to finish its report (killed whole: no verdict.json, no
    INCOMPLETE mark) is rendered INCOMPLETE and judged now: its verdict.json and junit.xml are written,
    meta.json is not."""
    from commbench.cli.acceptance import unfinished_judge
    from commbench.report import render_report, results_table
    from commbench.report.judge.verdict import console_line

    frame = render_report(report_dir, unfinished_judge)
    incomplete = frame.attrs.get("incomplete")
    if incomplete:
        click.echo(f"# INCOMPLETE: {incomplete}; only the phases that finished are below")
    click.echo(results_table(frame))
    state = f" (INCOMPLETE run: {incomplete})" if incomplete else ""
    click.echo(f"commbench: re-rendered {report_dir}{state}")
    verdict = frame.attrs.get("verdict")
    if verdict is not None:  # the folder's own verdict, last (a stopped run's says INCOMPLETE or FAIL)
        click.echo(console_line(verdict, report_dir))
