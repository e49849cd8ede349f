"""`ddcheck models`: the trained models `--model NAME` takes, where they ship
and whether their cache entry is there and intact; `--rebuild NAME` writes
an entry afresh.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from typing import Optional

import typer

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, fail_usage


def cache_state(entry) -> str:
    """`cached <dir>`, `not cached`, or the one-line reason the entry is refused."""
    from harness.engine.model.named import cache_dir, verify
    from harness.engine.model.presets import ModelLoadError
    directory = cache_dir(entry)
    if not directory.exists():
        return "not cached"
    try:
        verify(directory, entry)
    except ModelLoadError as e:
        return f"refused: {e}"
    return f"cached {directory}"


def package_state(entry) -> str:
    from importlib import metadata
    from harness.engine.model.named import sources
    try:
        version = metadata.version(entry.package)
    except metadata.PackageNotFoundError:
        return f"not installed ({entry.install_hint})"
    return f"{version}" + ("" if sources(entry) else f", but {entry.file} (or a chunk of it) is missing")


@app.command()
def models(rebuild: Optional[str] = typer.Option(None, help="materialize NAME's cache entry afresh (a corrupt or "
                                                 "partial one is replaced once the new one is complete)")) -> None:
    """List the trained models --model NAME takes (and the presets); exit 2 for an unknown --rebuild NAME."""
    from harness.engine.model.named import REGISTRY, cache_root, materialize
    from harness.engine.model.presets import PRESETS
    if rebuild is not None:
        if rebuild not in REGISTRY:
            fail_usage(ValueError(f"--rebuild {rebuild!r}: not a trained model ({', '.join(REGISTRY)})"))
        try:
            path = materialize(REGISTRY[rebuild], rebuild=True)
        except USAGE_ERRORS as e:
            fail_usage(e)
        typer.echo(f"{rebuild}: rebuilt {path}")
        return
    typer.echo(f"trained models (--model NAME; cache {cache_root() / 'models'}):")
    for m in REGISTRY.values():
        typer.echo(f"  {m.name}: {m.architecture}, {m.params} parameters; {m.note}")
        chunks = f" (in {len(m.parts)} chunk packages)" if m.parts else ""
        typer.echo(f"    source: {m.package} {m.file}{chunks}; package {package_state(m)}")
        typer.echo(f"    cache: {cache_state(m)}")
    typer.echo(f"random-weight presets (--model NAME): {', '.join(PRESETS)}")
    typer.echo("or a Hugging Face checkpoint directory: --model DIR")
