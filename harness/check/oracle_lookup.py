"""Find the oracle through the `ddcheck.oracles` entry point: harness/ talks to
it only through ddschema.Oracle and never imports reference/.

Two are registered (pyproject.toml): `dense` holds the whole float64 model,
`streamed` one decoder layer at a time (harness/check/oracle_placement.py
says which a run takes). An install older than an entry point lacks it: the
error says to reinstall.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from importlib.metadata import entry_points

from ddschema import Oracle

ORACLES = ("dense", "streamed")   # what pyproject.toml registers


class OracleUnavailable(RuntimeError):
    """The oracle asked for is not registered: ddcheck is not installed, or
    installed before that oracle was added (an environment error)."""


def load_oracle_class(name: str = "dense") -> type[Oracle]:
    found = {ep.name: ep for ep in entry_points(group="ddcheck.oracles")}
    if name not in found:
        why = ("this installation of ddcheck predates it: reinstall it (`pip install -e .` in the checkout, "
               "or `make setup`)" if name in ORACLES and found else
               "is ddcheck installed? `pip install -e .` in the checkout, or `make setup`")
        raise OracleUnavailable(f"no oracle {name!r} registered in the ddcheck.oracles entry points ({why}); "
                                f"registered: {', '.join(sorted(found)) or 'none'}")
    return found[name].load()
