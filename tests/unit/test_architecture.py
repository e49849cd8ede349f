"""The folder tree is the architecture (docs/ARCHITECTURE.md): layers import
only downward, and no module imports itself back through others.

Every import counts, a function's deferred one included: a deferred import
from a lower layer up is still an upward dependency."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# bottom to top; a package may import its own modules and any package of a lower layer
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ddschema",),
    ("harness.verdict",),
    ("harness.engine",),
    ("harness.ports", "harness.faults"),
    ("harness.check",),
    ("harness.report",),
    ("harness.workflows",),
    ("harness.cli",),
    ("harness.__main__",),
)
TOP_PACKAGES = ("harness", "ddschema", "reference")


def _modules() -> dict[str, Path]:
    out = {}
    for top in TOP_PACKAGES:
        for f in (ROOT / top).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (from X import y: X.y when y is a module)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def layer_of(module: str) -> tuple[int, str] | None:
    for i, packages in enumerate(LAYERS):
        for p in packages:
            if module == p or module.startswith(p + "."):
                return i, p
    return None


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dsts in edges.items():
        ls = layer_of(src)
        for dst in dsts:
            ld = layer_of(dst)
            if ls is None or ld is None or ls[1] == ld[1]:
                continue
            if ld[0] >= ls[0]:
                bad.append(f"{src} -> {dst}")
    return sorted(bad)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def edges():
    return import_edges(_modules())


def test_no_import_circle(edges):
    assert circles(edges) == []


def test_no_import_from_a_lower_layer_up(edges):
    assert upward_imports(edges) == []


def test_every_harness_module_has_a_layer(edges):
    assert [m for m in edges if m.startswith("harness.") and layer_of(m) is None] == []


def test_no_loose_module_directly_under_harness():
    loose = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]


def test_the_oracle_imports_nothing_of_the_harness(edges):
    assert [f"{s} -> {d}" for s, d in sorted((s, d) for s, ds in edges.items() for d in ds)
            if s.startswith(("reference", "ddschema")) and d.startswith("harness")] == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """The detectors themselves: a planted circle and a planted upward import are found."""
    planted = {"harness.engine.a": {"harness.engine.b"}, "harness.engine.b": {"harness.engine.a"},
               "harness.engine.c": {"harness.check.x"}, "harness.check.x": set()}
    assert circles(planted) == [["harness.engine.a", "harness.engine.b"]]
    assert upward_imports(planted) == ["harness.engine.c -> harness.check.x"]
