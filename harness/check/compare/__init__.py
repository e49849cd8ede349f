"""Comparisons of one verify step: per-node logit metrics, the oracle's tree
and walk against the engine's, acceptance statistics.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
