"""The attention backends by name: the built-in ones, listed here rather than
registering themselves (so no backend module imports the table that holds
it). Owns the name -> backend table and the default choice; imports only the
backends of this package.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from typing import Callable

import torch

from harness.engine.attn import sglang_triton
from harness.engine.attn.base import AttentionBackend, BackendUnavailable
from harness.engine.attn.sglang_serving import make_serving
from harness.engine.attn.sglang_triton import SGLangTritonBackend
from harness.engine.attn.sglang_unified import SGLangUnifiedBackend
from harness.engine.attn.torch_backend import TorchBackend

# name -> factory (device, dtype) -> backend; a factory raises BackendUnavailable where it cannot run
BACKENDS: dict[str, Callable[[str, torch.dtype], AttentionBackend]] = {
    "torch": TorchBackend,
    "sglang-triton": SGLangTritonBackend,
    "sglang-unified": SGLangUnifiedBackend,
    # SGLang's TritonAttnBackend handed whole verify batches (harness/engine/attn/sglang_serving.py)
    "sglang-serving": make_serving("eagle"),
    "sglang-serving-dflash": make_serving("dflash"),
}
# the backends that take whole forwards as a server hands them over (and run SGLang's own graph state)
SERVING_BACKENDS = frozenset({"sglang-serving", "sglang-serving-dflash"})


def serves_batches(name: str) -> bool:
    """Whether backend `name` is SGLang's serving path (known without importing SGLang)."""
    return name in SERVING_BACKENDS


def make_backend(name: str, device: str, dtype: torch.dtype) -> AttentionBackend:
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; backends: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](device, dtype)


def default_backend() -> str:
    """SGLang's kernel whenever SGLang imports, else the torch backend."""
    return "sglang-triton" if sglang_triton.available() else "torch"
