"""The fault catalog: named mutations of the engine under test.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from harness.faults.registry import FAULTS, Fault, apply_fault, why_cannot_show

__all__ = ["FAULTS", "Fault", "apply_fault", "why_cannot_show"]
