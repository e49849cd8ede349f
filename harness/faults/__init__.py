from harness.faults.registry import FAULTS, Fault, apply_fault, why_cannot_show

__all__ = ["FAULTS", "Fault", "apply_fault", "why_cannot_show"]
