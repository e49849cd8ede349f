from harness.engine.model.llama import LlamaModel
from harness.engine.model.presets import PRESETS, load_model

__all__ = ["LlamaModel", "PRESETS", "load_model"]
