"""The causal twin keeps each request's committed prefix between steps (a step extends it by the tokens
committed since, never a prefill of the whole prefix again; a few such tokens ride in front of every path
sequence of the step's one forward) and asks the model for the judged rows' logits only (LlamaModel.forward's
logit_rows). Its values against each node's own causal extend: tests/unit/test_oracle_step_bulk.py."""
from __future__ import annotations

import pytest
import torch

from harness.check.causal_twin import MERGE_UP_TO, CausalTwin
from harness.check.prepare import prepare
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.engine.settings import RunSettings


def test_logit_rows_are_those_rows_of_the_whole_forward():
    p = prepare(RunSettings(backend="torch", max_new_tokens=4, verdict="fixed"))
    model, backend = p.engine.model, p.engine.kernel
    ids = torch.tensor(p.prompt_ids[0][:12])

    def forward(**kw):
        pool = KVPool(model.cfg, len(ids) + 1, model.dtype, "cpu")
        meta = prefill_metadata([len(ids)], torch.arange(1, len(ids) + 1))
        return model.forward(ids, torch.arange(len(ids)), meta, pool, backend, **kw)
    full = forward()                                                    # [12, vocab]
    rows = torch.tensor([11, 3, 3, 0])
    assert torch.equal(forward(logit_rows=rows), full[rows])
    assert forward(logit_rows=torch.zeros(0, dtype=torch.int64)).shape == (0, full.shape[1])


def _twin(p, max_context: int | None = None, **kw) -> CausalTwin:
    room = p.engine.max_context + p.engine.q_len if max_context is None else max_context
    return CausalTwin(p.engine.model, p.engine.kernel, "cpu", room, **kw)


def test_the_prefix_is_extended_not_prefilled_again_and_few_new_tokens_cost_no_forward_of_their_own(monkeypatch):
    """First call: the prompt's extend, then the paths. Later calls: one forward, each path sequence led by the
    tokens committed since (merge_up_to=0: those get a forward of their own, as a long run of them does)."""
    p = prepare(RunSettings(backend="torch", topk=2, budget=8, batch=2, max_new_tokens=12, verdict="fixed"))
    merged, separate = _twin(p), _twin(p, merge_up_to=0)
    calls: list[tuple[int, int]] = []   # (tokens in, logit rows out) of each forward the twin asks for
    forward = p.engine.model.forward

    def counted(ids, positions, meta, pool, backend, hidden_out=None, logit_rows=None):
        out = forward(ids, positions, meta, pool, backend, hidden_out, logit_rows)
        calls.append((ids.numel(), out.shape[0]))
        return out
    monkeypatch.setattr(p.engine.model, "forward", counted)
    seen: dict[int, int] = {}   # request -> its prefix length last step
    merges = 0
    for result in p.engine.rounds():
        for rs in result.requests:
            tree, n = rs.tree, rs.tree.num_rows
            leaves = [i for i in range(n) if i not in {int(x) for x in tree.parents[1:n]}]
            chains = sum(len(tree.ancestors(i)) for i in leaves)
            since = len(rs.prefix) - seen.get(rs.rid, 0)
            calls.clear()
            assert merged.tree_logits(rs.prefix, tree).shape[0] == n
            if rs.rid in seen:
                assert 0 < since <= MERGE_UP_TO
                assert calls == [(len(leaves) * since + chains, n)]   # every leaf's path led by the new tokens
                merges += 1
            else:
                assert calls == [(len(rs.prefix), 0), (chains, n)]    # the prompt: K/V only, then the paths
            calls.clear()
            assert separate.tree_logits(rs.prefix, tree).shape[0] == n
            assert calls == [(since, 0), (chains, n)]
            seen[rs.rid] = len(rs.prefix)
    assert len(seen) == 2 and all(n > len(p.prompt_ids[0]) for n in seen.values()) and merges >= 4


@pytest.mark.parametrize("model", ["tiny", "tiny-deepseek-v3"])   # MLA: one latent per slot, V a view of K
def test_merged_calls_give_the_separate_extends_logits_and_keep_its_prefix(model):
    """float32, several steps of a topk-4 batch-2 run: the one-forward twin's logits (every node, and a subset
    asked first) equal those of the twin whose new tokens get a forward of their own, up to the rounding of
    other batch shapes; and the K/V it keeps for the prefix equal theirs (later steps read them). The one-forward
    twins start from a small pool: each step grows it, keeping the prefix, before the merged forward."""
    p = prepare(RunSettings(backend="torch", model=model, topk=4, budget=8, batch=2, max_new_tokens=10,
                            dtype="float32", verdict="fixed"))
    small = dict(max_context=8)
    every, some, separate = _twin(p, **small), _twin(p, **small), _twin(p, merge_up_to=0)
    steps = 0
    for result in p.engine.rounds():
        steps += 1
        for rs in result.requests:
            tree = rs.tree
            want = separate.tree_logits(rs.prefix, tree)                        # [num_rows, vocab]
            assert torch.allclose(every.tree_logits(rs.prefix, tree), want, rtol=0, atol=1e-4), (rs.step, rs.rid)
            asked = list(range(tree.num_rows - 1, 0, -2))                       # some nodes, deepest first
            assert torch.allclose(some.tree_logits(rs.prefix, tree, asked), want[asked], rtol=0, atol=1e-4)
            for twin in (every, some):
                for (k, v), (rk, rv) in zip(_kept_kv(twin, rs.prefix), _kept_kv(separate, rs.prefix)):
                    assert torch.allclose(k, rk, rtol=0, atol=1e-4), (rs.step, rs.rid)
                    assert torch.allclose(v, rv, rtol=0, atol=1e-4), (rs.step, rs.rid)
    assert steps >= 4


def _kept_kv(twin: CausalTwin, prefix, copies: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the K and V [len(prefix), ...] the twin keeps for `prefix` (`copies` kept prefixes, each of the
    whole prefix, in their own slots, the same K/V; the first's)."""
    kept = [c for c in twin.prefixes if c.tokens == tuple(prefix)]
    assert len(kept) == copies and all(c.slots.numel() == len(prefix) for c in kept)
    assert len({int(s) for c in kept for s in c.slots}) == copies * len(prefix) and int(kept[0].slots.min()) >= 1
    pool = twin.slots.pool
    for c in kept[1:]:
        assert all(torch.equal(k[c.slots], k[kept[0].slots]) for k in pool.k_buffer)
    return [(k[kept[0].slots], v[kept[0].slots]) for k, v in zip(pool.k_buffer, pool.v_buffer)]


def test_some_nodes_cost_only_their_paths_and_equal_those_rows_of_every_node():
    """tree_logits for some nodes: the rows of those nodes, in the order asked, from one sequence per node on no
    other asked node's path (float32: the same values as with every node's paths, up to the rounding of other
    batch shapes)."""
    p = prepare(RunSettings(backend="torch", topk=4, budget=8, max_new_tokens=4, dtype="float32", verdict="fixed"))
    rs = next(iter(p.engine.rounds())).requests[0]
    tree = rs.tree
    twin = _twin(p)
    every = twin.tree_logits(rs.prefix, tree)                                # [num_rows, vocab]
    parents = {int(x) for x in tree.parents[1:tree.num_rows]}
    inner = next(i for i in range(1, tree.num_rows) if i in parents)          # a node with a child
    child = next(i for i in range(1, tree.num_rows) if int(tree.parents[i]) == inner)
    asked = [child, 0, inner]
    calls = []
    forward = p.engine.model.forward
    p.engine.model.forward = lambda ids, *a, **k: calls.append(ids.numel()) or forward(ids, *a, **k)
    got = twin.tree_logits(rs.prefix, tree, asked)
    assert torch.allclose(got, every[asked], rtol=0, atol=1e-4)
    assert calls == [len(tree.ancestors(child))]   # the child's path alone covers all three
    assert twin.tree_logits(rs.prefix, tree, []).shape == (0, every.shape[1])


def test_a_steps_twins_of_every_request_are_one_forward_equal_to_each_requests_own(monkeypatch):
    """step_logits: every request's asked nodes in one forward after the first step (the prompts' extends are
    one forward too), the same logits as each request's own tree_logits (float32, up to the rounding of other
    batch shapes), every kept prefix the same K/V. A request asked twice in one step (two requests on one
    prefix) gets a copy of the kept prefix, so each extends its own."""
    p = prepare(RunSettings(backend="torch", topk=2, budget=8, batch=2, max_new_tokens=12, dtype="float32",
                            verdict="fixed"))
    together, alone = _twin(p, max_context=8), _twin(p)   # together starts small: its one pool grows
    calls: list[int] = []
    forward = p.engine.model.forward
    monkeypatch.setattr(p.engine.model, "forward", lambda ids, *a, **k: calls.append(ids.numel()) or
                        forward(ids, *a, **k))
    steps = 0
    for result in p.engine.rounds():
        rs = result.requests
        asks = [(r.prefix, r.tree, list(range(r.tree.num_rows - 1, -1, -3))) for r in rs]
        asks.append(asks[0])   # the first request asked again: its kept prefix is taken, so copied
        calls.clear()
        got = together.step_logits(asks)
        assert len(calls) == (2 if steps == 0 else 1), calls   # the prompts' extends, then the paths
        for (prefix, tree, nodes), g in zip(asks, got):
            assert torch.allclose(g, alone.tree_logits(prefix, tree, nodes), rtol=0, atol=1e-4), steps
        for j, r in enumerate(rs):
            for (k, v), (rk, rv) in zip(_kept_kv(together, r.prefix, 2 if j == 0 else 1), _kept_kv(alone, r.prefix)):
                assert torch.allclose(k, rk, rtol=0, atol=1e-4) and torch.allclose(v, rv, rtol=0, atol=1e-4)
        steps += 1
    assert steps >= 4 and together.slots.num_slots > 8
    assert len(together.prefixes) <= 4   # each request's, and a copy: each step reuses them, none piles up
