"""Shared CLI pieces: error mapping, device choice, settings from flags."""
from __future__ import annotations

import sys
from typing import NoReturn

import torch
import typer

from harness.attn.base import BackendUnavailable
from harness.model.presets import ModelLoadError
from harness.oracle_lookup import OracleUnavailable
from harness.runner.settings import UsageError, check_limit

# worker processes of a sweep or gate (0: one per core); each holds a model (~0.5 GB), so more than this is no plan
JOBS_MAX = 256
# torch intra-op threads (DDCHECK_THREADS)
THREADS_MAX = 1024


def check_jobs(jobs: int) -> None:
    check_limit("--jobs", jobs, 0, JOBS_MAX)


def threads_from_env(environ) -> int:
    """DDCHECK_THREADS (default 1): an integer in [1, THREADS_MAX], else a UsageError."""
    raw = environ.get("DDCHECK_THREADS", "1")
    try:
        n = int(raw.strip())
    except ValueError:
        raise UsageError(f"DDCHECK_THREADS must be an integer, got {raw!r}") from None
    check_limit("DDCHECK_THREADS", n, 1, THREADS_MAX)
    return n

# usage or environment errors: one line on stderr, exit 2, nothing written
USAGE_ERRORS = (UsageError, ModelLoadError, BackendUnavailable, OracleUnavailable)


def fail_usage(e: Exception) -> NoReturn:
    """Inside a command (typer turns Exit into the exit code)."""
    typer.echo(f"ddcheck: error: {e}", err=True)
    raise typer.Exit(2)


def exit_usage(e: Exception) -> NoReturn:
    """Outside typer's handling, in the console script's own frame."""
    typer.echo(f"ddcheck: error: {e}", err=True)
    sys.exit(2)


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
    from harness.attn import default_backend
    return backend or default_backend()


def check_outputs(**paths) -> None:
    """Every output path (flag name -> path or None) is writable BEFORE any work:
    not a directory, not under a file, its folder creatable and writable.
    Raises UsageError naming the flag."""
    import os
    from pathlib import Path
    for flag, path in paths.items():
        if path is None:
            continue
        p, name = Path(path), "--" + flag.replace("_", "-")
        if p.is_dir():
            raise UsageError(f"{name} {p}: is a directory")
        parent = p.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise UsageError(f"{name} {p}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{name} {p}: {parent} is not writable")


def write_text_atomic(path, text: str) -> None:
    """All or nothing: a temporary file beside `path`, renamed over it."""
    from pathlib import Path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def clear_stale(**paths) -> None:
    """Once every input is accepted, before any work: remove an earlier output of each name (flag name -> path
    or None), so a run killed from now on leaves no previous verdict ("passed": true) under the name."""
    from pathlib import Path
    for path in paths.values():
        if path is None:
            continue
        p = Path(path)
        for old in (p, p.with_name(f".{p.name}.tmp")):
            if old.is_symlink() or old.is_file():
                old.unlink(missing_ok=True)
