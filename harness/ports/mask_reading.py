"""A port's mask the way SGLang's server hands it to the kernel.

The server computes `mask_indptr` itself (cumsum of q_len * (prefix_b +
q_len)) and the kernel reads the port's buffer through it, flat, with the
dtype and values the port handed over: nothing here reads a meaning into it.
The kernel keeps `custom_mask != 0` (harness/engine/ddtree/mask.py,
`kernel_visible`), so an additive bias (0 visible, -inf hidden) reaches it
inverted, a rectangle or a short buffer shifted or cut: exactly as in a
deployment.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.ports.protocol import PortMask


@dataclass(frozen=True)
class KernelMask:
    custom_mask: torch.Tensor   # [sum_b q_len*(prefix_b+q_len)] the port's dtype and values, what the kernel reads
    mask_indptr: torch.Tensor   # [bs+1] the server's rule
    port_numel: int             # entries the port's buffer had
    expected_numel: int
    port_dtype: torch.dtype     # the dtype the port handed over


def server_mask_indptr(q_len: int, prefix_lens: list[int]) -> torch.Tensor:
    sizes = torch.tensor([0] + [q_len * (p + q_len) for p in prefix_lens], dtype=torch.int64)
    return torch.cumsum(sizes, 0)


def kernel_mask(mask: PortMask, q_len: int, prefix_lens: list[int]) -> KernelMask:
    """The port's mask as the kernel reads it (flat, through the server's indptr).

    A `draft` layout ([bs, q, q], the draft part only, SGLang's QLEN_ONLY
    shape) is placed into each request's block with the prefix columns set
    to 1 (visible to the kernel), as SGLang's FULL_MASK builder fills them;
    the port's values keep their dtype.
    """
    data = mask.data.detach().cpu()
    if mask.layout == "draft":
        data = data.reshape(len(prefix_lens), q_len, q_len)
        blocks = []
        for b, p in enumerate(prefix_lens):
            block = torch.ones((q_len, p + q_len), dtype=data.dtype)
            block[:, p:] = data[b]
            blocks.append(block.reshape(-1))
        data = torch.cat(blocks)
    flat = data.reshape(-1)
    indptr = server_mask_indptr(q_len, prefix_lens)
    expected = int(indptr[-1])
    out = torch.zeros(expected, dtype=flat.dtype)   # a short buffer leaves keys hidden (never invented)
    n = min(expected, flat.numel())
    out[:n] = flat[:n]
    return KernelMask(out, indptr, flat.numel(), expected, mask.data.dtype)
