"""A measured quantity that is not what SGLang's rules (or the eager batch,
or the oracle) say it should be, with the pipeline stage that produced it.
The localizer collects these every round; the first one, in step order then
pipeline order, is what the explanation leads with.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the verify pipeline in the order a round runs it (harness/engine/loop.py)
STAGES = ("build_tree", "build_mask", "build_verify_batch", "graph", "attention", "model", "accept", "commit",
          "allocation")
# the stages in the domain's words, as the explanation, the summary and the records name them
STAGE_WORDS = {"build_tree": "tree build", "build_mask": "mask", "build_verify_batch": "verify inputs",
               "graph": "graph", "attention": "attention", "model": "model", "accept": "accept", "commit": "commit",
               # the allocator and the rows' placement, which serve the prefill, each round and its commit: named by
               # a crash's proof by replacement (localize/memory_rungs.py), after every stage it serves
               "allocation": "KV allocation"}
# within a stage, the order quantities are reported in (the prefix lengths first: positions and indptrs derive from them)
QUANTITIES = ("tree", "seq_lens", "input_ids", "positions", "qo_indptr", "kv_indptr", "kv_indices", "max_kv_len", "mask_indptr",
              "custom_mask", "window_mask", "out_cache_loc", "visibility", "sinks", "logit_cap", "attention_output", "hidden", "kv_cache",
              "accepted_rows", "bonus", "emitted", "seq_len", "req_to_token", "free_slots")


# what the backend computes from visible keys (not from the metadata): wrong on any batch
ARITHMETIC = ("sinks", "logit_cap", "attention_output")


@dataclass(frozen=True)
class Wrong:
    step: int
    stage: str            # one of STAGES
    quantity: str         # one of QUANTITIES
    request: int | None   # request id (None: batch-wide)
    index: int | None     # first wrong element / row / layer (None: the whole value)
    expected: object      # JSON-able excerpt of what the rule gives
    found: object         # the same excerpt of what the stage produced
    count: int            # wrong elements (or rows, pairs)
    text: str             # one sentence in the domain's words
    hint: str = ""        # a pattern a catalog rule may match (e.g. "row-index", "rectangle"); not shown

    def order(self) -> tuple[int, int, int]:
        # the backend's arithmetic is wrong on any batch, the prefill's included: it ranks first
        if self.quantity in ARITHMETIC:
            return (-1, STAGES.index(self.stage), 0)
        # the cached K/V is read back after the round's commit: a committed prefix position (hint "prefix")
        # was written before the round, by the prefill or an earlier round; a new one ranks after every stage
        stage = STAGES.index(self.stage)
        if self.quantity == "kv_cache":
            stage = -1 if self.hint == "prefix" else len(STAGES)
        return (self.step, stage, QUANTITIES.index(self.quantity))

    def to_record(self) -> dict:
        return {"step": self.step, "stage": STAGE_WORDS[self.stage], "quantity": self.quantity, "request": self.request,
                "index": self.index, "expected": self.expected, "found": self.found, "count": self.count,
                "text": self.text}


def first_wrong(found: list[Wrong]) -> Wrong | None:
    return min(found, key=Wrong.order) if found else None


def excerpt(expected: torch.Tensor | list, found: torch.Tensor | list, width: int = 8) -> tuple[int | None, list, list, int]:
    """(first differing index, expected[i:i+width], found[i:i+width], differing count) of two 1-D
    sequences; a length difference counts from the shorter one's end."""
    e = expected.tolist() if isinstance(expected, torch.Tensor) else list(expected)
    f = found.tolist() if isinstance(found, torch.Tensor) else list(found)
    n = min(len(e), len(f))
    bad = [i for i in range(n) if e[i] != f[i]] + list(range(n, max(len(e), len(f))))
    if not bad:
        return None, [], [], 0
    i = bad[0]
    return i, e[i:i + width], f[i:i + width], len(bad)
