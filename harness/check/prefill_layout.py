"""The prefill's metadata laid out independently of the engine's (harness/engine/ddtree/verify_inputs.py
prefill_metadata, never called here): the yardstick of the verify-inputs crash rung, which replaces the
prefill's metadata from the start of the run too (localize/stage_swap.py _independent_verify_inputs_throughout),
of the from-start "verify inputs" rerun (from_start.py), and of the cache rebuilt from the token ids
(localize/memory_rungs.py rebuild_committed), which must not share the code it judges.

What an extend of whole prompts with nothing cached gives SGLang's extend kernels (and the engine's backends,
which read the same fields): request b's query rows are the prompt's tokens, rows start_b .. start_b + len_b - 1
of the batch, in order; no request has a prefix, so no key is read through kv_indices; every row writes its K/V
to its own slot of out_cache_loc and sees its prompt's keys up to and including its own (causal: no custom mask).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.verify_inputs import AttnMetadata


def independent_prefill_metadata(prompt_lens: list[int], out_cache_loc: torch.Tensor) -> AttnMetadata:
    """A causal extend of whole prompts from their lengths and slots alone.

    prompt_lens    # [bs] each prompt's token count, >= 1
    out_cache_loc  # [sum prompt_lens] the slot each prompt row writes its K/V to, prompts in order
    """
    lens = [int(n) for n in prompt_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"a prefill extends at least one prompt of at least one token, got lengths {lens}")
    if out_cache_loc.numel() != sum(lens):
        raise ValueError(f"{out_cache_loc.numel()} slots for {sum(lens)} prompt rows")
    starts = [0]
    for n in lens:                  # request b's rows: starts[b] .. starts[b+1] - 1
        starts.append(starts[-1] + n)
    no_prefix = [0] * (len(lens) + 1)   # nothing cached: every request's prefix is empty
    return AttnMetadata(qo_indptr=torch.tensor(starts, dtype=torch.int64),             # [bs+1]
                        kv_indptr=torch.tensor(no_prefix, dtype=torch.int64),          # [bs+1]
                        kv_indices=torch.empty(0, dtype=torch.int64),                  # [0]
                        out_cache_loc=out_cache_loc,                                   # [sum lens]
                        custom_mask=None, mask_indptr=None,                            # causal
                        max_len_extend=max(lens))
