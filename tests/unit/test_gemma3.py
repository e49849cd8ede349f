"""Gemma 3's text decoder (Gemma3ForCausalLM) read on both sides, each on its
own: a tiny random checkpoint in Gemma 3's layout, written here (config.json
by hand, tensors under Gemma's names), gives the same float32 logits from the
engine's model and the oracle's, and the same as transformers' own Gemma 3;
every config key Gemma 3 reads moves the logits on both sides; what is not
implemented is refused in one line, exit 2; runs on the tiny-gemma3 preset
pass and catch a padding leak with the sliding window crossing the tree; the
trained gemma3-270m (when its package is installed, never downloaded) agrees
on both sides."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import harness.cli as cli
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.engine.model.hf_config import ModelLoadError, config_from_hf
from harness.engine.model.llama import LlamaModel
from harness.engine.model.presets import load_checkpoint as engine_load
from harness.engine.settings import RunSettings
from reference.checkpoint import CheckpointRefused, load_checkpoint as oracle_load, read_config
from reference.model import DenseLlama

cli._register()

LAYERS, HIDDEN, HEADS, KV, D, FF, VOCAB = 4, 48, 4, 2, 16, 64, 96
# transformers 5's spelling: RoPE per layer type; a window of 6 keys under a 14-token sequence
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": VOCAB,
          "hidden_size": HIDDEN, "intermediate_size": FF, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D, "rms_norm_eps": 1e-6,
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "max_position_embeddings": 256,
          "query_pre_attn_scalar": 20, "sliding_window": 6, "attn_logit_softcapping": None,
          "final_logit_softcapping": 5.0,
          "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
# transformers 4's spelling of the same model
GEMMA3_FLAT = {**{k: v for k, v in GEMMA3.items() if k != "rope_parameters"},
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None}
TOKENS = [2, 17, 40, 5, 88, 13, 61, 7, 30, 9, 72, 44, 3, 25]


def gemma3_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under Gemma 3's names (norm weights w of the (1 + w) norms around 0, not 1)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).float()
    out = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=0.3), "model.norm.weight": rand(HIDDEN, scale=0.3)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[p + norm + ".weight"] = rand(HIDDEN, scale=0.3)
        out[p + "self_attn.q_norm.weight"] = rand(D, scale=0.3)
        out[p + "self_attn.k_norm.weight"] = rand(D, scale=0.3)
        for name, rows, cols in (("q_proj", HEADS * D, HIDDEN), ("k_proj", KV * D, HIDDEN), ("v_proj", KV * D, HIDDEN),
                                 ("o_proj", HIDDEN, HEADS * D)):
            out[p + f"self_attn.{name}.weight"] = rand(rows, cols, scale=cols ** -0.5)
        for name, rows, cols in (("gate_proj", FF, HIDDEN), ("up_proj", FF, HIDDEN), ("down_proj", HIDDEN, FF)):
            out[p + f"mlp.{name}.weight"] = rand(rows, cols, scale=cols ** -0.5)
    return out


def write_gemma3(directory, hf: dict, seed: int = 0):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(gemma3_tensors(seed), str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("gemma3"), GEMMA3)


def engine_logits(directory, tokens=TOKENS) -> torch.Tensor:
    """The engine's model over `tokens` as one causal extend (float32, torch backend): logits  # [T, V]."""
    cfg, weights = engine_load(directory)
    model = LlamaModel(cfg, weights, torch.float32, "cpu")
    n = len(tokens)
    pool = KVPool(cfg, n + 1, torch.float32, "cpu")
    meta = prefill_metadata([n], torch.arange(1, n + 1))
    return model.forward(torch.tensor(tokens), torch.arange(n), meta, pool, TorchBackend("cpu", torch.float32))


def oracle_logits(directory, tokens=TOKENS) -> torch.Tensor:
    cfg, weights = oracle_load(directory)
    return DenseLlama(cfg, weights, owned=True).forward(tokens).logits   # [T, V] float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# -- the reading on both sides ----------------------------------------------------------------

@pytest.mark.parametrize("hf", [GEMMA3, GEMMA3_FLAT], ids=["rope_parameters", "rope_local_base_freq"])
def test_both_sides_read_gemma3_alike(hf):
    engine, oracle = config_from_hf(hf), read_config(hf)
    assert engine == oracle
    assert (engine.sliding_window, engine.sliding_layers) == (6, (0, 1, 2))
    assert (engine.rope_theta, engine.rope_local_theta) == (1e6, 1e4)
    assert engine.norm_plus_one and engine.sandwich_norms and engine.qk_norm and engine.tie_word_embeddings
    assert (engine.hidden_act, engine.query_pre_attn_scalar, engine.final_logit_softcap) == ("gelu_pytorch_tanh", 20, 5)
    assert engine.embed_scale == HIDDEN ** 0.5


def test_sliding_window_pattern_places_the_full_layers_alike():
    """Without layer_types, every N-th layer is full (transformers' sliding_window_pattern)."""
    hf = {**{k: v for k, v in GEMMA3.items() if k != "layer_types"}, "sliding_window_pattern": 2}
    assert config_from_hf(hf).sliding_layers == read_config(hf).sliding_layers == (0, 2)


def test_engine_and_oracle_logits_agree_in_float32(ckpt):
    engine, oracle = engine_logits(ckpt), oracle_logits(ckpt)
    assert rel(engine, oracle) < 1e-5


def test_the_oracle_matches_transformers_gemma3(ckpt):
    """A third reading: transformers' Gemma3ForCausalLM (eager attention) on the same files."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                              attn_implementation="eager")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        theirs = model(torch.tensor([TOKENS])).logits[0]   # [T, V] float32
    assert rel(theirs, oracle_logits(ckpt)) < 1e-5


# each key Gemma 3 reads, changed: (key path, new value); both sides must move, and still agree
FLIPS = {
    "rope_local_base_freq": (("rope_parameters", "sliding_attention", "rope_theta"), 500.0),
    "rope_theta (full layers)": (("rope_parameters", "full_attention", "rope_theta"), 50.0),
    "query_pre_attn_scalar": (("query_pre_attn_scalar",), 4),
    "sliding_window": (("sliding_window",), 3),
    "layer_types": (("layer_types",), ["full_attention"] * 2 + ["sliding_attention"] * 2),
    "final_logit_softcapping": (("final_logit_softcapping",), 1.0),
    "final_logit_softcapping off": (("final_logit_softcapping",), None),
    "attn_logit_softcapping": (("attn_logit_softcapping",), 0.5),
    "hidden_activation": (("hidden_activation",), "silu"),
    "rms_norm_eps": (("rms_norm_eps",), 0.5),
}


def flipped(hf: dict, path: tuple[str, ...], value) -> dict:
    out = json.loads(json.dumps(hf))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("name", FLIPS)
def test_each_gemma3_key_moves_the_logits_on_both_sides(ckpt, tmp_path, name):
    path, value = FLIPS[name]
    other = write_gemma3(tmp_path / "flipped", flipped(GEMMA3, path, value))
    base_e, base_o = engine_logits(ckpt), oracle_logits(ckpt)
    new_e, new_o = engine_logits(other), oracle_logits(other)
    assert rel(new_e, base_e) > 1e-3, f"the engine ignores {name}"
    assert rel(new_o, base_o) > 1e-3, f"the oracle ignores {name}"
    assert rel(new_e, new_o) < 1e-5


def test_the_flat_spelling_gives_the_same_logits(ckpt, tmp_path):
    flat = write_gemma3(tmp_path / "flat", GEMMA3_FLAT)
    assert rel(engine_logits(flat), engine_logits(ckpt)) == 0.0
    assert rel(oracle_logits(flat), oracle_logits(ckpt)) == 0.0


# -- refusals ---------------------------------------------------------------------------------

REFUSED = {
    "linear rope on full layers": flipped(GEMMA3, ("rope_parameters", "full_attention"),
                                          {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}),
    "linear rope (4.x spelling)": {**GEMMA3_FLAT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "exact gelu": {**GEMMA3, "hidden_activation": "gelu"},
    "bidirectional": {**GEMMA3, "use_bidirectional_attention": True},
    "chunked layer": {**GEMMA3, "layer_types": ["chunked_attention"] + GEMMA3["layer_types"][1:]},
    "window null": {**GEMMA3, "sliding_window": None},
    "softcap not a number": {**GEMMA3, "final_logit_softcapping": "30"},
}


@pytest.mark.parametrize("name", REFUSED)
def test_both_sides_refuse_what_they_do_not_implement(name):
    with pytest.raises(ModelLoadError):
        config_from_hf(REFUSED[name])
    with pytest.raises(CheckpointRefused):
        read_config(REFUSED[name])


@pytest.mark.parametrize("name", ["linear rope on full layers", "bidirectional"])
def test_a_refused_gemma3_checkpoint_is_one_line_exit_2(tmp_path, name):
    directory = write_gemma3(tmp_path / "ckpt", REFUSED[name])
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli.app, ["run", "--model", str(directory), "--backend", "torch", "--out", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error:") and "not supported" in lines[0]
    assert not out.exists()


# -- runs on the preset: the window (8 keys) crosses the tree (prompts of 5 to 23 tokens) ----------

def run(**kw):
    s = RunSettings(model="tiny-gemma3", max_new_tokens=kw.pop("max_new_tokens", 10), **kw)
    return check(prepare(s), RecordWriter(None))


def test_a_run_on_the_gemma3_preset_passes_in_float32():
    summary = run(backend="torch", topk=2, batch=2)
    assert summary.passed and summary.nodes_checked > 0 and summary.prefix_len_max > 8


def test_a_padding_leak_is_caught_on_the_gemma3_preset():
    summary = run(backend="torch", budget=16, topk=1, fault="padded-kv-visible")
    assert not summary.passed and summary.divergent_nodes > 0


@pytest.mark.sglang
def test_sglang_triton_on_the_gemma3_preset_passes():
    summary = run(backend="sglang-triton", budget=8, topk=2, max_new_tokens=6)
    assert summary.passed and summary.nodes_checked > 0


# -- the trained model, when its package is installed -------------------------------------------

def test_gemma3_270m_agrees_on_both_sides(tmp_path_factory):
    """The trained Gemma 3 270M (Q4_K_M, dequantized), read by each side on its own: float32
    logits over a prompt agree, and both continue 'The capital of France is' alike."""
    from harness.engine.model import named
    entry = named.REGISTRY["gemma3-270m"]
    if named.sources(entry) is None and not named.cache_dir(entry).exists():
        pytest.skip(f"{entry.package} is not installed ({entry.install_hint}); tests never download")
    try:
        path = named.materialize(entry, log=lambda line: None)
    except named.ModelLoadError:
        env = {**os.environ, "DDCHECK_CACHE": str(tmp_path_factory.mktemp("cache"))}
        path = named.materialize(entry, environ=env, log=lambda line: None)
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode("The capital of France is").ids
    engine, oracle = engine_logits(path, ids), oracle_logits(path, ids)
    assert rel(engine, oracle) < 1e-4
    assert int(engine[-1].argmax()) == int(oracle[-1].argmax())
