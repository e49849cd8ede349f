"""Read a port's mask the way SGLang's server hands it to the kernel.

The server computes `mask_indptr` itself (cumsum of q_len * (prefix_b +
q_len)) and the kernel reads the port's buffer through it, flat. A mask laid
out any other way (a rectangle, a short buffer) therefore reaches the kernel
shifted or cut, exactly as in a deployment: nothing here repairs it.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.ports.protocol import PortMask

ADDITIVE_VISIBLE_ABOVE = -1.0   # additive masks: 0 visible; hidden values are -1e4 .. -inf


@dataclass(frozen=True)
class KernelMask:
    custom_mask: torch.Tensor   # [sum_b q_len*(prefix_b+q_len)] bool, what the kernel reads
    mask_indptr: torch.Tensor   # [bs+1] the server's rule
    port_numel: int             # entries the port's buffer had
    expected_numel: int


def allow_bits(mask: PortMask) -> torch.Tensor:
    """bool, same shape as the port's mask: True = the port means 'visible'."""
    d = mask.data
    if mask.meaning == "allow":
        return d.bool() if d.dtype == torch.bool else d != 0
    if mask.meaning == "nonzero":
        return d != 0
    return d.float() > ADDITIVE_VISIBLE_ABOVE   # additive


def server_mask_indptr(q_len: int, prefix_lens: list[int]) -> torch.Tensor:
    sizes = torch.tensor([0] + [q_len * (p + q_len) for p in prefix_lens], dtype=torch.int64)
    return torch.cumsum(sizes, 0)


def kernel_mask(mask: PortMask, q_len: int, prefix_lens: list[int]) -> KernelMask:
    """The port's mask as the kernel reads it (flat, through the server's indptr).

    A `draft` layout ([bs, q, q], the draft part only, SGLang's QLEN_ONLY
    shape) is placed into each request's block with the prefix columns
    visible, as SGLang's FULL_MASK builder fills them.
    """
    bits = allow_bits(mask)
    if mask.layout == "draft":
        bits = bits.reshape(len(prefix_lens), q_len, q_len)
        blocks = []
        for b, p in enumerate(prefix_lens):
            block = torch.ones((q_len, p + q_len), dtype=torch.bool)
            block[:, p:] = bits[b]
            blocks.append(block.reshape(-1))
        bits = torch.cat(blocks)
    flat = bits.reshape(-1).cpu()
    indptr = server_mask_indptr(q_len, prefix_lens)
    expected = int(indptr[-1])
    out = torch.zeros(expected, dtype=torch.bool)   # a short buffer leaves keys hidden (never invented)
    n = min(expected, flat.numel())
    out[:n] = flat[:n]
    return KernelMask(out, indptr, flat.numel(), expected)
