"""The one page renderer: sections as data rendered to Markdown and HTML, every text escaped on the way."""

from __future__ import annotations

from typing import Any

from commbench.report.pages.render import (
    Bullets,
    Code,
    Fields,
    Figure,
    FigureRow,
    Section,
    Text,
    html_page,
    markdown_page,
)
from commbench.report.pages.tables import Table

MARKUP = '<b onclick="x">&</b>'
ESCAPED = "&lt;b onclick=&quot;x&quot;&gt;&amp;&lt;/b&gt;"


class _Plot:
    """A stand-in matplotlib figure: writes fixed bytes, counts how often it was drawn."""

    calls = 0

    def savefig(self, buffer: Any, **_: Any) -> None:
        _Plot.calls += 1
        buffer.write(b"png")


def _page() -> list[Any]:
    table = Table(["name", "value"], [[f"a|b {MARKUP}", "1"], ["line\nbreak", "22"]], text_columns={0})
    return [
        Section(MARKUP, (Text(MARKUP, warning=True),), level=1, keep_empty=True),
        Section(
            f"Results {MARKUP}",
            (
                Text(" and the rest", strong=MARKUP),
                Section(f"sub {MARKUP}", (table,), level=3),
                Bullets([MARKUP, "two\nlines"]),
                Fields([(MARKUP, "value `with` ticks\nand a break")]),
                Figure(f"plot {MARKUP}", _Plot),
                FigureRow(f"row {MARKUP}", [(f"heat {MARKUP}", _Plot), ("nothing", lambda: None)]),
                Text("markdown only", only="markdown"),
                Code("keep\n  this"),
            ),
            css=f"verdict {MARKUP}",
        ),
        Section("Empty", (Figure("no plot", lambda: None),)),
        Section("Kept", (), keep_empty=True),
    ]


def test_html_escapes_every_text_and_attribute() -> None:
    page = html_page(f"title {MARKUP}", _page())
    assert MARKUP not in page and "<b onclick" not in page
    assert page.count(ESCAPED) == 15  # every title, heading, class, text, cell, item, alt and tooltip
    assert f'<h2 class="verdict {ESCAPED}">Results {ESCAPED}</h2>' in page
    assert f"<p><b>{ESCAPED}</b> and the rest</p>" in page  # the page's own bold, the text escaped
    assert f'<img alt="plot {ESCAPED}" src="data:image/png;base64,cG5n">' in page
    assert f'title="heat {ESCAPED}"' in page and "nothing" not in page  # a build that gave no figure
    assert "markdown only" not in page and "<pre>keep\n  this</pre>" in page
    assert "Empty" not in page and "<h2>Kept</h2>" in page  # a section with nothing to show is left out


def test_markdown_keeps_rows_and_lines_whole_and_shows_no_figure() -> None:
    _Plot.calls = 0
    page = markdown_page(_page())
    assert _Plot.calls == 0  # figures are drawn for the HTML page alone
    lines = page.splitlines()
    assert lines[0] == f"# {MARKUP}" and f"**{MARKUP}**" in lines
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 4 and {line.count("|") - line.count("\\|") for line in table} == {3}
    assert "a\\|b" in table[2] and "line break" in table[3]
    assert f"**{MARKUP}** and the rest" in lines
    assert "- two lines" in lines and f"- {MARKUP}: `value 'with' ticks and a break`" in lines
    assert "plot" not in page and "heat" not in page and "Empty" not in page
    assert "markdown only" in lines and "## Kept" in lines
    assert "```\nkeep\n  this\n```" in page
