"""The oracle (reference/) and the system under test (harness/) share no code.

Both may import ddschema; neither may import the other. Checked on the
source with `ast`, so nothing is executed and lazy imports count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in a file under ROOT.

    Relative imports are resolved against the file's package, so that
    `from ..harness import x` inside reference/ reads as `harness`."""
    package = list(path.relative_to(ROOT).parent.parts)  # e.g. ["reference"]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            parts = base + ([node.module] if node.module else [])
            if not node.module:  # `from . import a, b` imports submodules a, b
                found += [(node.lineno, ".".join(base + [a.name])) for a in node.names]
            else:
                found.append((node.lineno, ".".join(parts)))
    return found


def offending_imports(package: str, forbidden: str) -> list[str]:
    """'file:line module' for every import of `forbidden` under ROOT/package."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module == forbidden or module.startswith(forbidden + "."):
                bad.append(f"{path.relative_to(ROOT)}:{line} {module}")
    return bad


def test_reference_has_python_files():
    assert list((ROOT / "reference").rglob("*.py"))


def test_reference_does_not_import_harness():
    assert offending_imports("reference", "harness") == []


def test_harness_does_not_import_reference():
    if not (ROOT / "harness").is_dir():
        pytest.skip("no harness/ yet")
    assert offending_imports("harness", "reference") == []


def test_reference_imports_only_torch_stdlib_ddschema_and_itself():
    allowed = {"torch", "ddschema", "reference", "__future__", "math", "typing",
               "dataclasses", "collections", "itertools", "functools", "json", "struct", "pathlib",
               "concurrent", "threading", "os"}   # the streamed oracle reads the next layer on a thread (os: positional reads)
    for path in sorted((ROOT / "reference").rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            assert top in allowed, f"{path.name}:{line} imports {module}"


@pytest.mark.parametrize("source,caught", [
    ("import harness\n", True),
    ("import harness.engine.attn as a\n", True),
    ("from harness.runner import run\n", True),
    ("from .. import harness\n", True),
    ("from ..harness.ddtree import x\n", True),
    ("def f():\n    import harness\n", True),
    ("import harnesses\nfrom . import model\nfrom ddschema import Oracle\n", False),
])
def test_checker_catches_imports(tmp_path, monkeypatch, source, caught):
    """The checker itself, on a throwaway tree: it must see every spelling."""
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "bad.py").write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert bool(offending_imports("reference", "harness")) == caught


def names_imported_from(path: Path, module: str) -> list[str]:
    """'file:line name' for every `from module import name` in a file."""
    return [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) and node.module == module for a in node.names]


def test_the_checks_yardsticks_read_a_mask_themselves_not_with_the_engines_reading():
    """A mutant of the engine's mask reading (mask.kernel_visible) made the float64 stand-in and the audits read
    masks wrong alike (issue 21): they write SGLang's rule (nonzero = visible) themselves."""
    yardsticks = [ROOT / "harness" / "engine" / "attn" / "exact.py", *sorted((ROOT / "harness" / "check").rglob("*.py"))]
    shared = [hit for path in yardsticks for hit in names_imported_from(path, "harness.engine.ddtree.mask")
              if hit.endswith(" kernel_visible")]
    assert shared == []
