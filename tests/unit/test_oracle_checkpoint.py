"""The oracle reads checkpoints on its own (reference/checkpoint.py), and a
run checks the engine's loader against that reading: against transformers on
checkpoints that set rope parameters, tied embeddings and attention biases;
planted loader bugs in the harness come out as "config" / "weights"."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ddschema import RopeScaling, weight_names
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.engine.model import presets
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from reference import DenseOracle
from reference.checkpoint import read_safetensors
from reference.rope import rope_inv_freq

transformers = pytest.importorskip("transformers")
from tests.unit.test_reference_hf import float64_rms_norms, float64_softmax  # noqa: E402

SEQ = [3, 17, 42, 5, 96, 0, 11, 64, 23]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15)
# (family, extra config): each sets something a loader can get wrong
CHECKPOINTS = {
    "llama-bias-tied-llama3": ("llama", dict(attention_bias=True, tie_word_embeddings=True,
                                             rope_parameters={**LLAMA3, "rope_theta": 1e4})),
    "llama-theta": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
}


def hf_checkpoint(directory, name: str, seed: int = 0):
    """A transformers model written with save_pretrained (float64 on disk, so
    the tensors compare exactly); norms and biases randomised."""
    family, extra = CHECKPOINTS[name]
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = classes[1](classes[0](**SHAPE, **extra, attn_implementation="eager")).double().eval()
    with torch.no_grad():
        for pname, tensor in model.named_parameters():
            if pname.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif pname.endswith("bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(directory)
    return model


def hf_logits(model, ids, positions):
    float64_rms_norms(model)
    with torch.no_grad(), float64_softmax():
        return model(torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=False).logits[0]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_oracle_reads_what_transformers_wrote(tmp_path, name):
    """Every tensor transformers computes with, bit for bit, and the config
    flags it implies (o_proj bias, tied head, llama3 scaling)."""
    model = hf_checkpoint(tmp_path, name)
    oracle = DenseOracle.from_checkpoint(tmp_path)
    cfg, hf_cfg = oracle.config, model.config
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.o_bias == bool(getattr(hf_cfg, "attention_bias", False))
    assert cfg.qkv_bias == (cfg.o_bias or name.startswith("qwen2"))
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert (cfg.rope_scaling is not None) == ("llama3" in name)
    state = model.state_dict()
    for n in weight_names(cfg) + ["lm_head.weight"]:
        assert torch.equal(oracle.weight(n), state[n]), n
    assert set(state) - set(weight_names(cfg)) <= {"lm_head.weight"}  # nothing transformers uses is left out


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_oracle_logits_match_transformers_from_the_checkpoint(tmp_path, name):
    """Positions past original_max_position make RoPE scaling matter
    (contiguous: transformers reads a jump in position_ids as a new packed
    sequence). HF builds inv_freq and cos/sin in float32 (relative 1e-7 of an
    angle of 60 radians), so the comparison is at 2e-6 of the logit scale;
    the scaling itself moves logits by far more (checked below)."""
    model = hf_checkpoint(tmp_path, name)
    oracle = DenseOracle.from_checkpoint(tmp_path)
    positions = [60 + i for i in range(len(SEQ))]
    ours = oracle.model.forward(SEQ, positions=positions).logits  # [T, V]
    theirs = hf_logits(model, SEQ, positions)
    torch.testing.assert_close(ours, theirs, atol=2e-6 * float(theirs.abs().max()), rtol=0)
    if oracle.config.rope_scaling is not None:
        plain = dataclasses.replace(oracle.config, rope_scaling=None)
        unscaled = DenseOracle(plain, {n: oracle.weight(n) for n in weight_names(plain)})
        assert (unscaled.model.forward(SEQ, positions=positions).logits - theirs).abs().max() > 1e-2


def test_llama3_frequencies_match_transformers_on_both_sides(tmp_path):
    """The oracle's and the engine's llama3 inverse frequencies against
    transformers' (float32), across the three bands."""
    from harness.engine.model.llama import rope_frequencies
    model = hf_checkpoint(tmp_path, "llama-bias-tied-llama3")
    hf_inv = model.model.rotary_emb.inv_freq.double()  # [d/2]
    cfg = DenseOracle.from_checkpoint(tmp_path).config
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    bands = (scaled / plain).tolist()
    assert bands[0] == 1.0 and bands[-1] == 1.0 / 8.0 and any(1 / 8 < b < 1 for b in bands)
    torch.testing.assert_close(scaled, hf_inv, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_frequencies(presets.config_from_hf(json.loads((tmp_path / "config.json")
                                                                                  .read_text()))), hf_inv,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_own_safetensors_reader_agrees_with_the_library(tmp_path, dtype):
    tensors = {"a": torch.randn(3, 5).to(dtype), "b.bias": torch.randn(7).to(dtype)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    got = read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == set(tensors)
    for n, t in tensors.items():
        assert got[n].dtype == torch.float64 and torch.equal(got[n], t.double())


@pytest.mark.parametrize("name", ["llama-bias-tied-llama3", "qwen3-bias"])
def test_a_run_on_a_transformers_checkpoint_passes(tmp_path, name):
    """Engine (float32) against the oracle on the checkpoint: the loaders
    agree and every node matches."""
    hf_checkpoint(tmp_path, name)
    s = RunSettings(budget=6, topk=2, max_new_tokens=6, backend="torch", model=str(tmp_path))
    summary = check(prepare(s), RecordWriter(None))
    assert summary.passed and summary.load_mismatches == 0 and summary.nodes_checked > 0, summary.first


def run_with(monkeypatch, tmp_path, name, **patch):
    for attr, fn in patch.items():
        monkeypatch.setattr(presets, attr, fn)
    s = RunSettings(budget=6, topk=2, max_new_tokens=6, backend="torch", model=str(tmp_path))
    writer = RecordWriter(None)
    return check(prepare(s), writer), [json.loads(line) for line in writer.lines]


def test_loader_ignoring_rope_scaling_is_a_config_divergence(monkeypatch, tmp_path):
    hf_checkpoint(tmp_path, "llama-bias-tied-llama3")
    original = presets.config_from_hf
    summary, records = run_with(monkeypatch, tmp_path, "llama-bias-tied-llama3",
                                config_from_hf=lambda hf: dataclasses.replace(original(hf), rope_scaling=None))
    assert not summary.passed and summary.first.what == "config" and summary.steps == 0
    assert summary.fault_class == "config" and "rope_scaling" in summary.explanation
    load = [r for r in records if r["kind"] == "load"]
    assert [r["key"] for r in load] == ["rope_scaling"] and load[0]["verdict"] == "diverge"


def test_loader_flipping_the_tied_default_is_a_config_divergence(monkeypatch, tmp_path):
    """A checkpoint that does not say tie_word_embeddings (HF default: untied)
    read by a loader whose default is tied."""
    hf_checkpoint(tmp_path, "llama-theta")
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("tie_word_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(data))
    original = presets.config_from_hf
    summary, records = run_with(monkeypatch, tmp_path, "llama-theta",
                                config_from_hf=lambda hf: original({"tie_word_embeddings": True, **hf}))
    assert summary.first.what == "config" and "tie_word_embeddings" in summary.explanation
    keys = [r["key"] for r in records if r["kind"] == "load"]
    assert keys == ["tie_word_embeddings", "lm_head.weight"]  # and the head it multiplies by differs


def test_loader_rounding_a_tensor_is_a_weights_divergence(monkeypatch, tmp_path):
    hf_checkpoint(tmp_path, "qwen3-bias")
    original = presets.load_checkpoint
    target = "model.layers.1.self_attn.o_proj.bias"

    def lossy(path):
        cfg, weights = original(path)
        return cfg, {**weights, target: weights[target].bfloat16().float()}

    monkeypatch.setattr("harness.check.prepare.load_checkpoint", lossy)
    summary, records = run_with(monkeypatch, tmp_path, "qwen3-bias")
    assert summary.first.what == "weights" and summary.fault_class == "weights"
    assert target in summary.explanation
    assert [r["key"] for r in records if r["kind"] == "load"] == [target]


def test_loader_dropping_the_o_bias_is_caught_on_the_cli(monkeypatch, tmp_path):
    """`ddcheck run --model DIR` with a loader that drops Llama's o_proj bias: exit 1, load records."""
    from harness.cli import _register, app
    _register()
    hf_checkpoint(tmp_path / "ckpt", "llama-bias-tied-llama3")
    original = presets.config_from_hf
    monkeypatch.setattr(presets, "config_from_hf", lambda hf: dataclasses.replace(original(hf), o_bias=False))
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", str(tmp_path / "ckpt"), "--backend", "torch",
                                      "--budget", "4", "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in records if r["kind"] == "load"][:2] == ["o_bias", "model.layers.0.self_attn.o_proj.bias"]
    assert records[-1]["kind"] == "summary" and records[-1]["first"]["what"] == "config"
    assert "loader" in result.output


def test_presets_are_read_from_disk_by_the_oracle(monkeypatch):
    """A preset run hands the oracle a directory, never the harness's tensors."""
    seen = []
    original = DenseOracle.from_checkpoint.__func__

    def spy(cls, directory, **options):
        seen.append(sorted(p.name for p in directory.iterdir()))
        return original(cls, directory, **options)

    monkeypatch.setattr(DenseOracle, "from_checkpoint", classmethod(spy))
    p = prepare(RunSettings(model="tiny-qwen2", backend="torch", max_new_tokens=2))
    assert seen == [["config.json", "model.safetensors"]] and p.load_mismatches == ()
    assert p.oracle.config == presets.PRESETS["tiny-qwen2"]


def test_rope_scaling_invariants():
    with pytest.raises(ValueError):
        RopeScaling("llama3", 8.0, 4.0, 1.0, 32)
    with pytest.raises(ValueError):
        RopeScaling("yarn", 8.0, 1.0, 4.0, 32)


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    from reference.checkpoint import CheckpointRefused
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "x.safetensors"))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointRefused, match="past the end"):
        read_safetensors(tmp_path / "x.safetensors")


def test_the_oracle_keeps_its_own_reading_without_a_copy_and_copies_anyone_elses(tmp_path):
    """from_checkpoint hands the oracle tensors no one else holds (kept as read);
    weights handed in by a caller are copied, so the caller cannot change them."""
    cfg = presets.PRESETS["tiny"]
    d = presets.write_checkpoint(tmp_path / "ck", cfg, presets.random_weights(cfg, 0))
    own = DenseOracle.from_checkpoint(d)
    config, weights = __import__("reference.checkpoint", fromlist=["load_checkpoint"]).load_checkpoint(d)
    given = DenseOracle(config, weights)
    name = "model.layers.0.mlp.up_proj.weight"
    assert given.weight(name).data_ptr() != weights[name].data_ptr()
    before = given.weight(name).clone()
    weights[name].add_(1.0)                                   # the caller's tensor changes...
    assert torch.equal(given.weight(name), before)            # ...the oracle's does not
    assert torch.equal(own.weight(name), before)              # and its own reading is the same model
    prefix, tokens, parents = [3, 5, 7], [9, 11, 2], [-1, 0, 0]
    assert torch.equal(own.tree_logits(prefix, tokens, parents), given.tree_logits(prefix, tokens, parents))


def test_an_infinite_weight_read_alike_is_still_a_weights_divergence():
    """The agreement's exact-equality shortcut keeps the rule: a non-finite engine tensor is a mismatch."""
    from harness.check.load_agreement import _tensor_mismatch
    t = torch.tensor([1.0, float("inf")])
    assert _tensor_mismatch("w", t.clone(), t.clone()) is not None
    assert _tensor_mismatch("w", t[:1].bfloat16(), t[:1]) is None
    assert _tensor_mismatch("w", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])).what == "weights"
