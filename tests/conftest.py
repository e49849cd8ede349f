"""Suite-wide settings."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The models under test are tiny: intra-op threads only add contention
    (on 2 shared cores a verify step runs ~10x slower with 2 threads than 1)."""
    torch.set_num_threads(1)
    yield
