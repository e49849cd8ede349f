"""Stage 4, attention: the backend seam and the built-in backends.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from harness.engine.attn.base import AttentionBackend, BackendUnavailable
from harness.engine.attn.registry import BACKENDS, default_backend, make_backend

__all__ = ["AttentionBackend", "BACKENDS", "BackendUnavailable", "make_backend", "default_backend"]
