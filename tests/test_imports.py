"""The package has no import cycle, counting the imports inside functions too (a cycle hidden in a function is
still a cycle: it decides what may be imported first)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "siamesenorm"


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _edges(name, path, modules):
    """The package modules ``name`` imports anywhere in its file (``from . import x`` counts x, not the package)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            submodules = {f"{base}.{a.name}" for a in node.names} & modules.keys()
            found.update(submodules or ({base} & modules.keys()))
    return found - {name}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    modules = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    modules["p.a"].write_text("from .b import f\n")
    modules["p.b"].write_text("def f():\n    from .a import g\n")
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["siamesenorm.train"]  # the scan sees the package and its imports
    assert _cycles(graph) == []
