"""``commbench backends``: every backend (built-in, adapter, plug-in), its origin, whether it runs here.

Each backend's class is imported (lazily, one at a time) and its ``check_available`` asked; a plug-in that
does not import, or is not a Backend, is listed unavailable with the reason, never an error of the command.
A plug-in refused for its name (a built-in's, or another package's) is listed too, saying so.
"""

from __future__ import annotations

import json
from typing import Any

import click

from commbench.backends import (
    DISCOVERY_ERROR,
    ENTRIES,
    ENTRY_POINT_GROUP,
    REFUSED,
    BackendEntry,
    availability,
    load_backend,
)

HEADERS = ("backend", "from", "moves data", "available", "knobs", "why not")


def _knobs(backend_class: type | None) -> list[dict[str, Any]]:
    options = getattr(backend_class, "OPTIONS", ()) if backend_class is not None else ()
    return [
        {
            "name": option.name,
            "type": option.type.__name__,
            "default": option.default,
            "choices": list(option.choices),
            "minimum": option.minimum,
            "maximum": option.maximum,
            "help": option.help,
        }
        for option in options
    ]


def describe(entry: BackendEntry) -> dict[str, Any]:
    """One backend as the listing shows it (its class loaded and its availability checked here)."""
    if entry.refused:
        backend_class, available, reason = None, False, f"refused: {entry.refused}"
    else:
        backend_class, _ = load_backend(entry.name)
        available, reason = availability(entry.name)
    library = getattr(backend_class, "DISPLAY", "") if entry.builtin else ""
    return {
        "name": entry.name,
        "source": f"built-in adapter ({library})" if library else entry.source,
        "builtin": entry.builtin,
        "package": entry.package or None,
        "version": entry.version or None,
        "target": entry.target,
        "moves_data": None if backend_class is None else bool(backend_class.moves_data),
        "emulated": None if backend_class is None else bool(backend_class.emulated),
        "available": available,
        "reason": reason or None,
        "library_api": getattr(backend_class, "API_VERSION", None) or None,
        "knobs": _knobs(backend_class),
    }


def listing() -> list[dict[str, Any]]:
    """Every registered backend, then the refused plug-ins."""
    return [describe(entry) for entry in (*ENTRIES.values(), *REFUSED)]


def _knob_cell(knobs: list[dict[str, Any]]) -> str:
    """The knob names (their defaults, types and ranges are in --json and --help of run)."""
    return " ".join(knob["name"] for knob in knobs)


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def render(backends: list[dict[str, Any]]) -> str:
    rows = [
        (
            item["name"],
            item["source"],
            _yes_no(item["moves_data"]),
            _yes_no(item["available"]),
            _knob_cell(item["knobs"]) or "-",
            item["reason"] or "",
        )
        for item in backends
    ]
    from commbench.report.pages.tables import format_table  # pandas: not for --help

    return format_table(HEADERS, rows, text_columns=range(len(HEADERS)))


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON instead of a table.")
def backends(as_json: bool) -> None:
    """List every backend: built-in ones, the library adapters and plug-ins other packages register under the
    entry point group commbench.backends; whether each moves data, whether it can run on this host (and why
    not), and its knobs (--backend-option KEY=VALUE). See docs/plugins.md."""
    items = listing()
    if as_json:
        document = {"entry_point_group": ENTRY_POINT_GROUP, "discovery_error": DISCOVERY_ERROR or None}
        from commbench.plain import plain

        click.echo(json.dumps(plain({**document, "backends": items}), indent=2))
        return
    click.echo(render(items))
    if DISCOVERY_ERROR:
        click.echo(f"commbench: plug-ins not listed: {DISCOVERY_ERROR}", err=True)
