"""A small serving-state double with SGLang's real names and signatures, for
running a port's own commit code on ddcheck's KV pool and req_to_token.

What a DDTree commit touches in SGLang: `req_to_token_pool.req_to_token`
([max_reqs, max_context] slot table), `token_to_kv_pool_allocator.free(idx)`,
`token_to_kv_pool.get_key_buffer(layer_id)` / `get_value_buffer(layer_id)` /
`set_kv_buffer(layer, loc, cache_k, cache_v)` / `move_kv_cache(tgt, src)`,
and the batch's `req_pool_indices`, `seq_lens` and `out_cache_loc`. Every
call is recorded, so the audit can say what the port kept, freed and moved.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.engine.mem.pool import KVPool, ReqToTokenPool


def _layer_id(layer) -> int:
    """SGLang passes a RadixAttention (with .layer_id) or an int."""
    return int(getattr(layer, "layer_id", layer))


class TokenToKVPool:
    def __init__(self, pool: KVPool, moves: list[tuple[int, int]]) -> None:
        self._pool, self._moves = pool, moves

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        return self._pool.k_buffer[_layer_id(layer_id)]

    def get_value_buffer(self, layer_id) -> torch.Tensor:
        return self._pool.v_buffer[_layer_id(layer_id)]

    def get_kv_buffer(self, layer_id) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None) -> None:
        # values, as SGLang's store kernel reads them (a port may pass views of the pool itself)
        self._pool.set_kv(_layer_id(layer), loc, cache_k.clone(), cache_v.clone())

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy every layer's K/V from src_loc to tgt_loc."""
        tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
        self._moves.extend(zip(src.tolist(), tgt.tolist()))
        self._pool.provenance.move(tgt, src)
        for kb, vb in zip(self._pool.k_buffer, self._pool.v_buffer):
            kb[tgt.to(kb.device)] = kb[src.to(kb.device)].clone()
            vb[tgt.to(vb.device)] = vb[src.to(vb.device)].clone()

    @property
    def layer_num(self) -> int:
        return len(self._pool.k_buffer)


class TokenToKVPoolAllocator:
    def __init__(self, pool: KVPool, freed: list[int]) -> None:
        self._alloc, self._freed = pool.allocator, freed

    def free(self, free_index: torch.Tensor) -> None:
        idx = free_index.reshape(-1).long().cpu()
        self._freed.extend(idx.tolist())
        self._alloc.free(idx)


@dataclass
class ServingState:
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    req_pool_indices: torch.Tensor   # [bs]
    seq_lens: torch.Tensor           # [bs] committed lengths before the commit
    out_cache_loc: torch.Tensor      # [bs*q_len] the verify rows' slots
    freed: list[int] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, req_pool: ReqToTokenPool, pool: KVPool, req_pool_indices: list[int], seq_lens: list[int],
           out_cache_loc: torch.Tensor) -> "ServingState":
        freed: list[int] = []
        moves: list[tuple[int, int]] = []
        return cls(req_pool, TokenToKVPool(pool, moves), TokenToKVPoolAllocator(pool, freed),
                   torch.tensor(req_pool_indices, dtype=torch.int64), torch.tensor(seq_lens, dtype=torch.int64),
                   out_cache_loc, freed, moves)
