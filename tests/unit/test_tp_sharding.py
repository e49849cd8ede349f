"""Tensor-parallel sharding (harness/engine/tp/sharding.py, parallel_model.py): the ranks' sharded
forwards, summed and gathered as SGLang's collectives do, give the whole model's logits; KV heads are
replicated where there are fewer than ranks. The ranks run as threads over an in-process group here
(the spawned, gloo-connected ranks are tests/unit/test_tp_cli.py's)."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from ddschema import MlaConfig
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.engine.model.llama import LlamaModel
from harness.engine.model.presets import PRESETS, load_model
from harness.engine.settings import UsageError
from harness.engine.tp.parallel_model import TPLlamaModel
from harness.engine.tp.sharding import kv_heads_of_rank, kv_heads_read, shard_plan, tp_refusal
from harness.faults.tp_faults import _kv_heads_sharded


class ThreadGroup:
    """The Group's collectives between threads of one process."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier):
        self.rank, self.size, self.board, self.barrier = rank, size, board, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.barrier.wait()
        self.board[self.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.board)
        self.barrier.wait()
        return parts

    def all_reduce(self, x):
        return torch.stack(self._exchange(x)).sum(0).to(x.dtype)

    def all_gather_last(self, x):
        return torch.cat(self._exchange(x), dim=-1)


def _logits(model, cfg, prompt: list[int]) -> torch.Tensor:
    n = len(prompt)
    pool = KVPool(model.cfg, n + 1, torch.float32, "cpu")
    meta = prefill_metadata([n], torch.arange(1, n + 1))
    return model.forward(torch.tensor(prompt), torch.arange(n), meta, pool, TorchBackend("cpu", torch.float32))


def _tp_logits(name: str, tp: int, layout=kv_heads_of_rank) -> tuple[torch.Tensor, torch.Tensor]:
    cfg, weights = load_model(name.removesuffix("+o_bias"), 0)
    if name.endswith("+o_bias"):   # Llama's attention_bias: o_proj's bias must be added once, not per rank
        cfg = replace(cfg, o_bias=True)
        gen = torch.Generator().manual_seed(5)
        weights = {**weights, **{f"model.layers.{i}.self_attn.o_proj.bias": torch.randn(cfg.hidden_size, generator=gen)
                                 for i in range(cfg.num_layers)}}
    prompt = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = _logits(LlamaModel(cfg, weights, torch.float32, "cpu"), cfg, prompt)
    board, barrier, out = [None] * tp, threading.Barrier(tp), [None] * tp

    def rank(r: int) -> None:
        model = TPLlamaModel(cfg, weights, shard_plan(cfg, r, tp, layout), ThreadGroup(r, tp, board, barrier),
                             torch.float32, "cpu")
        out[r] = _logits(model, cfg, prompt)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(out[0], o) for o in out[1:])   # every rank holds the same gathered logits
    return whole, out[0]


@pytest.mark.parametrize("name,tp", [("tiny", 2), ("tiny", 4), ("tiny-qwen2", 2), ("tiny-sinks", 4),
                                     ("tiny+o_bias", 2)])
def test_sharded_ranks_give_the_whole_models_logits(name, tp):
    """Heads, MLP rows and vocabulary split; o_proj/down_proj summed, logits gathered: the whole model."""
    whole, sharded = _tp_logits(name, tp)
    assert sharded.shape == whole.shape
    torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-5)


def test_kv_heads_sharded_instead_of_replicated_changes_the_logits():
    """The fault's round-robin layout on 4 ranks over 2 KV heads: ranks 1 and 2 read another group's K/V."""
    whole, sharded = _tp_logits("tiny", 4, _kv_heads_sharded)
    assert not torch.allclose(sharded, whole, rtol=1e-3, atol=1e-3)


def test_kv_heads_replicated_where_fewer_than_ranks():
    assert [kv_heads_of_rank(r, 4, 2) for r in range(4)] == [(0,), (0,), (1,), (1,)]   # SGLang: rank // (tp / kv)
    assert [kv_heads_of_rank(r, 2, 8) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    cfg = PRESETS["tiny"]
    for r in range(4):   # each rank's KV head is the one its query heads read
        plan = shard_plan(cfg, r, 4)
        assert plan.kv_heads == kv_heads_read(cfg, plan.q_heads)
    assert shard_plan(cfg, 1, 4, _kv_heads_sharded).kv_heads != kv_heads_read(cfg, (1,))


def test_vocabulary_not_a_multiple_of_ranks_is_padded():
    cfg = replace(PRESETS["tiny"], vocab_size=127)
    plans = [shard_plan(cfg, r, 2) for r in range(2)]
    assert [p.vocab_rows for p in plans] == [(0, 64), (64, 128)]


@pytest.mark.parametrize("change,tp,words", [({}, 3, "attention heads"), ({"num_kv_heads": 6, "num_heads": 24}, 4, "KV heads"),
                                             ({"intermediate_size": 130}, 4, "intermediate size")])
def test_unshardable_models_are_refused(change, tp, words):
    cfg = replace(PRESETS["tiny"], **change)
    assert words in tp_refusal(cfg, tp)
    with pytest.raises(UsageError, match=words):
        shard_plan(cfg, 0, tp)


def test_mla_models_are_refused():
    cfg = replace(PRESETS["tiny"], num_kv_heads=4, mla=MlaConfig(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                                                                 qk_rope_head_dim=8, v_head_dim=8))
    assert "MLA" in tp_refusal(cfg, 2)
