"""Prompts on `ddcheck run`: --prompt-len, --prompt-file, --case (one of
them), and --oracle-device; the reproduce command carries them."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from harness.check.prompts import prompts_of
from harness.engine.settings import RunSettings, UsageError


@pytest.fixture(scope="module")
def cli():
    from harness.cli import _register, app
    _register()
    return app


def streams(path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "stream"]


def summary(path):
    return next(r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "summary")


def test_prompt_len_sets_each_request_prefix(cli, tmp_path):
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(cli, ["run", "--backend", "torch", "--batch", "2", "--max-new-tokens", "4",
                                   "--prompt-len", "37,61", "--out", str(out)])
    assert res.exit_code == 0, res.output
    s = summary(out)
    assert s["prefix_len_min"] == 37 and s["prefix_len_max"] >= 61
    assert "--prompt-len 37,61" in s["setting"]


def test_prompt_file_of_token_ids_is_run_as_given(cli, tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]))
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(cli, ["run", "--backend", "torch", "--batch", "2", "--max-new-tokens", "3",
                                   "--prompt-file", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert summary(out)["prefix_len_min"] == 3
    assert [r["prompt"] for r in streams(out)] == ["p[0]", "p[1]"]


def test_prompt_sources_in_order():
    assert [p.length for p in prompts_of(RunSettings(prompt_lens=(9, 700)))] == [9, 700]
    assert prompts_of(RunSettings())[0].name == "code"


@pytest.mark.parametrize("args, words", [
    (["--prompt-len", "0"], "--prompt-len"),
    (["--prompt-len", "12,x"], "--prompt-len"),
    (["--prompt-len", "12", "--case", "cases/gate.toml"], "give one"),
    (["--prompt-file", "PROMPT_TEXT"], "tokenizer.json"),
    (["--prompt-file", "PROMPT_BAD_JSON"], "token ids"),
    (["--prompt-file", "NOWHERE"], "not a file"),
    (["--oracle-device", "gpu"], "--oracle-device"),
])
def test_bad_prompt_options_are_usage_errors(cli, tmp_path, args, words):
    (tmp_path / "t.txt").write_text("def main():\n    return 1\n")
    (tmp_path / "b.json").write_text(json.dumps({"tokens": [1, 2]}))
    subs = {"PROMPT_TEXT": str(tmp_path / "t.txt"), "PROMPT_BAD_JSON": str(tmp_path / "b.json"),
            "NOWHERE": str(tmp_path / "none.json")}
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(cli, ["run", "--backend", "torch", "--out", str(out)] + [subs.get(a, a) for a in args])
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_oracle_device_cuda_without_a_gpu_is_a_usage_error():
    import torch
    from harness.check.oracle_placement import choose_oracle_device
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UsageError, match="no CUDA"):
        choose_oracle_device(RunSettings(oracle_device="cuda"), {})
    assert choose_oracle_device(RunSettings(), {}) == "cpu"     # auto on a CPU run
