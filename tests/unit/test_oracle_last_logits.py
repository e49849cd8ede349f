"""The oracle's output projection only where logits are read: one row, equal to the full forward's last."""
from __future__ import annotations

import torch

from reference import DenseLlama
from tests.unit.test_reference_oracle import CFG, random_weights

SEQ = [3, 17, 42, 5, 33, 0, 11]


def test_last_logits_only_is_the_full_forwards_last_row():
    model = DenseLlama(CFG, random_weights(CFG))
    full = model.forward(SEQ).logits  # [T, V]
    last = model.forward(SEQ, last_logits_only=True).logits  # [1, V]
    assert last.shape == (1, CFG.vocab_size)
    assert (last[0] - full[-1]).abs().max().item() <= 1e-12
