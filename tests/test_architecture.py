"""The package's shape: stages import only from earlier ones; modules stay small and say what they are for."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "commbench"
# Data flows down this list; a module may import its own stage or an earlier one, never a later one.
STAGES = ("errors", "plain", "hardware", "inputs", "traffic", "fabric", "run", "backends", "report", "cli")
MAX_LINES = 520  # "no module over ~500 lines"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "commbench" or len(parts) < 2:
        return None
    name = parts[1]
    return STAGES.index(name) if name in STAGES else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str) -> set[str]:
    """Every commbench module named by an import statement, lazy (inside functions) ones included."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.split(".")[: -node.level] if not module.endswith("__init__") else module
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("commbench.")}


def test_every_stage_is_known():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    assert (folders | modules) <= set(STAGES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_down_the_stages(path):
    module = _module_name(path)
    own = _stage(module)
    if own is None:  # commbench/__init__.py, __main__.py: the package root may import anything
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    later = sorted(name for name in _imports(tree, module) if (_stage(name) or 0) > own)
    assert not later, f"{module} (stage {STAGES[own]}) imports later stages: {later}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small_and_says_what_it_is_for(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: {len(text.splitlines())} lines"
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring and len(docstring.splitlines()[0]) > 10, f"{path.name}: no first-line docstring"
