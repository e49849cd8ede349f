from harness.model.llama import LlamaModel
from harness.model.presets import PRESETS, load_model

__all__ = ["LlamaModel", "PRESETS", "load_model"]
