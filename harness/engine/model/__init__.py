"""The target model (Llama family) and its loaders: presets, checkpoints.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from harness.engine.model.llama import LlamaModel
from harness.engine.model.presets import PRESETS, load_model

__all__ = ["LlamaModel", "PRESETS", "load_model"]
