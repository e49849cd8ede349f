"""A verify step judged in one pass (reference/packed.py, DenseOracle.prepare_step)
gives what a fresh causal forward per node gives, for every request of the
step, in float64 and in the rounded yardstick; the stream check's greedy
reads the positions the judged trees decided."""
import threading
from dataclasses import replace

import pytest
import torch

import reference.judged as judged
from reference.model import DenseLlama
from reference.oracle import DenseOracle, root_path, side_by_side
from reference.packed import packed_visibility
from tests.unit.test_oracle_prefix_reuse import CFG, PARENTS, PREFIX, TOKENS, per_node, weights

WINDOWED = replace(CFG, sliding_window=5, sliding_layers=(1,), attn_sinks=True)
STEP = [(PREFIX, TOKENS, PARENTS),                                     # branching, depths up to 4
        ([7, 1, 2, 30, 11], [5, 9, 9, 40], [-1, 0, 0, 2]),             # a second prompt, two equal siblings
        (PREFIX + [38, 4], [26, 1], [-1, 0])]                          # the first prefix, longer
NEXT_STEP = [(PREFIX + root_path(TOKENS, PARENTS, 6), [9, 2], [-1, 0]),   # a root path of 4 nodes committed
             ([7, 1, 2, 30, 11, 5, 9, 4], [8], [-1]),                  # root and a child, then a token not in it
             (PREFIX + [38, 4, 26], [3], [-1])]                        # its one-node root path


def close(got, want, rel=1e-12):
    return float((got - want).abs().max()) <= rel * float(want.abs().max())


def oracle_for(cfg):
    w = weights(cfg)
    if cfg.attn_sinks:
        w.update({f"model.layers.{i}.self_attn.sinks": torch.randn(cfg.num_heads) for i in range(cfg.num_layers)})
    return DenseOracle(cfg, w)


def test_packed_visibility_shows_each_row_its_own_path():
    mask = packed_visibility(2, [-1, 0, 0, 1])   # two committed tokens, then root, two children, a grandchild
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 0, 1, 0],
                             [1, 1, 1, 1, 0, 1]]


@pytest.mark.parametrize("threads", [1, 2], ids=["in-turn", "side-by-side"])
@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["gqa", "window-sinks"])
def test_a_prepared_step_equals_a_fresh_forward_per_node(cfg, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)   # two threads: the float64 and the rounded pass side by side (side_by_side)
    try:
        prepared_step_equals_a_fresh_forward_per_node(cfg, monkeypatch)
    finally:
        torch.set_num_threads(before)


def prepared_step_equals_a_fresh_forward_per_node(cfg, monkeypatch):
    oracle = oracle_for(cfg)
    oracle.tree_logits(PREFIX[:6], [3], [-1])               # a cached prefix the step extends
    passes, more = [], []
    forward_many = judged.forward_many
    monkeypatch.setattr(judged, "forward_many", lambda model, packs: passes.append(len(packs)) or more.append(
        [len(p.more) for p in packs]) or forward_many(model, packs))
    low = oracle.model.rounded(torch.bfloat16)
    for step in (STEP, NEXT_STEP):   # the next step commits a root path of each tree: no row computed again
        passes.clear(), more.clear()
        oracle.prepare_step(step, rounded=[("bfloat16", False)])
        got = [oracle.tree_logits(*t) for t in step]
        rounded = [oracle.rounded_tree_logits(*t, "bfloat16") for t in step]
        assert passes == [3, 3]                                  # one pass per model for the whole step
        for (prefix, tokens, parents), g, r in zip(step, got, rounded):
            assert g.shape == (len(tokens), cfg.vocab_size) and g.dtype == torch.float64
            assert close(g, per_node(oracle.model, prefix, tokens, parents))
            assert close(r, per_node(low, prefix, tokens, parents))
    assert more == [[0, 1, 0]] * 2   # the second request's prefix goes one token past its tree
    monkeypatch.undo()


def test_passes_run_side_by_side_one_thread_each_on_the_cpu():
    started = threading.Event()
    seen = []

    def first():      # returns only once the second pass has started: one after the other, it would time out
        seen.append(torch.get_num_threads())
        return started.wait(timeout=30)

    def second():
        seen.append(torch.get_num_threads())
        started.set()
        return "second"

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert side_by_side([first, second], "cpu") == [True, "second"]   # results in the passes' order
        assert seen == [1, 1] and torch.get_num_threads() == 2            # one thread each, the pool restored
        order = []
        torch.set_num_threads(1)                                          # one thread: one pass after the other
        assert side_by_side([lambda: order.append("a") or 1, lambda: order.append("b") or 2], "cpu") == [1, 2]
        assert order == ["a", "b"]
    finally:
        torch.set_num_threads(before)


def test_a_failing_pass_raises_and_leaves_the_threads_as_they_were():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ZeroDivisionError):
            side_by_side([lambda: 1, lambda: 1 / 0], "cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_unprepared_tree_is_judged_on_its_own_all_the_same():
    oracle = oracle_for(CFG)
    oracle.prepare_step(STEP[:1])
    got = oracle.tree_logits(*STEP[1])                       # not in the prepared step
    assert close(got, per_node(oracle.model, *STEP[1]))


def test_greedy_reads_the_positions_the_judged_trees_decided():
    oracle = oracle_for(CFG)
    want, _ = DenseOracle(CFG, weights()).greedy(PREFIX, 6)
    # the engine's first step: the prompt is the prefix, its first token (from prefill) the root
    tokens = [want[0], want[1], 7]                           # the greedy path, a wrong sibling last
    oracle.tree_logits(PREFIX, tokens, [-1, 0, 0])
    got, gaps = oracle.greedy(PREFIX, 6)
    assert got == want and oracle.judged_walks.hits == 3     # after the prompt (its last row), want[0], want[1]
    fresh = DenseOracle(CFG, weights()).greedy(PREFIX, 6)[1]
    assert gaps == pytest.approx(fresh, rel=1e-9)


def test_root_path_rows_see_only_their_ancestors():
    """A node's logits do not move when a sibling's token changes (the mask hides siblings)."""
    oracle = oracle_for(CFG)
    a = oracle.tree_logits(PREFIX, [38, 4, 6], [-1, 0, 0])
    b = oracle.tree_logits(PREFIX, [38, 4, 50], [-1, 0, 0])
    assert close(a[:2], b[:2]) and not close(a[2], b[2])
    assert close(a[1], oracle.model.forward(PREFIX + root_path([38, 4, 6], [-1, 0, 0], 1)).logits[-1])


@pytest.mark.parametrize("wide", [True, False], ids=["held-float64", "held-bf16"])
def test_rounded_weights_held_either_way_give_the_same_logits(wide):
    """Held as float64 once (room enough) or in bf16 and widened per use: bit for bit the same model."""
    model = DenseLlama(CFG, weights())
    held, fresh = model.rounded(torch.bfloat16), model.rounded(torch.bfloat16)
    held.hold_wide, fresh.hold_wide = wide, not wide
    a, b = held.forward(PREFIX).logits, fresh.forward(PREFIX).logits
    assert torch.equal(a, b) and not torch.equal(a, model.forward(PREFIX).logits)
    dtypes = {t.dtype for n, t in held.stored_w.items() if t is not model.w[n]}   # the rounded copies held
    assert dtypes == ({torch.float64} if wide else {torch.bfloat16})
    w = held._weight("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(w, w.to(torch.bfloat16).double())             # the values are bf16's


def test_weights_on_the_grid_are_not_copied(monkeypatch):
    """A checkpoint stored in bf16: rounding its weights to bf16 changes nothing, so the rounded model computes
    with the float64 model's own tensors (no second float64 copy, none narrow to widen per use), bit for bit
    the model it was (every weight rounded and held apart)."""
    model = DenseLlama(CFG, {n: t.to(torch.bfloat16) for n, t in weights().items()})
    shared = model.rounded(torch.bfloat16)
    a = shared.forward(PREFIX).logits
    assert shared.stored_w and all(t is model.w[n] for n, t in shared.stored_w.items())
    assert shared.hold_wide is None   # nothing rounding moves: no room for copies was ever asked for
    monkeypatch.setattr(torch, "equal", lambda x, y: False)   # every weight rounded and held apart, as before
    apart = model.rounded(torch.bfloat16)
    b = apart.forward(PREFIX).logits
    assert not any(t is model.w[n] for n, t in apart.stored_w.items())
    monkeypatch.undo()
    assert torch.equal(a, b)
