"""Shared CLI pieces: error mapping, device choice, settings from flags.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import sys
from typing import NoReturn

import torch
import typer

from harness.engine.settings import UsageError
from harness.check.prepare import USAGE_ERRORS  # noqa: F401  (the commands catch them)


def fail_usage(e: Exception) -> NoReturn:
    """Inside a command (typer turns Exit into the exit code)."""
    typer.echo(f"ddcheck: error: {e}", err=True)
    raise typer.Exit(2)


def exit_usage(e: Exception) -> NoReturn:
    """Outside typer's handling, in the console script's own frame."""
    typer.echo(f"ddcheck: error: {e}", err=True)
    sys.exit(2)


MAX_JOBS = 256      # worker processes of a sweep or gate (each holds a model and an oracle)
MAX_THREADS = 1024  # DDCHECK_THREADS: torch intra-op threads


def check_jobs(jobs: int) -> None:
    if not 0 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs must be in [0, {MAX_JOBS}] (0: one per core), got {jobs}")


def threads_from_env(environ) -> int:
    """DDCHECK_THREADS (default 1): a whole number of torch threads in [1, MAX_THREADS]."""
    raw = environ.get("DDCHECK_THREADS", "1")
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        raise UsageError(f"DDCHECK_THREADS must be a whole number in [1, {MAX_THREADS}], got {raw!r}")
    return n


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu or cuda[:N], got {device!r}") from None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    return device


def pick_backend(backend: str | None) -> str:
    from harness.engine.attn import default_backend
    return backend or default_backend()


def take_or_fail(claim) -> None:
    """Lock a command's outputs and mark them incomplete
    (harness.check.outputs.OutputClaim.take); held by another ddcheck: exit 2."""
    try:
        claim.take()
    except USAGE_ERRORS as e:
        fail_usage(e)


def check_outputs(**paths) -> None:
    """Every output path (flag name -> path or None) is writable BEFORE any work:
    absent or a regular file (not a directory, device node, FIFO, socket or
    symbolic link: harness.check.outputs), not under a file, its folder creatable
    and writable. Raises UsageError naming the flag."""
    from pathlib import Path
    from harness.check.outputs import refuse_unsafe
    for flag, path in paths.items():
        if path is None:
            continue
        p, name = Path(path), "--" + flag.replace("_", "-")
        refuse_unsafe(name, p)
        check_creatable(name, p, p.parent)


def check_creatable(name: str, p, parent) -> None:
    """The nearest existing folder at or above `parent` is a writable directory,
    so `p` (the flag `name`'s path) can be created there."""
    import os
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{name} {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {p}: {parent} is not writable")


def write_text_atomic(path, text: str) -> None:
    """All or nothing: a fresh temporary file beside `path`, renamed over it."""
    from harness.check.outputs import replace_atomically
    replace_atomically(path, text)
