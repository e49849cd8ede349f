"""Load a port's worker file together with the sibling files it imports.

A worker imports its verify input class and its helpers from files beside it
(`from sglang.srt.speculative.dflash_info import DFlashVerifyInput`). Loaded
alone, those imports would reach the installed SGLang's files, not the port's:
the port would be judged on someone else's code. `load_port_files` loads the
siblings the entry file reaches (transitively, those of the port's lineage:
a fork's copies of SGLang's other files stay the installed SGLang's) from the user's checkout, in
dependency order, and while each runs makes the checkout's module answer to
the dotted name the worker imports it by. The aliases are removed afterwards:
nothing of the checkout stays importable by name.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.ports.loading import LoadedPort, load_port_module
from harness.ports.protocol import PortError


@dataclass(frozen=True)
class PortFiles:
    """The checkout's modules ddcheck loaded, by file stem, entry file last."""

    modules: tuple[tuple[str, LoadedPort], ...]
    aliases: tuple[tuple[str, str], ...]          # (stem, the dotted name the port imports it by)

    def __post_init__(self) -> None:
        if not self.modules:
            raise ValueError("PortFiles needs at least the entry file")

    def __getitem__(self, stem: str) -> LoadedPort:
        for name, loaded in self.modules:
            if name == stem:
                return loaded
        raise KeyError(stem)

    @property
    def stubbed(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for _, m in self.modules for s in m.stubbed))


def sibling_imports(path: Path, lineage: str = "") -> dict[str, str]:
    """{stem: dotted name} of the files beside `path` that it imports (parsed, not run); lineage:
    only files whose name starts so (the port's own files, not the fork's copies of SGLang's)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError) as e:
        raise PortError(f"{path} cannot be parsed: {e}".splitlines()[0]) from None
    beside = {p.stem for p in path.parent.glob("*.py") if p.stem.startswith(lineage)} - {path.stem}
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            stem = node.module.split(".")[-1]
            if stem in beside:
                found.setdefault(stem, node.module)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[-1] in beside:
                    found.setdefault(a.name.split(".")[-1], a.name)
    return found


def _load_order(entry: Path, lineage: str) -> list[tuple[str, str]]:
    """(stem, dotted name) of every sibling the entry reaches, dependencies first, entry last."""
    order: list[tuple[str, str]] = []
    visiting: set[str] = set()

    def visit(stem: str, dotted: str) -> None:
        if stem in visiting or any(s == stem for s, _ in order):
            return   # an import cycle: the file already being loaded answers as far as it got
        visiting.add(stem)
        for dep, dep_name in sibling_imports(entry.parent / f"{stem}.py", lineage).items():
            visit(dep, dep_name)
        order.append((stem, dotted))

    visit(entry.stem, entry.stem)
    return order


def load_port_files(entry: Path, lineage: str = "") -> PortFiles:
    """The entry file and the siblings it imports whose names start with `lineage` (the port's
    own files; a fork's copies of SGLang's other files stay the installed SGLang's), all from
    the user's checkout."""
    entry = Path(entry)
    if not entry.is_file():
        raise PortError(f"port file {entry} does not exist")
    order = _load_order(entry, lineage)
    saved: dict[str, object] = {}
    loaded: list[tuple[str, LoadedPort]] = []
    try:
        for stem, dotted in order:
            port = load_port_module(entry.parent / f"{stem}.py")
            loaded.append((stem, port))
            if stem != entry.stem:
                saved.setdefault(dotted, sys.modules.get(dotted))
                sys.modules[dotted] = port.module    # later files import the checkout's copy by this name
    finally:
        for dotted, before in saved.items():
            if before is None:
                sys.modules.pop(dotted, None)
            else:
                sys.modules[dotted] = before
    return PortFiles(tuple(loaded), tuple((s, d) for s, d in order if s != entry.stem))
