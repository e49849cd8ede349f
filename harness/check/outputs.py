"""What a command may write, and how it takes its outputs over.

An output is only ever a regular file ddcheck creates or replaces: a device
node, a FIFO, a socket, a symbolic link or a path that is also one of the
command's inputs is refused before any work (`refuse_unsafe`,
`check_not_inputs`). Once the work starts, `OutputClaim` locks every output
(two ddcheck processes never write one file: the second refuses, naming the
first's pid) and replaces each old output, atomically, with a placeholder that
says the run is incomplete, so a run killed half-way leaves neither a
previous run's pass nor a missing file; nothing is unlinked. The real
outputs replace the placeholders atomically when they are ready.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from harness.engine.settings import UsageError

FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
              (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def refuse_unsafe(name: str, p: Path) -> None:
    """`p` (the flag `name`'s path) is absent or a regular file: anything else
    ddcheck would replace or write through is a usage error. Never opens `p`."""
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):   # absent (under a file: check_creatable says so)
        return
    except OSError as e:
        raise UsageError(f"{name} {p}: cannot be inspected ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{name} {p}: is a symbolic link (to {os.readlink(p)}); ddcheck writes only regular "
                         "files it may replace")
    for test, what in FILE_KINDS:
        if test(st.st_mode):
            raise UsageError(f"{name} {p}: is {what}" + ("" if what == "a directory" else
                                                         "; ddcheck writes only regular files"))


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(os.path.abspath(a)) == Path(os.path.abspath(b))


def check_not_inputs(outputs: dict, inputs) -> None:
    """No output (flag -> path) is one of the inputs ((what, path) pairs), nor
    an existing file inside an input directory (a checkpoint's config.json or
    weights): replacing it would destroy what the run reads."""
    outs = {flag: Path(p) for flag, p in outputs.items() if p is not None}
    for what, raw in inputs:
        if raw is None:
            continue
        src = Path(raw)
        for flag, p in outs.items():
            inside = src.is_dir() and p.exists() and Path(os.path.realpath(p)).is_relative_to(os.path.realpath(src))
            if _same(p, src) or inside:
                raise UsageError(f"{flag} {p}: is also an input ({what} {src}); ddcheck never writes over what it reads")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def stamp() -> dict:
    """What produced an output and when: version, commit (null when unknown), UTC time."""
    from harness.check.records import provenance
    return {**provenance(), "time": _now()}


def placeholder(role: str, command: str, total: int) -> str:
    """An output's text while its run is under way: incomplete, never a pass."""
    why = (f"incomplete: `ddcheck {command}` (pid {os.getpid()}) has not finished: it is still running, or was "
           "killed")
    if role == "out":   # records: the report shows a file holding a `started` record as incomplete
        from ddschema import SCHEMA_VERSION
        return json.dumps({"kind": "started", "command": command, "total": total, "pid": os.getpid(),
                           "schema": SCHEMA_VERSION, **stamp()}) + "\n"
    if role == "junit":
        from xml.sax.saxutils import quoteattr
        return ('<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="ddcheck gate" tests="1" failures="1">'
                f'<testsuite name="ddcheck" tests="1" failures="1"><testcase classname="ddcheck" name="{command}">'
                f'<failure message={quoteattr(why)} type="incomplete"/></testcase></testsuite></testsuites>\n')
    if role == "json":
        return json.dumps({"passed": False, "incomplete": True, "message": why, **stamp()}, indent=2) + "\n"
    from html import escape
    return (f"<!doctype html><meta charset=utf-8><title>ddcheck: incomplete</title>"
            f"<p>ddcheck: {escape(why)}</p>\n")


def replace_atomically(path: Path, text: str) -> None:
    """All or nothing: a fresh temporary file beside `path` (never an existing
    one followed through a link), renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def lock_path(p: Path) -> Path:
    return Path(p).with_name(f".{Path(p).name}.lock")


def _lock(flag: str, p: Path) -> int:
    """An exclusive flock on `p`'s lock file (released when the process ends,
    however it ends); UsageError naming the holder's pid when it is taken."""
    import fcntl
    lock = lock_path(p)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{flag} {p}: in use by pid {holder} (another ddcheck is writing it); "
                             "wait for it or choose another path") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:   # not a lock file its previous holder removed while we waited on it
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return fd
        os.close(fd)


def _unlock(p: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        lock_path(p).unlink()
    os.close(fd)


class OutputClaim:
    """A command's hold on its outputs (flag name -> path or None). `take`,
    once every input is checked, locks each (the taken lock is the last usage
    error) and replaces each with its placeholder; leaving the `with` block
    releases the locks, however the block ends."""

    def __init__(self, command: str, total: int, **outputs) -> None:
        self.command, self.total = command, total
        self.paths = {"--" + k.replace("_", "-"): (k, Path(v)) for k, v in outputs.items() if v is not None}
        self.held: list[tuple[Path, int]] = []

    def take(self) -> None:
        for flag, (_, p) in sorted(self.paths.items(), key=lambda kv: str(kv[1][1])):
            self.held.append((p, _lock(flag, p)))
        for role, p in self.paths.values():
            replace_atomically(p, placeholder(role, self.command, self.total))

    def __enter__(self) -> "OutputClaim":
        return self

    def __exit__(self, *exc) -> None:
        while self.held:
            _unlock(*self.held.pop())


class RecordStream:
    """A records file that grows as settings finish: after the `started`
    placeholder, each finished setting's lines are appended and flushed, so a
    run killed after N settings leaves their N summaries. The finished file
    replaces it atomically (harness.workflows.sweep.write_jsonl)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8") if path is not None else None

    def add(self, lines) -> None:
        if self._f is None:
            return
        self._f.write("".join(ln + "\n" for ln in lines))   # one write per setting
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
