"""What the two mutation benchmarks share (mutation_score.py: the hand-made
corpus; mutation_engine.py: mutants from cosmic-ray): a private copy of the
working tree to mutate, and one `python -m harness run` in it, read back as
its exit status, its summary record and the engine's outputs.

Not imported by harness/ or reference/; the benchmarks and their tests put
this folder on sys.path."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


# what a tree without git leaves out of its copy (with git: what .gitignore leaves out)
NOT_COPIED = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "dist", "node_modules"}


def tree_files(root: Path = ROOT) -> list[str]:
    """The working tree's tracked and untracked-not-ignored files; where there is no git (a machine the tree was
    carried to), every file under ROOT but caches, virtual environments and build outputs."""
    try:
        return subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and not NOT_COPIED & set(p.relative_to(root).parts)
                      and not p.name.endswith((".pyc", ".egg-info")))


def copy_tree(dest: Path, root: Path = ROOT) -> None:
    """The working tree's files (tree_files: what a mutation is applied to)."""
    for f in tree_files(root):
        src = root / f
        if src.is_file() and not f.startswith(("benchmarks/results/", "reports/")):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


@dataclass(frozen=True)
class CliRun:
    """One `python -m harness run` of a (possibly mutated) tree."""
    exit: int                 # the process's status; negative: killed by that signal; 124: past the time cap
    summary: dict | None      # the run's summary record (None: the run wrote none)
    fingerprint: str | None   # sha256 of the engine's outputs (engine_outputs); None when nothing was written
    stderr_tail: str          # the last lines of stderr (an internal error's one line, a traceback's end)
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.exit == 124


# what the engine produced, as the records carry it: the tokens it emitted, its tree and acceptance, and each
# node's logits as their error against the oracle's (any change to a logit moves rel_err / rel_l2 / kl)
NODE_FIELDS = ("step", "request", "node", "depth", "parent", "token", "accepted", "finite", "is_padding",
               "rel_err", "rel_l2", "kl", "top1_agree")
SUMMARY_FIELDS = ("verdict", "nodes_checked", "steps", "mean_accepted_length", "acceptance_by_depth", "first",
                  "stage", "quantity")


def engine_outputs(records: list[dict]) -> list:
    """The engine's outputs in a run's records, without timings, paths or versions."""
    out: list = []
    for r in records:
        if r.get("kind") == "node":
            out.append(["node", *(r.get(k) for k in NODE_FIELDS)])
        elif r.get("kind") == "stream":
            out.append(["stream", r.get("request"), r.get("engine_tokens")])
        elif r.get("kind") == "summary":
            out.append(["summary", *(r.get(k) for k in SUMMARY_FIELDS)])
    return out


def fingerprint(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(engine_outputs(records), sort_keys=True).encode()).hexdigest()


def read_records(path: Path) -> list[dict]:
    """The JSON lines a run wrote; a torn last line (the run was killed mid-write) is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _caps(memory_bytes: int | None):
    def apply() -> None:   # runs in the child before exec: its own process group, its memory capped
        os.setsid()
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    return apply


def python_path(tree: Path) -> str:
    """TREE first, then the caller's PYTHONPATH without ROOT: packages installed with --target (a machine
    without a venv) stay importable, and the copy's modules, never ROOT's, are the ones imported."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT.resolve()]
    return os.pathsep.join([str(tree), *rest])


def run_cli(tree: Path, args: list[str], out: Path, timeout_s: float | None = None,
            memory_bytes: int | None = None) -> CliRun:
    """`python -m harness run ARGS --out OUT` with TREE first on the path; past TIMEOUT_S the process group
    is killed (exit 124), its address space capped at MEMORY_BYTES."""
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "harness", "run", *args, "--out", str(out)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": python_path(tree)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_caps(memory_bytes))
    try:
        _, err = p.communicate(timeout=timeout_s)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        _, err = p.communicate()
        rc = 124
    records = read_records(out)
    summary = next((x for x in reversed(records) if x.get("kind") == "summary"), None)
    return CliRun(exit=rc, summary=summary, fingerprint=fingerprint(records) if records else None,
                  stderr_tail="\n".join((err or "").strip().splitlines()[-6:]), seconds=time.perf_counter() - t0)
