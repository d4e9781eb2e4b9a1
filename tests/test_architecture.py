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


def _graph() -> dict[str, set[str]]:
    """module -> the commbench modules it imports (lazy and type-only imports included: a circle hidden by
    them is still a circle), each import resolved to the module it names (a name imported from a package is
    the package's __init__)."""
    names = {_module_name(path): path for path in MODULES}
    graph = {}
    for module, path in names.items():
        found = _imports(ast.parse(path.read_text(encoding="utf-8")), module)
        graph[module] = {name for name in found if name in names and name != module}
        # "from commbench.x import name": name is a module when it is one, else x itself is imported.
        graph[module] = {
            name
            for name in graph[module]
            if not any(other != name and other.startswith(name + ".") for other in graph[module])
            or name not in {n.rsplit(".", 1)[0] for n in graph[module]}
        }
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere_even_inside_a_stage():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small_and_says_what_it_is_for(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: {len(text.splitlines())} lines"
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring and len(docstring.splitlines()[0]) > 10, f"{path.name}: no first-line docstring"
