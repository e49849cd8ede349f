"""Which of a port's functions its worker calls: the deployed path.

A port file keeps helpers its server no longer runs (a lineage that moved its
verify path to other functions keeps the old ones, marked legacy). Driving
such a helper judges code that never runs in a deployment: a false alarm or
a false pass. So the adapter reads the worker side of the checkout (every
other Python file beside the port that imports from it) and ddcheck drives a
stage only through a function the worker side names. Nothing is imported or
run: the files are parsed.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerCalls:
    module: str                     # the port's module name, e.g. ddtree_utils
    files: tuple[str, ...]          # the worker-side files that import from it (names, beside the port)
    names: frozenset[str]           # every name of the port they import or reach as module.attribute

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError("WorkerCalls needs at least one worker-side file")

    def unused(self, functions: dict[str, str], stages: tuple[str, ...]) -> dict[str, str]:
        """{stage: function} for the stages whose function the worker side never names."""
        return {s: functions[s] for s in stages if s in functions and functions[s] not in self.names}

    def sentence(self) -> str:
        called = ", ".join(sorted(self.names)) or "nothing"
        return f"its worker side ({', '.join(self.files)}) calls {called} from {self.module}"


def _names_from(tree: ast.AST, module: str) -> set[str] | None:
    """Names of `module` one parsed file imports or reaches (None: it does not import it)."""
    found: set[str] = set()
    aliases: set[str] = set()
    imports = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == module:
            imports = True
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and any(a.name == module for a in node.names):
            imports = True
            aliases.update(a.asname or a.name for a in node.names if a.name == module)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[-1] == module:
                    imports = True
                    aliases.add(a.asname or a.name)
    if not imports:
        return None
    for node in ast.walk(tree):   # module.function, through whatever name the module was bound to
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases:
            found.add(node.attr)
    return found


def worker_calls(port_file: Path) -> WorkerCalls | None:
    """What the files beside `port_file` call from it; None when none imports it (a
    port file on its own: there is no worker to consult)."""
    module = port_file.stem
    files, names = [], set()
    for other in sorted(port_file.parent.glob("*.py")):
        if other.resolve() == port_file.resolve():
            continue
        try:
            tree = ast.parse(other.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue   # a file the worker side cannot be read from says nothing
        got = _names_from(tree, module)
        if got is not None:
            files.append(other.name)
            names |= got
    return WorkerCalls(module, tuple(files), frozenset(names)) if files else None
