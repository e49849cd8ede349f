"""The small schema that harness/ (system under test) and reference/ (oracle) share.

Nothing here computes attention, masks or trees: only model configuration,
weight names and the record format, so that neither side can lean on the
other's code.
"""
from ddschema.config import MlaConfig, ModelConfig, MoeConfig, RopeScaling, YarnScaling, weight_names, weight_shapes
from ddschema.records import RECORD_KINDS, VERDICTS, SCHEMA_VERSION
from ddschema.oracle import Oracle, Routing

__all__ = ["ModelConfig", "RopeScaling", "YarnScaling", "MlaConfig", "MoeConfig", "weight_names", "weight_shapes", "RECORD_KINDS", "VERDICTS", "SCHEMA_VERSION", "Oracle", "Routing"]
