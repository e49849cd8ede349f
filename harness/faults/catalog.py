"""The fault catalog (DOMAIN.md section 4)."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.faults.registry import Fault, has_padding, register
from harness.spec.mask import request_mask_block
from harness.spec.tree import DraftTree


def _mask_padding_visible(trees: list[DraftTree], prefix_lens: list[int]):
    """Real rows also see every padding row's column (the seed's bug)."""
    blocks = []
    for t, p in zip(trees, prefix_lens):
        block = request_mask_block(t, p)
        block[:t.num_rows, p + t.num_rows:] = True
        blocks.append(block.reshape(-1))
    sizes = torch.tensor([0] + [b.numel() for b in blocks])
    return torch.cat(blocks), torch.cumsum(sizes, 0)


register(Fault(
    name="padded-kv-visible",
    breaks="padding columns left visible to real rows: real nodes attend to padded KV slots",
    shows_when="padding rows (actual < budget, e.g. --budget 16 --topk 1)",
    expected_class="padding-leak",
    apply=lambda p: replace(p, build_mask=_mask_padding_visible),
    can_show=has_padding,
))
