"""Find the oracle through the `ddcheck.oracles` entry point: harness/ talks to
it only through ddschema.Oracle and never imports reference/.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from importlib.metadata import entry_points

from ddschema import Oracle


class OracleUnavailable(RuntimeError):
    """No oracle is registered: ddcheck is not installed (an environment error)."""


def load_oracle_class(name: str = "dense") -> type[Oracle]:
    found = {ep.name: ep for ep in entry_points(group="ddcheck.oracles")}
    if name not in found:
        raise OracleUnavailable(f"no oracle {name!r} registered (is ddcheck installed? `make setup`); "
                           f"registered: {', '.join(found) or 'none'}")
    return found[name].load()
