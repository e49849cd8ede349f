"""The target's own greedy continuation, for the drafter to imitate. Uses the
plain torch backend on a scratch pool: the drafter is not under test.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.mem.pool import KVPool
from harness.engine.model.llama import LlamaModel
from harness.engine.ddtree.verify_inputs import prefill_metadata


def dense_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    device = model.inv_freq.device.type
    total = len(prompt) + n
    pool = KVPool(model.cfg, total + 1, model.dtype, device)
    backend = TorchBackend(device, model.dtype)
    tokens = list(prompt)
    for _ in range(n):
        loc = torch.arange(1, len(tokens) + 1, device=device)
        meta = prefill_metadata([len(tokens)], loc).to(device)
        ids = torch.tensor(tokens, device=device)
        logits = model.forward(ids, torch.arange(len(tokens), device=device), meta, pool, backend)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]
