"""The oracle: a slow, obvious, float64 reference for DDTree checks.

Imports only torch, the standard library and ddschema; never harness/.
"""
from reference.model import DenseLlama, ForwardResult
from reference.oracle import DenseOracle

__all__ = ["DenseLlama", "DenseOracle", "ForwardResult"]
