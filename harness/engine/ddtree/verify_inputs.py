"""Stage 3b, verify inputs: the target-verify metadata SGLang's Triton
backend builds (DOMAIN.md section 3), for a batch of trees.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch

from harness.engine.ddtree.mask import flat_custom_mask
from harness.engine.ddtree.tree import DraftTree


@dataclass(frozen=True)
class AttnMetadata:
    """What an attention backend reads for one extend/verify forward."""

    qo_indptr: torch.Tensor      # [bs+1] start of each request's query rows
    kv_indptr: torch.Tensor      # [bs+1] start of each request's prefix in kv_indices
    kv_indices: torch.Tensor     # [sum prefix] KV slots of the committed prefixes
    out_cache_loc: torch.Tensor  # [num_rows] slot each query row writes its K/V to
    custom_mask: torch.Tensor | None  # flat blocks, any dtype, nonzero = visible (mask.kernel_visible); None = causal
    mask_indptr: torch.Tensor | None  # [bs+1]
    max_len_extend: int
    # a host scalar bounding the prefix loop (flash-attention's max_seqlen_k, a split-KV kernel's tile
    # count): prefix keys at index >= max_kv_len are never visited; None: each request's whole prefix.
    # SGLang's Triton extend kernel takes none (it walks kv_indptr); the torch backend honours it
    max_kv_len: int | None = None
    # sliding-window layers (harness/engine/ddtree/window.py): custom_mask's blocks with the window folded in by each
    # row's position, prefix columns included; None: no window was built (the layers then read custom_mask)
    window_mask: torch.Tensor | None = None        # flat bool, laid out by window_mask_indptr
    window_mask_indptr: torch.Tensor | None = None  # [bs+1]
    # the mask's prefix columns carry visibility the backend must read (SGLang: skip_prefix_custom_mask=False)
    prefix_mask: bool = False

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    def windowed(self) -> "AttnMetadata":
        """What a sliding-window layer reads: the window mask in custom_mask's place, prefix columns on."""
        return replace(self, custom_mask=self.window_mask, mask_indptr=self.window_mask_indptr, window_mask=None,
                       window_mask_indptr=None, prefix_mask=True)

    def to(self, device: str) -> "AttnMetadata":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass(frozen=True)
class VerifyBatch:
    """One verify forward for bs requests of width q_len."""

    input_ids: torch.Tensor      # [bs*q_len] root, node tokens, padding rows
    positions: torch.Tensor      # [bs*q_len] prefix + depth
    seq_lens: torch.Tensor       # [bs] committed (cached) length per request
    req_pool_indices: torch.Tensor  # [bs] row of req_to_token
    attn: AttnMetadata
    q_len: int
    spec_info: Any = None        # a port's own verify input object (its worker built it), handed to a serving
                                 # backend's SGLang as is; None: the backend builds its own from the fields above

    def to(self, device: str) -> "VerifyBatch":
        return replace(self, input_ids=self.input_ids.to(device), positions=self.positions.to(device),
                       attn=self.attn.to(device))


MaskBuilder = Callable[[list[DraftTree], list[int]], tuple[torch.Tensor, torch.Tensor]]


def padding_row_inputs(tree: DraftTree, prefix_len: int) -> tuple[int, int]:
    """Token and position of a padding row: the root's, so its K/V duplicate the root's."""
    return tree.tokens[0], prefix_len


def build_verify_batch(trees: list[DraftTree], seq_lens: list[int], req_pool_indices: list[int],
                       req_to_token: torch.Tensor, out_cache_loc: torch.Tensor,
                       mask_builder: MaskBuilder = flat_custom_mask) -> VerifyBatch:
    """Lay out bs trees in SGLang's target-verify format.

    out_cache_loc  # [bs*q_len] freshly allocated slots, one per verify row
    """
    q_len = trees[0].q_len
    if any(t.q_len != q_len for t in trees):
        raise ValueError("every request of a verify batch has the same width q_len")
    bs = len(trees)
    ids, pos = [], []
    for tree, prefix in zip(trees, seq_lens):
        pad_tok, pad_pos = padding_row_inputs(tree, prefix)
        ids += list(tree.tokens) + [pad_tok] * tree.num_padding
        pos += [prefix + d for d in tree.depths] + [pad_pos] * tree.num_padding
    kv_indices = torch.cat([req_to_token[r, :s] for r, s in zip(req_pool_indices, seq_lens)])
    custom_mask, mask_indptr = mask_builder(trees, seq_lens)
    attn = AttnMetadata(
        qo_indptr=torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int64),
        kv_indptr=torch.cumsum(torch.tensor([0] + seq_lens, dtype=torch.int64), 0),
        kv_indices=kv_indices.to(torch.int64), out_cache_loc=out_cache_loc,
        custom_mask=custom_mask, mask_indptr=mask_indptr, max_len_extend=q_len)
    return VerifyBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                       torch.tensor(seq_lens, dtype=torch.int64),
                       torch.tensor(req_pool_indices, dtype=torch.int64), attn, q_len)


def prefill_metadata(prompt_lens: list[int], out_cache_loc: torch.Tensor) -> AttnMetadata:
    """Causal extend of whole prompts with no cached prefix."""
    lens = torch.tensor([0] + prompt_lens, dtype=torch.int64)
    bs = len(prompt_lens)
    return AttnMetadata(qo_indptr=torch.cumsum(lens, 0), kv_indptr=torch.zeros(bs + 1, dtype=torch.int64),
                        kv_indices=torch.zeros(0, dtype=torch.int64), out_cache_loc=out_cache_loc,
                        custom_mask=None, mask_indptr=None, max_len_extend=max(prompt_lens))
