"""Where the project's own files are: a frame's file as a path relative to the project root (harness/,
reference/, ddschema/), for attributing a raise to the side whose code it is. Imports only the standard
library: it is read while the engine under test may not even import.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project: harness/, reference/, ddschema/


def project_path(filename: str) -> str | None:
    """The path relative to the project root, or None outside it."""
    try:
        return Path(filename).resolve().relative_to(ROOT).as_posix()
    except (ValueError, OSError):
        return None
