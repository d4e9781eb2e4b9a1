"""The report package's lazy facade: its three listings of the public names (the type checkers' imports, the
first-use table, ``__all__``) name the same objects, each from the module it lives in."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

import commbench.report as report


def _type_checking_imports() -> dict[str, str]:
    """name -> module of every import under the package's ``if TYPE_CHECKING:``."""
    tree = ast.parse(inspect.getsource(report))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module
                for alias in statement.names:
                    found[alias.asname or alias.name] = statement.module
    return found


def test_the_three_listings_agree_and_resolve() -> None:
    where = report._WHERE
    assert _type_checking_imports() == where
    assert sorted(report.__all__) == sorted(where) and len(set(report.__all__)) == len(report.__all__)
    for name, module in where.items():
        assert getattr(report, name) is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        report.no_such_name  # noqa: B018
