"""`--model PATH`: a local Hugging Face checkpoint (config.json + safetensors)
is loaded and checked like a preset."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ddschema import weight_names
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.engine.model.presets import ModelLoadError, config_from_hf, load_checkpoint, random_weights
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

BASE = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512}
HF_CONFIGS = {
    "llama": {**BASE, "architectures": ["LlamaForCausalLM"]},
    "llama-tied": {**BASE, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
}


def write_checkpoint(directory, hf_config: dict, seed: int = 3, drop: str | None = None):
    """config.json + model.safetensors holding seeded random weights under Hugging Face names."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf_config)
    weights = random_weights(cfg, seed)
    assert set(weights) == set(weight_names(cfg))
    (directory / "config.json").write_text(json.dumps(hf_config))
    save_file({n: t.contiguous() for n, t in weights.items() if n != drop}, str(directory / "model.safetensors"))
    return cfg, weights


@pytest.mark.parametrize("arch", HF_CONFIGS)
def test_checkpoint_loads_as_written(tmp_path, arch):
    """The loader maps config.json onto the architecture's flags and returns the written tensors."""
    cfg, weights = write_checkpoint(tmp_path / arch, HF_CONFIGS[arch])
    got_cfg, got = load_checkpoint(tmp_path / arch)
    assert got_cfg == cfg
    assert got_cfg.qk_norm == (arch == "qwen3") and got_cfg.qkv_bias == (arch == "qwen2")
    assert got_cfg.tie_word_embeddings == (arch == "llama-tied")
    assert got_cfg.head_dim == (16 if arch == "qwen3" else 12) and got_cfg.num_kv_heads == 2
    assert set(got) == set(weights) and all(torch.equal(got[n], weights[n]) for n in weights)


@pytest.mark.parametrize("arch", HF_CONFIGS)
def test_check_on_a_local_checkpoint_passes(tmp_path, arch):
    """A differential check with --model PATH matches the oracle node by node."""
    write_checkpoint(tmp_path / arch, HF_CONFIGS[arch])
    s = RunSettings(budget=8, topk=2, batch=2, max_new_tokens=8, backend="torch", model=str(tmp_path / arch))
    summary = check(prepare(s), RecordWriter(None))
    assert summary.passed, summary.first
    assert summary.nodes_checked > 0 and summary.steps > 0


def test_cli_run_on_a_local_checkpoint(tmp_path):
    """`ddcheck run --model PATH` exits 0 and records the path as the model."""
    from harness.cli import _register, app
    _register()
    write_checkpoint(tmp_path / "ckpt", HF_CONFIGS["qwen3"])
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", str(tmp_path / "ckpt"), "--backend", "torch", "--budget", "8",
                                      "--topk", "2", "--max-new-tokens", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["passed"] and summary["settings"]["model"] == str(tmp_path / "ckpt")


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path):
    """A checkpoint that lacks a tensor the config implies is a load error, not a KeyError later."""
    write_checkpoint(tmp_path / "ckpt", HF_CONFIGS["qwen3"], drop="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(ModelLoadError, match="k_norm"):
        load_checkpoint(tmp_path / "ckpt")
