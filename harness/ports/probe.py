"""`ddcheck ports --probe PATH`: which family fits a checkout, and why each other does not.

A family with a `fits` check answers from the parsed files (nothing runs);
one without is loaded, and the one-line error its loading gives is its reason.
Families that bring their own code (SGLang's installed builder) take no path.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.ports.registry import families

ADAPTER_GUIDE = "docs/ADAPTERS.md"


@dataclass(frozen=True)
class ProbeResult:
    family: str
    fits: bool
    reason: str               # why it does not fit ("" when it fits)

    def __post_init__(self) -> None:
        if self.fits == bool(self.reason):
            raise ValueError(f"{self.family}: a family that fits has no reason, one that does not has one")


def probe(path: Path) -> list[ProbeResult]:
    """Every family against `path` (which must exist: the caller says so, exit 2)."""
    out = []
    for fam in families().values():
        if not fam.needs_path:
            out.append(ProbeResult(fam.name, False, "brings its own code (takes no PATH)"))
            continue
        reason = fam.fits(path) if fam.fits is not None else _load_reason(fam, path)
        out.append(ProbeResult(fam.name, reason is None, reason or ""))
    return out


def _load_reason(fam, path: Path) -> str | None:
    try:
        fam.load(path)
    except Exception as e:  # noqa: BLE001  (any failure to load is this family's reason)
        text = str(e) if str(e).startswith(str(path)) else f"{type(e).__name__}: {e}"
        return (text.splitlines() or [type(e).__name__])[0]
    return None
