"""The causal twin keeps each request's committed prefix between steps (a step extends it by the tokens
committed since, never a prefill of the whole prefix again) and asks the model for the judged rows' logits
only (LlamaModel.forward's logit_rows). Its values against each node's own causal extend:
tests/unit/test_oracle_step_bulk.py."""
from __future__ import annotations

import torch

from harness.check.causal_twin import CausalTwin
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


def test_the_prefix_is_extended_not_prefilled_again(monkeypatch):
    p = prepare(RunSettings(backend="torch", topk=2, budget=8, batch=2, max_new_tokens=12, verdict="fixed"))
    twin = CausalTwin(p.engine.model, p.engine.kernel, "cpu", p.engine.max_context + p.engine.q_len)
    calls: list[tuple[int, int]] = []   # (tokens in, logit rows out) of each forward the twin asks for
    forward = p.engine.model.forward

    def counted(ids, positions, meta, pool, backend, hidden_out=None, logit_rows=None):
        out = forward(ids, positions, meta, pool, backend, hidden_out, logit_rows)
        calls.append((ids.numel(), out.shape[0]))
        return out
    monkeypatch.setattr(p.engine.model, "forward", counted)
    seen: dict[int, int] = {}   # request -> its prefix length last step
    for result in p.engine.rounds():
        for rs in result.requests:
            calls.clear()
            got = twin.tree_logits(rs.prefix, rs.tree)
            assert got.shape[0] == rs.tree.num_rows
            (prefix_in, prefix_rows), (_, tree_rows) = calls
            assert prefix_in == len(rs.prefix) - seen.get(rs.rid, 0) and prefix_rows == 0
            assert tree_rows == rs.tree.num_rows
            seen[rs.rid] = len(rs.prefix)
    assert len(seen) == 2 and all(n > len(p.prompt_ids[0]) for n in seen.values())


def test_some_nodes_cost_only_their_paths_and_equal_those_rows_of_every_node():
    """tree_logits for some nodes: the rows of those nodes, in the order asked, from one sequence per node on no
    other asked node's path (float32: the same values as with every node's paths, up to the rounding of other
    batch shapes)."""
    p = prepare(RunSettings(backend="torch", topk=4, budget=8, max_new_tokens=4, dtype="float32", verdict="fixed"))
    rs = next(iter(p.engine.rounds())).requests[0]
    tree = rs.tree
    twin = CausalTwin(p.engine.model, p.engine.kernel, "cpu", p.engine.max_context + p.engine.q_len)
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
