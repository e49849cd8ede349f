"""DenseOracle's own contracts, on random weights; needs no transformers."""
from __future__ import annotations

import pytest
import torch

from ddschema import Oracle
from ddschema.config import ModelConfig, weight_names
from reference import DenseLlama, DenseOracle
from reference.oracle import root_path

CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, qkv_bias=True)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights, to check the oracle converts them to float64 itself."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed_tokens": (cfg.vocab_size, cfg.hidden_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size),
              "q_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "k_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
              "v_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    weights = {}
    for name in weight_names(cfg):
        module = name.split(".")[-2]
        if name.endswith("norm.weight"):
            dim = cfg.head_dim if module in ("q_norm", "k_norm") else cfg.hidden_size
            weights[name] = 1.0 + 0.2 * torch.randn(dim, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shapes[module][0], generator=gen)
        else:
            weights[name] = 0.3 * torch.randn(shapes[module], generator=gen)
    return weights


@pytest.fixture(scope="module")
def oracle() -> DenseOracle:
    return DenseOracle(CFG, random_weights(CFG))


def test_is_an_oracle(oracle):
    assert isinstance(oracle, DenseOracle)
    for method in ("tree_logits", "greedy", "path_hidden", "path_kv"):
        assert callable(getattr(oracle, method)) and hasattr(Oracle, method)


def test_missing_weight_is_rejected():
    weights = random_weights(CFG)
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError):
        DenseLlama(CFG, weights)


@pytest.mark.parametrize("tokens,parents", [
    ([1, 2], [0, 0]),       # root has a parent
    ([1, 2, 3], [-1, 2, 0]),  # parent after child
    ([1, 2, 3], [-1, 0, 2]),  # self parent
    ([1, 2], [-1, -1]),     # second root
    ([1, 2], [-1]),         # length mismatch
    ([], []),               # empty
])
def test_bad_trees_are_rejected(oracle, tokens, parents):
    with pytest.raises(ValueError):
        oracle.tree_logits([1], tokens, parents)


def test_root_path():
    tokens, parents = [10, 20, 21, 30], [-1, 0, 0, 2]
    paths = [root_path(tokens, parents, i) for i in range(4)]
    assert paths == [[10], [10, 20], [10, 21], [10, 21, 30]]


def test_tree_rows_equal_per_path_forwards(oracle):
    prefix, tokens, parents = [4, 8], [1, 2, 3, 5, 7], [-1, 0, 0, 1, 1]
    rows = oracle.tree_logits(prefix, tokens, parents)  # [5, V]
    assert rows.shape == (5, CFG.vocab_size) and rows.dtype == torch.float64
    for node in range(5):
        expected = oracle.model.forward(prefix + root_path(tokens, parents, node)).logits[-1]
        # the oracle projects only the row it reads: a [1, hidden] matmul, not bitwise the [T, hidden] one's row
        assert (rows[node] - expected).abs().max().item() <= 1e-12
    chain = oracle.tree_logits(prefix, [1, 2, 7], [-1, 0, 1])
    torch.testing.assert_close(chain, oracle.model.forward(prefix + [1, 2, 7]).logits[2:],
                               atol=1e-12, rtol=0)


def test_tree_mask_and_depth_positions_reproduce_tree_logits(oracle):
    """forward's `visible` and `positions` express one-pass tree attention."""
    prefix, tokens, parents = [4, 8], [1, 2, 3, 5, 7], [-1, 0, 0, 1, 1]
    p, n = len(prefix), len(tokens)
    visible = torch.zeros(p + n, p + n, dtype=torch.bool)  # [T, T]
    visible[:, :p] = torch.ones(p + n, p, dtype=torch.bool)
    visible[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    depth = []
    for i in range(n):
        node = i
        while node != -1:
            visible[p + i, p + node] = True
            node = parents[node]
        depth.append(0 if parents[i] == -1 else depth[parents[i]] + 1)
    positions = list(range(p)) + [p + d for d in depth]
    logits = oracle.model.forward(prefix + tokens, positions, visible).logits[p:]  # [n, V]
    torch.testing.assert_close(logits, oracle.tree_logits(prefix, tokens, parents),
                               atol=1e-10, rtol=0)


def test_greedy_is_argmax_with_nonnegative_gaps(oracle):
    prompt = [3, 1, 4, 1, 5]
    tokens, gaps = oracle.greedy(prompt, 5)
    assert len(tokens) == len(gaps) == 5 and all(g >= 0 for g in gaps)
    sequence = list(prompt)
    for token, gap in zip(tokens, gaps):
        last = oracle.model.forward(sequence).logits[-1]  # [V]
        top = torch.topk(last, 2).values
        assert token == int(last.argmax()) and gap == pytest.approx(float(top[0] - top[1]))
        sequence.append(token)
    assert oracle.greedy(prompt, 0) == ([], [])


def test_path_hidden_and_kv_shapes(oracle):
    seq = [7, 3, 9, 2]
    hiddens = oracle.path_hidden(seq)
    assert len(hiddens) == CFG.num_layers + 1
    assert all(h.shape == (CFG.hidden_size,) and h.dtype == torch.float64 for h in hiddens)
    full = oracle.model.forward(seq).hiddens
    assert all(torch.equal(h, f[-1]) for h, f in zip(hiddens, full))
    ks, vs = oracle.path_kv(seq)
    assert len(ks) == len(vs) == CFG.num_layers
    for k, v in zip(ks, vs):
        assert k.shape == v.shape == (len(seq), CFG.num_kv_heads, CFG.head_dim)
        assert k.dtype == v.dtype == torch.float64


def test_kv_of_a_prefix_is_a_prefix_of_kv(oracle):
    """Causality: K/V of the first tokens do not depend on later tokens."""
    ks_short, vs_short = oracle.path_kv([7, 3, 9])
    ks_long, vs_long = oracle.path_kv([7, 3, 9, 2, 11])
    for a, b in zip(ks_short + vs_short, ks_long + vs_long):
        torch.testing.assert_close(a, b[:3], atol=1e-12, rtol=0)
