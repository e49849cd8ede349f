"""Suite-wide settings."""
from __future__ import annotations

import os

import pytest
import torch

# SGLang's Triton kernels run under the interpreter on a machine without CUDA,
# and TRITON_INTERPRET is read when triton is first imported; transformers
# imports triton too, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The models under test are tiny: intra-op threads only add contention
    (on 2 shared cores a verify step runs ~10x slower with 2 threads than 1)."""
    torch.set_num_threads(1)
    yield
