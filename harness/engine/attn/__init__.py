from harness.engine.attn.base import AttentionBackend, BackendUnavailable
from harness.engine.attn.registry import BACKENDS, default_backend, make_backend

__all__ = ["AttentionBackend", "BACKENDS", "BackendUnavailable", "make_backend", "default_backend"]
