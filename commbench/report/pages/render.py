"""The one renderer of the report's pages: a page is a list of ``Section`` (data), rendered to summary.md and
to report.html here and nowhere else.

A section holds a title and blocks: ``Text`` (a paragraph), ``Table`` (``report.pages.tables``: headers and
cells as text), ``Figure`` / ``FigureRow`` (a matplotlib figure built on demand), ``Bullets``, ``Fields``
(item: value lines), ``Code`` (preformatted) and sub-sections. No block holds markup: every text is escaped
when it is written (HTML: ``html.escape`` of every title, paragraph, cell and attribute; Markdown: the
characters that break a table row or a line, ``|`` and line breaks, neutralised), and figures become PNG
data URLs here, so text read from a folder (a model name, a CSV cell, meta.json) can never become markup.
A block with ``only`` set is shown on that page alone (the heatmaps are HTML, the "see pairs.csv" line is
Markdown); a section with nothing to show on a page is left out of it unless ``keep_empty``.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from commbench.report.pages.tables import Table, markdown_text

Page = Literal["markdown", "html"]
PNG_URL = "data:image/png;base64,"


@dataclass(frozen=True)
class Text:
    """A paragraph: ``strong`` (bold) then ``text``; ``warning`` shows the whole paragraph as a warning (bold
    in Markdown, red in HTML)."""

    text: str
    strong: str = ""
    warning: bool = False
    only: Page | None = None


@dataclass(frozen=True)
class Figure:
    """A plot under its own heading: ``build`` returns a matplotlib figure, or None (nothing to plot); it is
    called once, when the HTML page is rendered (Markdown shows no figures)."""

    title: str
    build: Callable[[], Any]


@dataclass(frozen=True)
class FigureRow:
    """Plots side by side under one heading (the pairwise heatmaps): (title, build) per plot."""

    title: str
    figures: Sequence[tuple[str, Callable[[], Any]]]


@dataclass(frozen=True)
class Bullets:
    """A list, one item a line."""

    items: Sequence[str]
    only: Page | None = None


@dataclass(frozen=True)
class Fields:
    """(item, value) lines: Markdown "- item: `value`", HTML a two-column table."""

    items: Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Code:
    """Preformatted text (line breaks kept)."""

    text: str


@dataclass(frozen=True)
class Section:
    """A heading (``level`` 1-4; ``css``: the HTML heading's class) and its blocks, in order."""

    title: str
    blocks: Sequence[Block] = field(default_factory=tuple)
    level: int = 2
    css: str = ""
    keep_empty: bool = False


Block = Text | Table | Figure | FigureRow | Bullets | Fields | Code | Section


# ----------------------------------------------------------------------------------------------------------
# Markdown


def markdown_page(blocks: Sequence[Block]) -> str:
    """A page (its sections and blocks, in order) as Markdown (summary.md)."""
    lines: list[str] = []
    for block in blocks:
        lines += _markdown_block(block)
    return "\n".join(lines) + "\n"


def _markdown_section(section: Section) -> list[str]:
    body: list[str] = []
    for block in section.blocks:
        body += _markdown_block(block)
    if not body and not section.keep_empty:
        return []
    return [f"{'#' * section.level} {markdown_text(section.title)}", "", *body]


def _markdown_block(block: Block) -> list[str]:
    if getattr(block, "only", None) == "html":
        return []
    if isinstance(block, Section):
        return _markdown_section(block)
    if isinstance(block, Text):
        text = markdown_text(block.text)
        if block.warning:
            return [f"**{text}**", ""]
        return [(f"**{markdown_text(block.strong)}**" if block.strong else "") + text, ""]
    if isinstance(block, Table):
        return [block.markdown(), ""]
    if isinstance(block, Bullets):
        return ["\n".join(f"- {markdown_text(item)}" for item in block.items), ""]
    if isinstance(block, Fields):
        return [f"- {markdown_text(key)}: `{_code_span(value)}`" for key, value in block.items] + [""]
    if isinstance(block, Code):
        return ["```", block.text.replace("```", "'''"), "```"]
    return []  # figures: HTML only


def _code_span(value: str) -> str:
    """Text for inside a Markdown code span: one line, no backtick to close it early."""
    return markdown_text(value).replace("`", "'")


# ----------------------------------------------------------------------------------------------------------
# HTML

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: 1em; white-space: pre-wrap; }
.warning { color: #a00; font-weight: bold; }
img { max-width: 100%; }
.wide { max-width: 100%; overflow-x: auto; }
.wide table { font-size: 0.8em; }
.wide th, .wide td { padding: 0.2em 0.4em; }
.verdict.PASS { color: #060; } .verdict.WARN { color: #a60; }
.verdict.FAIL, .verdict.stopped { color: #a00; }
.wide td { white-space: nowrap; }
.heatmaps { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.heatmaps img { max-width: 32%; min-width: 420px; }
"""


def html_page(title: str, blocks: Sequence[Block]) -> str:
    """A page (its sections and blocks, in order) as one self-contained HTML page (report.html), titled
    ``title``; plots embedded as PNG data URLs."""
    body: list[str] = []
    for block in blocks:
        body += _html_block(block)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
        f"<style>{_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html_section(section: Section) -> list[str]:
    body: list[str] = []
    for block in section.blocks:
        body += _html_block(block)
    if not body and not section.keep_empty:
        return []
    level = min(max(section.level, 1), 6)
    css = f' class="{_esc(section.css)}"' if section.css else ""
    return [f"<h{level}{css}>{_esc(section.title)}</h{level}>", *body]


def _html_block(block: Block) -> list[str]:
    if getattr(block, "only", None) == "markdown":
        return []
    if isinstance(block, Section):
        return _html_section(block)
    if isinstance(block, Text):
        css = ' class="warning"' if block.warning else ""
        strong = f"<b>{_esc(block.strong)}</b>" if block.strong else ""
        return [f"<p{css}>{strong}{_esc(block.text)}</p>"]
    if isinstance(block, Table):
        return [f'<div class="wide">{block.html()}</div>' if block.wide else block.html()]
    if isinstance(block, Bullets):
        return ["<ul>" + "".join(f"<li>{_esc(item)}</li>" for item in block.items) + "</ul>"]
    if isinstance(block, Fields):
        return [Table(("item", "value"), [list(item) for item in block.items], (0, 1)).html()]
    if isinstance(block, Code):
        return [f"<pre>{_esc(block.text)}</pre>"]
    if isinstance(block, Figure):
        png = figure_png(block.build())
        if png is None:
            return []
        return [f'<h3>{_esc(block.title)}</h3><img alt="{_esc(block.title)}" src="{PNG_URL}{png}">']
    if isinstance(block, FigureRow):
        images = []
        for title, build in block.figures:
            png = figure_png(build())
            if png is not None:
                images.append(
                    f'<img class="heatmap" alt="heatmap: {_esc(title)}" title="{_esc(title)}" '
                    f'src="{PNG_URL}{png}">'
                )
        if not images:
            return []
        return [f"<h3>{_esc(block.title)}</h3>", '<div class="heatmaps">', *images, "</div>"]
    raise TypeError(f"not a page block: {type(block).__name__}")


def figure_png(figure: Any) -> str | None:
    """A matplotlib figure as base64 PNG (the data URL's payload); None for no figure."""
    if figure is None:
        return None
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
