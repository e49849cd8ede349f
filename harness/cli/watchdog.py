"""A process that dies by a signal still ends in a verdict. The command runs
in a child process with Python's fault handler on; the parent waits. When a
kernel call kills the child (the Triton interpreter reading outside a buffer:
signal 11 or 6, no exception to catch), the parent reads the fault handler's
dump of the Python stack, attributes the death to the side whose frame is
innermost (harness/check/crash.py), and writes one stderr line, for `run
--out FILE` a crash record and a failing summary (harness/cli/import_crash.py),
and exits by the verdict: 1 for the engine under test, 3 for ddcheck or the
oracle. A child that exits normally passes its exit status through.

The parent imports nothing heavy (no torch); `DDCHECK_FAULT_DUMP` in the
child's environment names the dump file and marks it as the child.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

DUMP_ENV = "DDCHECK_FAULT_DUMP"
FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')


def in_child() -> bool:
    return bool(os.environ.get(DUMP_ENV))


def enable_fault_dump() -> IO:
    """In the child: the fault handler writes the Python stack to the dump file on a fatal signal.
    The caller keeps the returned file open for the process's life."""
    # taken out of the environment: a process this one starts (a sweep's setting) has a watchdog of its own
    f = open(os.environ.pop(DUMP_ENV), "w")   # noqa: SIM115  (open until the process ends, by design)
    faulthandler.enable(file=f, all_threads=False)
    return f


def innermost_frame(dump: str):
    """(side, where) of the innermost frame of a side in a fault handler's dump; (None, None) when none.
    The dump lists the most recent call first."""
    from harness.check.crash import project_path, side_of
    for m in FRAME.finditer(dump):
        side = side_of(m["file"])
        if side is not None:
            return side, f"{project_path(m['file'])}:{m['line']} ({m['func']})"
    return None, None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def died(number: int, dump: str, argv: list[str]):
    """The verdict on a child killed by signal NUMBER: never returns."""
    from harness.check.crash import Crash
    from harness.cli.import_crash import EXITS, records, write_records, out_path
    side, where = innermost_frame(dump)
    frames = FRAME.findall(dump)
    raised_at = f"{frames[0][0]}:{frames[0][1]} ({frames[0][2]})" if frames else "?"
    crash = Crash(side or "ddcheck", where or raised_at, raised_at,
                  f"the process died by {signal_name(number)}", None, dump)
    path = out_path(argv)
    rows = records(crash, "ddcheck " + " ".join(argv), "running")
    if path is not None and crash.side == "engine":
        add_proof(rows[-1], replaced_rerun(argv))
    written = path is not None and write_records(path, rows)
    shown = f" (records: {path})" if written else ""
    who = "ddcheck itself (an internal error)" if crash.side == "ddcheck" else crash.who
    print(f"ddcheck: {who}: {crash.error} at {crash.where}{shown}", file=sys.stderr)
    sys.exit(EXITS[crash.side])


def replaced_rerun(argv: list[str]) -> dict | None:
    """A `run` a kernel killed, run again in a new process with its attention replaced by a float64 softmax
    from the start (the crash rung of harness/check/localize/stage_swap.py; nothing else changed): its
    summary, or None (another command, already a rerun, or it left no summary). harness/workflows/reruns.py."""
    from harness.workflows.reruns import replaced_rerun as rerun
    return rerun(argv, "attention")


def add_proof(summary: dict, rerun: dict | None) -> None:
    """The killed run's summary with the rerun's outcome as its replacement (harness/check/crash.py prove_killed)."""
    from harness.check.crash import prove_killed
    prove_killed(summary, rerun)


def run_in_child(argv: list[str]) -> int:
    """`python -m harness ARGV` in a child with the fault handler on; its exit status, or the verdict on
    its death by a signal."""
    fd, dump_path = tempfile.mkstemp(prefix="ddcheck-fault-", suffix=".txt")
    os.close(fd)
    try:
        child = subprocess.Popen([sys.executable, "-m", "harness", *argv], env={**os.environ, DUMP_ENV: dump_path})
        forwarded: list[int] = []
        with forwarding(child, forwarded):
            rc = child.wait()
        if rc >= 0 or -rc == signal.SIGINT:
            return rc if rc >= 0 else 130
        if -rc in forwarded:   # stopped before its own handlers were on (still importing): the shell's status
            return 128 - rc
        died(-rc, Path(dump_path).read_text(errors="replace"), argv)
    finally:
        Path(dump_path).unlink(missing_ok=True)


@contextmanager
def forwarding(child: subprocess.Popen, forwarded: list[int]) -> Iterator[None]:
    """SIGTERM and SIGINT sent to this process are passed on to the child (which writes its records so far and
    a `stopped` summary: harness/check/stop.py), and this process waits for it; `forwarded` lists them. Ctrl-C
    reaches the child from the terminal too; the child ignores the second."""
    def forward(signum, frame) -> None:   # noqa: ARG001  (a signal handler's signature)
        forwarded.append(signum)
        if child.poll() is None:
            child.send_signal(signum)
    before = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
