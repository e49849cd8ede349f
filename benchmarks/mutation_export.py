"""Mutants carried to a machine without cosmic-ray (benchmarks/mutation_engine.py --export / --from): each
sampled mutant as its unified diff against the tree it was cut from, written as JSON, and applied there by
plain Python (no `patch` binary): every hunk's context and removed lines must match the file exactly where
the hunk says, and the module must hash as it did when exported. Pure: strings and JSON, no processes."""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mutation_judging import Mutant

FORMAT = 1
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def unified_diff(module: str, before: str, after: str, context: int = 3) -> str:
    """The mutant as a unified diff of MODULE (what --export carries and the results rows show)."""
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), module, module, n=context))


def apply_unified_diff(text: str, diff: str, reanchor: bool = False) -> str:
    """TEXT with DIFF's hunks applied; ValueError where a hunk's context or removed lines are not TEXT's at the
    line the hunk names (no fuzz: a diff for another revision of the file is refused, never misapplied).
    reanchor: a hunk whose lines moved (the file changed elsewhere since the export) is applied where its
    context and removed lines stand now, when they stand in exactly one place; refused otherwise."""
    src = text.splitlines(True)
    out: list[str] = []
    at = 0   # the next source line (0-based) not yet copied
    for start, count, body in _hunks(diff):
        old = [b for tag, b in body if tag in (" ", "-")]
        begin = start - 1 if count else start   # a pure insertion names the line it follows
        if reanchor and old and src[begin:begin + len(old)] != old:
            begin = _anchor(src, old, at, start)
        if begin < at:
            raise ValueError(f"hunk at line {start} overlaps the one before it")
        out += src[at:begin]
        at = begin
        for tag, body_line in body:
            if tag in (" ", "-"):
                if at >= len(src) or src[at] != body_line:
                    got = src[at] if at < len(src) else "end of file"
                    raise ValueError(f"line {at + 1}: the diff expects {body_line!r}, the file has {got!r}")
                if tag == " ":
                    out.append(body_line)
                at += 1
            else:
                out.append(body_line)
    return "".join(out + src[at:])


def _anchor(src: list[str], old: list[str], at: int, start: int) -> int:
    """The one line (0-based, from AT on) where the hunk's old lines stand in SRC; ValueError: none, or several."""
    found = [i for i in range(at, len(src) - len(old) + 1) if src[i:i + len(old)] == old]
    if len(found) != 1:
        raise ValueError(f"hunk at line {start}: its lines stand {'nowhere' if not found else f'{len(found)} times'} "
                         "in the file now")
    return found[0]


def _hunks(diff: str) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """(start, count, [(tag, line)]) of each hunk of DIFF: tag " " (context), "-" (removed) or "+" (added)."""
    lines = diff.splitlines(True)
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1   # the --- / +++ header
    if i == len(lines):
        raise ValueError("no hunk in the diff")
    hunks = []
    while i < len(lines):
        m = HUNK.match(lines[i])
        if m is None:
            raise ValueError(f"diff line {i + 1}: expected a hunk header, got {lines[i]!r}")
        body: list[tuple[str, str]] = []
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            line = lines[i]
            tag, text = line[:1], line[1:]
            if i + 1 < len(lines) and lines[i + 1].startswith("\\"):   # "\ No newline at end of file"
                text = text.rstrip("\n")
                i += 1
            if tag in (" ", "-", "+"):
                body.append((tag, text))
            elif not line.startswith("\\"):
                raise ValueError(f"diff line {i + 1}: not a hunk line: {line!r}")
            i += 1
        hunks.append((int(m[1]), int(m[2]) if m[2] is not None else 1, body))
    return hunks


@dataclass(frozen=True)
class ExportedMutant:
    """One sampled mutant as --export writes it."""
    mutant: Mutant
    expected_stage: str
    diff: str

    def __post_init__(self):
        if not self.diff.startswith(f"--- {self.mutant.module}"):
            raise ValueError(f"{self.mutant.key}: its diff is not of {self.mutant.module}")

    def to_json(self) -> dict:
        m = self.mutant
        return {"key": m.key, "module": m.module, "operator": m.operator, "occurrence": m.occurrence,
                "line": m.line, "col": m.col, "definition": m.definition, "expected_stage": self.expected_stage,
                "diff": self.diff}

    @classmethod
    def from_json(cls, d: dict) -> "ExportedMutant":
        return cls(Mutant(d["module"], d["operator"], int(d["occurrence"]), int(d["line"]), int(d.get("col", 0)),
                          d.get("definition")), d["expected_stage"], d["diff"])

    reanchor: bool = False   # its module changed since the export: its hunks are found where their lines stand now

    def apply(self, tree: Path) -> None:
        """The mutant written into TREE (a private copy of the working tree)."""
        path = tree / self.mutant.module
        path.write_text(apply_unified_diff(path.read_text(), self.diff, self.reanchor))


def write_export(path: Path, meta: dict, mutants: list[ExportedMutant], modules: dict[str, str]) -> None:
    """MODULES: each mutated module's sha256 as exported (what --from checks the tree against)."""
    body = {"format": FORMAT, **meta, "module_sha256": dict(sorted(modules.items())),
            "mutants": [m.to_json() for m in mutants]}
    path.write_text(json.dumps(body, indent=1))


def read_export(path: Path, root: Path, reanchor: bool = False) -> tuple[dict, list[ExportedMutant]]:
    """The export's meta and mutants; SystemExit naming the first module of ROOT that differs from the tree the
    mutants were cut from (their diffs would not apply, or not mean the same). reanchor: a module that changed
    since is allowed; each of its mutants is applied where its hunk's lines stand now when they stand in exactly
    one place (the same source lines mutated the same way), and left out otherwise: meta's `reanchored` counts
    the first, `not_reanchored` lists the second (never judged, never misapplied)."""
    body = json.loads(path.read_text())
    if body.get("format") != FORMAT:
        raise SystemExit(f"{path}: not a mutant export of format {FORMAT}")
    changed = set()
    for module, digest in body["module_sha256"].items():
        f = root / module
        if not f.is_file() or sha256(f.read_text()) != digest:
            if not (reanchor and f.is_file()):
                raise SystemExit(f"{path}: {module} differs from the tree the mutants were cut from "
                                 f"({body.get('tree')}); check that revision out, or pass --reanchor")
            changed.add(module)
    mutants, lost = [], []
    for d in body["mutants"]:
        e = ExportedMutant.from_json(d)
        if e.mutant.module in changed:
            e = ExportedMutant(e.mutant, e.expected_stage, e.diff, reanchor=True)
            try:
                apply_unified_diff((root / e.mutant.module).read_text(), e.diff, reanchor=True)
            except ValueError:
                lost.append(e.mutant.key)
                continue
        mutants.append(e)
    meta = {k: v for k, v in body.items() if k not in ("mutants", "module_sha256")}
    if reanchor:
        meta.update(changed_modules=sorted(changed), reanchored=sum(e.reanchor for e in mutants),
                    not_reanchored=lost)
    return meta, mutants


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" (0 <= I < N): this machine judges the mutants whose index in the export is I modulo N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard wants I/N, got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard I/N wants 0 <= I < N, got {text!r}")
    return i, n


def shard(items: list, i: int, n: int) -> list:
    return [x for k, x in enumerate(items) if k % n == i]


def pick(exported: list[ExportedMutant], only: set[str], judged: set[str]) -> list[ExportedMutant]:
    """The exported mutants named in `only` (empty: all), less those already `judged` (keys of earlier results
    files: a run that goes on where they stopped, or judges again what a change to ddcheck may judge apart)."""
    unknown = only - {e.mutant.key for e in exported}
    if unknown:
        raise ValueError(f"not in the export: {', '.join(sorted(unknown)[:3])}"
                         f"{' and more' if len(unknown) > 3 else ''}")
    return [e for e in exported if (not only or e.mutant.key in only) and e.mutant.key not in judged]
