"""Bad input to `ddcheck run`: exit 2, one line on stderr, no traceback, nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def cli():
    from harness.cli import _register, app
    _register()
    return app


TINY_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def checkpoint_dir(tmp_path, config, weights: bytes | None = b"not a safetensors file"):
    """A directory with this config.json (dict or raw text) and one model.safetensors of these bytes."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def bad_model_args(tmp_path, case: str) -> list[str]:
    if case == "missing-dir":
        return ["--model", str(tmp_path / "no-such-checkpoint")]
    if case == "no-safetensors":
        return ["--model", str(checkpoint_dir(tmp_path, TINY_HF, weights=None))]
    if case == "no-config":
        d = tmp_path / "ckpt"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
        return ["--model", str(d)]
    if case == "unsupported-arch":
        return ["--model", str(checkpoint_dir(tmp_path, {**TINY_HF, "architectures": ["GPT2LMHeadModel"]}))]
    if case == "config-not-json":
        return ["--model", str(checkpoint_dir(tmp_path, "{not json"))]
    if case == "config-lacks-key":
        return ["--model", str(checkpoint_dir(tmp_path, {k: v for k, v in TINY_HF.items() if k != "hidden_size"}))]
    if case == "config-not-an-object":
        return ["--model", str(checkpoint_dir(tmp_path, "[1, 2]"))]
    if case == "config-impossible":  # 3 heads over 2 kv heads is no GQA
        return ["--model", str(checkpoint_dir(tmp_path, {**TINY_HF, "num_attention_heads": 3,
                                                         "num_key_value_heads": 2, "head_dim": 8}))]
    if case == "corrupt-safetensors":
        return ["--model", str(checkpoint_dir(tmp_path, TINY_HF))]
    if case == "wrong-shapes":
        import torch
        from safetensors.torch import save
        from ddschema import weight_names
        from harness.engine.model.presets import config_from_hf
        cfg = config_from_hf(TINY_HF)
        blob = save({n: torch.zeros(3, 3) for n in weight_names(cfg)})
        return ["--model", str(checkpoint_dir(tmp_path, TINY_HF, weights=blob))]
    raise KeyError(case)


FLAG_CASES = {
    "budget-0": ["--budget", "0"],
    "budget-negative": ["--budget", "-3"],
    "topk-0": ["--topk", "0"],
    "block-size-1": ["--block-size", "1"],
    "unknown-fault": ["--fault", "no-such-fault"],
    "fault-cannot-show": ["--fault", "padded-kv-visible", "--topk", "4"],
    "unknown-backend": ["--backend", "no-such-backend"],
    "unknown-preset": ["--model", "no-such-preset"],
    "unknown-accept": ["--accept", "greedy"],
    "unknown-dtype": ["--dtype", "float8"],
    "batch-0": ["--batch", "0"],
}
MODEL_CASES = ["missing-dir", "no-safetensors", "no-config", "unsupported-arch", "config-not-json",
               "config-lacks-key", "config-not-an-object", "config-impossible", "corrupt-safetensors",
               "wrong-shapes"]


def assert_usage_error(result, out) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error: "), result.stderr
    assert "Traceback" not in result.output
    assert not out.exists(), "a usage error must write nothing"


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flag_is_a_usage_error(cli, tmp_path, case):
    """Each bad flag value exits 2 with a one-line error and writes no records."""
    out = tmp_path / "out" / "run.jsonl"
    args = ["run", "--backend", "torch", "--max-new-tokens", "2"] + FLAG_CASES[case] + ["--out", str(out)]
    assert_usage_error(CliRunner().invoke(cli, args), out)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_checkpoint_is_a_usage_error(cli, tmp_path, case):
    """A missing, incomplete or unsupported checkpoint exits 2 with a one-line error and writes nothing."""
    out = tmp_path / "out" / "run.jsonl"
    args = ["run", "--backend", "torch", "--max-new-tokens", "2"] + bad_model_args(tmp_path, case) + ["--out", str(out)]
    assert_usage_error(CliRunner().invoke(cli, args), out)


def test_console_script_usage_error_has_no_traceback(tmp_path):
    """Through the real entry point: exit 2, one stderr line, no file."""
    out = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-c", "import sys; from harness.cli import main; sys.exit(main())",
                           "run", "--budget", "0", "--backend", "torch", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["ddcheck: error: --budget must be >= 1, got 0"]
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--topk", "0"], ["--model", "no-such-preset"], ["--fault", "no-such-fault"]])
def test_usage_error_writes_no_default_report(cli, tmp_path, monkeypatch, flags):
    """Without --out, a usage error creates no reports/ file either."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["run", "--backend", "torch"] + flags)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []
