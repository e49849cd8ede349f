"""Shared CLI pieces: error mapping, device choice, settings from flags."""
from __future__ import annotations

import sys
from typing import NoReturn

import torch
import typer

from harness.attn.base import BackendUnavailable
from harness.model.presets import ModelLoadError
from harness.runner.settings import UsageError

USAGE_ERRORS = (UsageError, ModelLoadError, BackendUnavailable)


def fail_usage(e: Exception) -> NoReturn:
    typer.echo(f"ddcheck: error: {e}", err=True)
    raise typer.Exit(2)


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    return device


def pick_backend(backend: str | None) -> str:
    from harness.attn import default_backend
    return backend or default_backend()
