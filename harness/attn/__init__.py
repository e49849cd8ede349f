from harness.attn.base import AttentionBackend, BACKENDS, BackendUnavailable, make_backend, default_backend

__all__ = ["AttentionBackend", "BACKENDS", "BackendUnavailable", "make_backend", "default_backend"]
