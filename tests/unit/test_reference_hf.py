"""reference/ against Hugging Face transformers on tiny random models.

transformers is a test-only dependency: without it this module is skipped.
Models are built locally from configs (no hub access, no downloads).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from ddschema.config import ModelConfig, weight_names
from reference import DenseLlama, DenseOracle

transformers = pytest.importorskip("transformers")

ATOL = 1e-9
SEQ = [3, 17, 42, 5, 96, 0, 11, 64, 23]

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6)


def hf_config(family: str, cfg: ModelConfig):
    """A transformers config for `cfg`.

    transformers 5.x takes RoPE settings as `rope_parameters` (4.x took a
    plain `rope_theta`); Qwen2/Qwen3 need `head_dim` explicitly (Qwen3's
    default is 128, Qwen2's config has no such field and falls back to
    hidden // heads). Qwen2's q/k/v bias is hard-wired on; Qwen3 has q/k
    norm hard-wired on.
    """
    kwargs = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_position, initializer_range=0.15,
                  tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="eager")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        kwargs["rope_theta"] = cfg.rope_theta
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}
    if family == "llama":
        kwargs["attention_bias"] = cfg.qkv_bias
    return classes[family](**kwargs)


def rope_theta_of(hf_cfg) -> float:
    params = getattr(hf_cfg, "rope_parameters", None)
    return params["rope_theta"] if params else hf_cfg.rope_theta


# Stock HF is not float64 end to end even after .double(): it computes three
# things in float32 (RoPE cos/sin, RMSNorm, attention softmax), which costs
# ~1e-6 in these logits. To compare at float64 precision the helpers below
# redo exactly those three spots in float64, same formulas, nothing else.

def float64_rope(model) -> None:
    """HF builds inv_freq and cos/sin in float32: redo its forward in float64."""
    rotary = model.model.rotary_emb
    dim = 2 * rotary.inv_freq.numel()
    theta = rope_theta_of(model.config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [d/2]

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        scale = rotary.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward


def float64_rms_norms(model) -> None:
    """HF's RMSNorm casts its input to float32: redo its forward without the cast."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def forward(x, norm=module):
                variance = x.pow(2).mean(-1, keepdim=True)
                return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))
            module.forward = forward


@contextlib.contextmanager
def float64_softmax():
    """HF's eager attention calls softmax(..., dtype=torch.float32): keep float64 inputs float64."""
    original = torch.nn.functional.softmax

    def softmax(x, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return original(x, *args, dtype=dtype, **kwargs)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


def build(family: str, seed: int = 0, exact: bool = True, **overrides):
    """(ModelConfig, HF model in float64 eval mode, its state_dict).

    Norm weights and biases are randomised (HF initialises them to 1 and 0).
    exact=True moves HF's float32 RoPE and RMSNorm to float64."""
    flags = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}[family]
    cfg = ModelConfig(**{**TINY, **flags, **overrides})
    models = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}
    torch.manual_seed(seed)
    model = models[family](hf_config(family, cfg)).double().eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    if exact:
        float64_rope(model)
        float64_rms_norms(model)
    return cfg, model, model.state_dict()


def hf_run(model, ids: list[int], exact: bool = True, **kwargs):
    """HF forward on one sequence; exact=True keeps the attention softmax float64."""
    with torch.no_grad(), (float64_softmax() if exact else contextlib.nullcontext()):
        return model(torch.tensor([ids]), **kwargs)


def hf_forward(model, ids: list[int], exact: bool = True):
    """(logits [T, V], hidden_states: num_layers + 1 tensors [T, hidden])."""
    out = hf_run(model, ids, exact, output_hidden_states=True, use_cache=False)
    return out.logits[0], [h[0] for h in out.hidden_states]


CASES = [("llama", {}), ("qwen2", {}), ("qwen3", {}),
         ("llama", {"tie_word_embeddings": True}),
         ("qwen3", {"head_dim": 24, "rope_theta": 1e6}),  # head_dim != hidden // heads
         ("llama", {"num_kv_heads": 1})]


@pytest.mark.parametrize("family,overrides", CASES)
def test_logits_match_hf(family, overrides):
    cfg, model, state = build(family, **overrides)
    assert set(weight_names(cfg)) <= set(state)
    hf_logits, _ = hf_forward(model, SEQ)
    logits, hiddens, ks, vs = DenseLlama(cfg, state).forward(SEQ)
    assert logits.dtype == torch.float64 and logits.shape == (len(SEQ), cfg.vocab_size)
    assert len(hiddens) == cfg.num_layers + 1 and len(ks) == len(vs) == cfg.num_layers
    assert ks[0].shape == (len(SEQ), cfg.num_kv_heads, cfg.head_dim)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)


def test_stock_hf_differs_only_by_its_float32_spots():
    """Stock HF is float32-close; fixing its three float32 spots makes it float64-close."""
    cfg, model, state = build("qwen2", exact=False)
    logits = DenseLlama(cfg, state).forward(SEQ).logits
    stock = hf_forward(model, SEQ, exact=False)[0]
    torch.testing.assert_close(logits, stock, atol=1e-5, rtol=0)
    assert (logits - stock).abs().max() > ATOL  # the patches below are not vacuous
    float64_rope(model)
    float64_rms_norms(model)
    torch.testing.assert_close(logits, hf_forward(model, SEQ)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hiddens_match_hf(family):
    """HF's last hidden_states entry is after the final norm; ours is before it."""
    cfg, model, state = build(family)
    _, hf_hiddens = hf_forward(model, SEQ)
    hiddens = DenseLlama(cfg, state).forward(SEQ).hiddens
    for ours, theirs in zip(hiddens[:-1], hf_hiddens[:-1]):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    normed = model.model.norm(hiddens[-1])
    torch.testing.assert_close(normed, hf_hiddens[-1], atol=ATOL, rtol=0)


def test_kv_match_hf_cache():
    """K after RoPE and V equal what HF stores in its DynamicCache."""
    cfg, model, state = build("qwen3")
    out = hf_run(model, SEQ, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in 5.x
    ks, vs = DenseOracle(cfg, state).path_kv(SEQ)
    for layer in range(cfg.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # [T, kv_heads, d]
        hf_v = cache.layers[layer].values[0].transpose(0, 1)  # [T, kv_heads, d]
        torch.testing.assert_close(ks[layer], hf_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(vs[layer], hf_v, atol=ATOL, rtol=0)


def test_positions_offset_matches_hf():
    cfg, model, state = build("qwen2")
    positions = [p + 7 for p in range(len(SEQ))]
    hf_logits = hf_run(model, SEQ, position_ids=torch.tensor([positions]),
                       use_cache=False).logits[0]
    logits = DenseLlama(cfg, state).forward(SEQ, positions=positions).logits
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def qwen3():
    """(DenseOracle, HF model) sharing one set of random weights."""
    cfg, model, state = build("qwen3", seed=1)
    return DenseOracle(cfg, state), model


def test_chain_tree_equals_one_hf_causal_forward(qwen3):
    oracle, model = qwen3
    prefix, chain = [5, 9, 33], [12, 40, 2, 77]
    rows = oracle.tree_logits(prefix, chain, [-1, 0, 1, 2])  # [n, V]
    full = hf_forward(model, prefix + chain)[0]  # [P + n, V]
    assert rows.shape == (len(chain), oracle.config.vocab_size) and rows.dtype == torch.float64
    torch.testing.assert_close(rows, full[len(prefix):], atol=ATOL, rtol=0)


def test_branching_tree_rows_are_hf_logits_of_their_own_paths(qwen3):
    oracle, model = qwen3
    prefix = [5, 9, 33]
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tokens, parents = [10, 20, 21, 30, 31, 32], [-1, 0, 0, 1, 1, 2]
    paths = [[10], [10, 20], [10, 21], [10, 20, 30], [10, 20, 31], [10, 21, 32]]
    rows = oracle.tree_logits(prefix, tokens, parents)  # [6, V]
    for node, path in enumerate(paths):
        expected = hf_forward(model, prefix + path)[0][-1]  # [V]
        torch.testing.assert_close(rows[node], expected, atol=ATOL, rtol=0)
    assert not torch.allclose(rows[3], rows[4])  # siblings differ
    assert not torch.allclose(rows[1], rows[2])


def test_greedy_matches_hf_argmax_loop(qwen3):
    oracle, model = qwen3
    tokens, gaps = oracle.greedy([5, 9, 33], 6)
    assert len(tokens) == len(gaps) == 6 and all(g >= 0 for g in gaps)
    ids = [5, 9, 33]
    for _ in range(6):  # HF argmax, whole sequence each step
        ids.append(int(hf_run(model, ids, use_cache=False).logits[0, -1].argmax()))
    assert tokens == ids[3:]
