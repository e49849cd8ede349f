"""Checkpoint math read fully: every config.json key that changes the forward
pass is implemented or refused, on both sides, never silently ignored. A
refusal is one line on stderr, exit 2, nothing written."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from ddschema import RopeScaling
from harness.engine.model.hf_config import ModelLoadError, config_from_hf
from reference.checkpoint import CheckpointRefused, read_config
from tests.unit.test_checkpoint import BASE, write_checkpoint

cli._register()

LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"]}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"]}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

REFUSED = {
    "yarn": {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "dynamic (4.x spelling)": {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "linear (5.x spelling)": {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    "llama3 without its factors": {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "partial rotary": {**LLAMA, "partial_rotary_factor": 0.5},
    "llama sliding window": {**LLAMA, "sliding_window": 64},
    # windows are read (tests/unit/test_sliding_window.py); what stays refused: a window on Llama, a layer kind
    # neither side implements, a windowed layer with no window length
    "qwen2 window without a length": {**QWEN2, "use_sliding_window": True, "sliding_window": None,
                                      "max_window_layers": 0},
    "chunked layer type": {**QWEN2, "layer_types": ["full_attention", "chunked_attention"]},
    "sliding layer types without a length": {**QWEN2, "layer_types": ["full_attention", "sliding_attention"]},
    "attention soft-cap not a number": {**LLAMA, "attn_logit_softcapping": "50"},
    "final soft-cap": {**LLAMA, "final_logit_softcapping": 30.0},
    "mlp bias": {**LLAMA, "mlp_bias": True},
    "gelu": {**LLAMA, "hidden_act": "gelu"},
}

# written by transformers with the key present but switched off: nothing to refuse
ACCEPTED = {
    "qwen2 window off": {**QWEN2, "use_sliding_window": False, "sliding_window": 4096,
                         "layer_types": ["full_attention", "full_attention"]},
    "llama window null": {**LLAMA, "sliding_window": None, "mlp_bias": False},
    "soft-caps null": {**LLAMA, "attn_logit_softcapping": None, "final_logit_softcapping": None},
}


@pytest.mark.parametrize("name", REFUSED)
def test_both_sides_refuse_math_they_do_not_implement(name):
    with pytest.raises(ModelLoadError):
        config_from_hf(REFUSED[name])
    with pytest.raises(CheckpointRefused):
        read_config(REFUSED[name])


@pytest.mark.parametrize("name", ACCEPTED)
def test_keys_that_are_switched_off_are_accepted_alike(name):
    assert config_from_hf(ACCEPTED[name]) == read_config(ACCEPTED[name])


@pytest.mark.parametrize("name", ["yarn", "qwen2 window without a length", "final soft-cap"])
def test_a_refused_checkpoint_is_one_line_exit_2_nothing_written(tmp_path, name):
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, LLAMA if "qwen" not in name else QWEN2)
    (directory / "config.json").write_text(json.dumps(REFUSED[name]))
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli.app, ["run", "--model", str(directory), "--backend", "torch",
                                          "--out", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error:") and "not supported" in lines[0]
    assert not out.exists()


def test_the_oracle_refusing_what_the_engine_accepts_is_exit_2(tmp_path, monkeypatch):
    """An engine loader that ignores a soft-cap must not make the run pass:
    the oracle reads the checkpoint itself and refuses it."""
    from harness.engine.model import hf_config
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, LLAMA)
    (directory / "config.json").write_text(json.dumps(REFUSED["final soft-cap"]))
    monkeypatch.setattr(hf_config, "_refusals", lambda hf, arch: [])
    result = CliRunner().invoke(cli.app, ["run", "--model", str(directory), "--backend", "torch",
                                          "--out", str(tmp_path / "run.jsonl")])
    assert result.exit_code == 2 and "the oracle cannot read" in result.stderr


@pytest.mark.parametrize("spelling", [
    {**LLAMA, "rope_theta": 5e5, "rope_scaling": LLAMA3},                       # transformers 4.x
    {**LLAMA, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}},                # transformers 5.x
])
def test_llama3_rope_scaling_is_read_alike_in_both_spellings(spelling):
    want = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    for cfg in (config_from_hf(spelling), read_config(spelling)):
        assert cfg.rope_scaling == want and cfg.rope_theta == 5e5
