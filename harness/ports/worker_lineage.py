"""Which of a checkout's worker functions a run reached, from which file and commit.

ddcheck's claim about a port is only as good as the code it ran. The lineage
records, while the adapter drives the port, every function of the checkout's
files that was entered (a profile hook on the modules ddcheck loaded from the
checkout, nothing else), and the commit the checkout's git directory names,
so a verdict says "DFlashWorker._ddtree_sample_and_generate_mask of
dflash_worker.py at 514ea1f3ec39 ran", not "the port ran".


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.ports.loading import PORT_MODULE_PREFIX


@dataclass(frozen=True)
class Reached:
    """One function of the checkout that ran: file name, qualified name, first line."""

    file: str
    function: str
    line: int

    def __post_init__(self) -> None:
        if not self.file or not self.function or self.line < 1:
            raise ValueError(f"Reached needs a file, a function and a line >= 1, got {self!r}")

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


def checkout_commit(path: Path) -> str | None:
    """The commit HEAD names in the git directory above `path` (read, not run); None: not a git checkout."""
    for d in [Path(path).resolve(), *Path(path).resolve().parents]:
        git = d / ".git"
        if git.is_file():   # a worktree: "gitdir: <dir>"
            text = git.read_text(errors="replace").strip()
            git = (d / text.partition("gitdir:")[2].strip()).resolve() if text.startswith("gitdir:") else git
        if not git.is_dir():
            continue
        head = (git / "HEAD").read_text(errors="replace").strip() if (git / "HEAD").is_file() else ""
        if not head.startswith("ref:"):
            return head or None
        ref = head.partition("ref:")[2].strip()
        common = git / "commondir"
        roots = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for root in roots:
            if (root / ref).is_file():
                return (root / ref).read_text().strip()
            packed = root / "packed-refs"
            if packed.is_file():
                for line in packed.read_text(errors="replace").splitlines():
                    sha, _, name = line.partition(" ")
                    if name == ref:
                        return sha
        return None
    return None


@dataclass
class WorkerLineage:
    """The checkout's files a family loaded and the functions of them a run reached (mutable:
    filled while the port runs)."""

    checkout: str                                  # the path the user gave
    commit: str | None                             # None: not a git checkout
    files: tuple[str, ...]                         # the checkout's files ddcheck loaded, entry last
    reached: dict[tuple[str, str], Reached] = field(default_factory=dict)

    @contextmanager
    def recording(self):
        """Record every function of the checkout's modules entered inside the block."""
        previous = sys.getprofile()

        def hook(frame, event, arg):
            if (event == "call" and str(frame.f_globals.get("__name__", "")).startswith(PORT_MODULE_PREFIX)
                    and not frame.f_code.co_filename.startswith("<")):   # not code a decorator generated
                code = frame.f_code
                key = (code.co_filename, getattr(code, "co_qualname", code.co_name))
                if key not in self.reached:
                    self.reached[key] = Reached(Path(code.co_filename).name, key[1], max(code.co_firstlineno, 1))
            if previous is not None:
                previous(frame, event, arg)

        sys.setprofile(hook)
        try:
            yield self
        finally:
            sys.setprofile(previous)

    def describe(self) -> dict:
        return {"checkout": self.checkout, "commit": self.commit, "files": list(self.files),
                "reached": [str(r) for r in self.reached.values()]}

    def sentence(self) -> str:
        at = f"at {self.commit[:12]}" if self.commit else "(not a git checkout: commit unknown)"
        ran = ", ".join(sorted({f"{r.file}:{r.function}" for r in self.reached.values()})) or "nothing yet"
        return f"{', '.join(self.files)} {at}; reached: {ran}"
