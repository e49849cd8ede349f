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
# each harness module's docstring ends by saying its layer and what it may not import
LAYER_SENTENCES = {
    "harness.verdict": "Layer: verdict. Imports nothing of harness.",
    "harness.engine": "Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,\n"
                      "workflows or cli.",
    "harness.ports": "Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli.",
    "harness.faults": "Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli.",
    "harness.check": "Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli.",
    "harness.report": "Layer: report. Imports the check and below; never workflows or cli.",
    "harness.workflows": "Layer: workflows. Imports report, the check and below; never cli.",
    "harness.cli": "Layer: cli. Imports any layer below it.",
    "harness.__main__": "Layer: entry point. Imports the cli.",
}


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


def test_every_module_says_its_layer(edges):
    """The docstring's layer line matches the table the imports are held to."""
    missing = []
    for m in sorted(edges):
        layer = layer_of(m)
        if m.startswith("harness") and layer is not None:
            doc = ast.get_docstring(ast.parse(_modules()[m].read_text(encoding="utf-8"))) or ""
            if LAYER_SENTENCES[layer[1]] not in doc:
                missing.append(m)
    assert missing == []


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
