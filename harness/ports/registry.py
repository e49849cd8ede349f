"""Port families: built-in adapters, plus third-party ones registered under
the `ddcheck.ports` entry-point group. `--impl FAMILY:PATH` picks one.

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from harness.ports.protocol import PortAdapter, PortError

ENTRY_POINT_GROUP = "ddcheck.ports"
BUILTIN = ("ddtree_utils", "dflash_tree", "dflash2_beam", "dflash_tree_utils", "dflash_worker_tree", "sglang_eagle")


@dataclass(frozen=True)
class Family:
    name: str
    load: Callable[[Path | None], PortAdapter]   # PATH (a file or an SGLang checkout) -> adapter
    needs_path: bool = True
    describe: Callable[[], object] | None = None  # -> Conventions, without loading a port
    # PATH -> None when the family can drive it, else why not, without running the port's code
    # (None: `ddcheck ports --probe` tries to load the port instead)
    fits: Callable[[Path], str | None] | None = None


def families() -> dict[str, Family]:
    """Every family, built-in first; a third-party family cannot shadow a built-in one."""
    out: dict[str, Family] = {}
    for mod in BUILTIN:
        fam = __import__(f"harness.ports.families.{mod}", fromlist=["FAMILY"]).FAMILY
        out[fam.name] = fam
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in out:
            continue
        fam = ep.load()
        if not isinstance(fam, Family):
            raise PortError(f"entry point {ep.name} in {ENTRY_POINT_GROUP} is not a harness.ports.Family")
        out[fam.name] = fam
    return out


@dataclass(frozen=True)
class ImplSpec:
    family: str
    path: Path | None

    @property
    def label(self) -> str:
        return f"{self.family}:{self.path}" if self.path else self.family


def parse_impl(text: str) -> ImplSpec:
    """FAMILY:PATH (or FAMILY alone for families that bring their own code)."""
    fam_name, _, path = text.partition(":")
    fams = families()
    if fam_name not in fams:
        raise PortError(f"--impl {text!r}: unknown family {fam_name!r}; families: {', '.join(fams)}")
    fam = fams[fam_name]
    if fam.needs_path and not path:
        raise PortError(f"--impl {fam_name} needs a path: --impl {fam_name}:PATH (the port's file or checkout)")
    where = Path(path).expanduser() if path else None
    if where is not None and not where.exists():
        raise PortError(f"--impl {text!r}: {where} does not exist")
    return ImplSpec(fam_name, where)


def load_adapter(spec: ImplSpec) -> PortAdapter:
    return families()[spec.family].load(spec.path)


def find_in_checkout(path: Path, candidates: tuple[str, ...]) -> Path:
    """A port file given directly, or found inside an SGLang checkout."""
    if path.is_file():
        return path
    for rel in candidates:
        if (path / rel).is_file():
            return path / rel
    raise PortError(f"{path}: none of {', '.join(candidates)} found in this checkout")
