"""Localization of a run's first divergence: mask probe, KV audit, layer
bisect, graph/input/acceptance audits, then a fault class and a paragraph.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from harness.check.localize.driver import Localization, localize

__all__ = ["Localization", "localize"]
