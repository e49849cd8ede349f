"""An exception while the command line imports its own modules (a module of
the engine under test that raises at import, a syntax error in a port
stage's file, a bug of ddcheck's at module level): attributed to the side
that raised (harness/check/crash.py), one stderr line, the exit of its
verdict (1: the engine under test crashed, a divergence; 3: ddcheck or the
oracle, could not judge) and, for `run --out FILE`, a crash record and a
failing summary in FILE; never a bare traceback with no verdict.

Imports nothing of ddcheck at module level but crash.py, which imports only
the standard library: whatever failed to import is not needed here.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from harness.check.crash import Crash, attribute, crash_stage

EXITS = {"engine": 1, "oracle": 3, "ddcheck": 3}
VERDICTS = {"engine": "diverge", "oracle": "oracle-crash", "ddcheck": "internal-error"}


def out_path(argv: list[str]) -> Path | None:
    """`run`'s --out FILE as given on the command line (None: another command, or no --out)."""
    if "run" not in argv[:1]:
        return None
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out="):
            return Path(a.partition("=")[2])
    return None


def records(crash: Crash, setting: str, during: str = "importing") -> list[dict]:
    """The crash record and a failing summary for a process that ended DURING importing (no verify step
    ran) or running (its own records never written: harness/cli/watchdog.py)."""
    engine = crash.side == "engine"
    first = ({"step": -1, "request": -1, "node": -1, "depth": None, "padding_present": False, "rel_err": None,
              "what": "crash", "detail": crash.sentence()} if engine else None)
    summary = {"kind": "summary", "setting": setting, "passed": False, "verdict": VERDICTS[crash.side],
               "while": during, "nodes_checked": 0, "divergent_nodes": 0, "steps": 0, "first": first,
               "crash": crash.brief(), "error": crash.error, "fault_class": "crash" if engine else None,
               "explanation": crash.sentence() + (", while ddcheck imported it" if during == "importing" else ""),
               "stage": crash_stage(crash), "quantity": "crash" if crash_stage(crash) else None}
    return [crash.record(setting), summary]


def write_records(path: Path, rows: list[dict]) -> bool:
    """Atomically, only over nothing or a regular file (a link, a device or a FIFO is left alone)."""
    if path.is_symlink() or (path.exists() and not path.is_file()) or not path.parent.is_dir():
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return True


def crashed_while_importing(e: BaseException, argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    crash = attribute(e)
    path = out_path(argv)
    rows = records(crash, "ddcheck " + " ".join(argv))
    if path is not None:   # the same run again with a stage replaced from the start, in new processes
        from harness.workflows.reruns import prove_crash_summary
        prove_crash_summary(rows[-1], e, argv)
    written = path is not None and write_records(path, rows)
    where = f" (records: {path})" if written else ""
    if crash.side == "ddcheck":
        line = (f"ddcheck: internal error (a bug in ddcheck, not a verdict on the engine): {crash.error} at "
                f"{crash.where} while importing{where}")
    else:
        line = f"ddcheck: {crash.who} raised {crash.error} at {crash.where} while ddcheck imported it{where}"
    print(line, file=sys.stderr)
    sys.exit(EXITS[crash.side])
