"""The oracle's shortcuts are correct by construction: a cached causal
prefix and one forward per leaf give what a fresh forward per node gives."""
import torch

from ddschema.config import ModelConfig, weight_names
import reference.judged as judged
from reference.model import DenseLlama
from reference.oracle import DenseOracle, root_path
from reference.prefix_cache import PrefixCache

CFG = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-6, max_position=256)


def weights(cfg=CFG, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed_tokens": (cfg.vocab_size, cfg.hidden_size), "lm_head": (cfg.vocab_size, cfg.hidden_size),
              "q_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "k_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
              "v_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size), "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    out = {}
    for name in weight_names(cfg):
        shape = next((s for k, s in shapes.items() if k in name), (cfg.hidden_size,))
        out[name] = (torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 0.1) + (len(shape) == 1))
    return out


PREFIX = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32]
TOKENS = [38, 4, 6, 26, 4, 33, 8, 3, 2]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 5]   # branching, depths up to 4


def per_node(model, prefix, tokens, parents):
    return torch.stack([model.forward(list(prefix) + root_path(tokens, parents, i)).logits[-1]
                        for i in range(len(tokens))])


def test_tree_logits_equal_a_fresh_forward_per_node():
    oracle = DenseOracle(CFG, weights())
    got = oracle.tree_logits(PREFIX, TOKENS, PARENTS)
    want = per_node(oracle.model, PREFIX, TOKENS, PARENTS)
    assert got.dtype == torch.float64 and got.shape == (len(TOKENS), CFG.vocab_size)
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def judged_once(monkeypatch):
    """An oracle that judged (PREFIX, TOKENS, PARENTS), and the list each later pass's packs are appended to."""
    oracle = DenseOracle(CFG, weights())
    oracle.tree_logits(PREFIX, TOKENS, PARENTS)
    calls = []
    forward_many = judged.forward_many
    monkeypatch.setattr(judged, "forward_many",
                        lambda model, packs: calls.append(packs) or forward_many(model, packs))
    return oracle, calls


def test_a_later_step_reuses_and_extends_the_cached_prefix(monkeypatch):
    oracle, calls = judged_once(monkeypatch)
    longer = [5, 7] + PREFIX                      # another prompt: no cached prefix it starts with
    got = oracle.tree_logits(longer, TOKENS, PARENTS)
    (pack,), = calls                              # one pass: the whole prefix rides in front of the tree
    assert pack.more == tuple(longer) and pack.past is None
    assert close(got, per_node(oracle.model, longer, TOKENS, PARENTS))
    calls.clear()
    off_tree = PREFIX + [5, 7]                    # commits tokens the judged tree does not hold (its root is 38)
    got = oracle.tree_logits(off_tree, TOKENS, PARENTS)
    monkeypatch.undo()
    (pack,), = calls
    assert pack.more == (5, 7) and pack.past[0][0].shape[0] == len(PREFIX)   # extends the cached prefix
    assert close(got, per_node(oracle.model, off_tree, TOKENS, PARENTS))


def close(got, want, rel=1e-12):
    return float((got - want).abs().max()) <= rel * float(want.abs().max())


def test_the_next_step_takes_the_committed_path_from_the_judged_tree(monkeypatch):
    oracle, calls = judged_once(monkeypatch)
    along = PREFIX + [38, 4, 26]                  # the accepted path root -> 1 -> 3 committed: rows judged already
    got = oracle.tree_logits(along, TOKENS, PARENTS)
    (pack,), = calls
    assert pack.more == () and pack.past[0][0].shape[0] == len(along)
    assert close(got, per_node(oracle.model, along, TOKENS, PARENTS))
    calls.clear()
    past_leaf = along + [8, 11, 2]                # 8 is node 6 (a child of 3), then tokens the tree lacks
    got = oracle.tree_logits(past_leaf, [2], [-1])
    monkeypatch.undo()
    (pack,), = calls
    assert pack.more == (11, 2) and pack.past[0][0].shape[0] == len(along) + 1
    assert close(got, per_node(oracle.model, past_leaf, [2], [-1]))


def test_a_prefix_along_a_judged_tree_has_the_causal_kv():
    model = DenseLlama(CFG, weights(seed=1))
    oracle = DenseOracle(CFG, weights(seed=1))
    oracle.tree_logits(PREFIX, TOKENS, PARENTS)
    cache = oracle.prefixes
    sibling = PREFIX + [38, 6, 33, 2]             # root -> 2 -> 5 -> 8: the other branch, to a leaf
    entry = cache.longest(sibling)
    assert entry.tokens == tuple(sibling)
    full = model.forward(sibling)
    for a, b in zip(entry.ks + entry.vs, full.ks + full.vs):
        assert close(a, b)
    assert cache.longest(sibling) is entry        # kept as an entry: derived once
    assert cache.longest(PREFIX + [38, 6, 26]).tokens == tuple(PREFIX + [38, 6])   # 26 is node 3, not 2's child


def test_cached_prefix_kv_equal_the_full_forward():
    model = DenseLlama(CFG, weights(seed=1))
    cache = PrefixCache(capacity=2)
    cache.get(model, PREFIX[:5])
    entry = cache.get(model, PREFIX)               # extends the 5-token entry
    full = model.forward(PREFIX)
    for a, b in zip(entry.ks + entry.vs, full.ks + full.vs):
        assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())
    cache.get(model, [1, 2, 3])
    assert len(cache._entries) == 2                # bounded: the oldest prefix dropped


def test_greedy_over_the_cache_equals_recomputing_the_sequence():
    oracle = DenseOracle(CFG, weights(seed=2))
    got, gaps = oracle.greedy(PREFIX, 6)
    seq, want = list(PREFIX), []
    for _ in range(6):
        last = oracle.model.forward(seq).logits[-1]
        want.append(int(last.argmax()))
        seq.append(want[-1])
    assert got == want and all(g >= 0 for g in gaps)
