"""`ddcheck reduce RECORDS`: the smallest setting that still fails, written as
a case file and a standalone repro script that fails on its own."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.workflows.cases import load_case

cli._register()
ROOT = Path(__file__).resolve().parents[2]
LEAK = ["run", "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch", "--max-new-tokens", "24"]


def _run(*args):
    return CliRunner().invoke(cli.app, list(args))


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    d = tmp_path_factory.mktemp("reduce")
    records = d / "leak.jsonl"
    assert _run(*LEAK, "--fault", "padded-kv-visible", "--out", str(records)).exit_code == 1
    result = _run("reduce", str(records), "--out", str(d / "out"))
    return result, d / "out"


def _repro(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=path.parent,
                          timeout=300)


def test_reduce_finds_a_smaller_setting_that_still_fails(reduced):
    result, out = reduced
    assert result.exit_code == 0, result.output
    assert "reduce: max_new_tokens 24 -> 2: still fails" in result.output   # progress, axis by axis
    case = load_case(out / "case.toml")
    (s,) = case.settings()
    assert s.fault == "padded-kv-visible" and s.topk == 1 and s.batch == 1
    assert s.budget == 8 and s.max_new_tokens == 2   # 8: the smallest budget with a padding row (7 nodes at topk 1)
    assert [len(p.tokens) for p in case.prompts] == [1]   # the recorded prompt had 14 tokens
    assert json.loads((Path(s.model) / "config.json").read_text())["num_hidden_layers"] == 1   # tiny has 2


def test_the_repro_fails_on_its_own_and_passes_without_the_fault(reduced):
    _, out = reduced
    repro = out / "repro.py"
    failing = _repro(repro)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "rows diverge from the float64 oracle" in failing.stdout
    text = repro.read_text()
    assert "FAULT = 'padded-kv-visible'" in text
    fixed = out / "repro_fixed.py"
    fixed.write_text(text.replace("FAULT = 'padded-kv-visible'", "FAULT = None"))
    passing = _repro(fixed)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert "every row matches" in passing.stdout


def test_reduce_on_a_passing_run_is_a_usage_error(tmp_path):
    records = tmp_path / "ok.jsonl"
    assert _run("run", "--backend", "torch", "--max-new-tokens", "2", "--out", str(records)).exit_code == 0
    out = tmp_path / "out"
    result = _run("reduce", str(records), "--out", str(out))
    assert result.exit_code == 2
    assert result.output.strip().startswith("ddcheck: error:") and "no run diverged" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("make", [lambda d: d / "missing.jsonl", lambda d: d,
                                  lambda d: (d / "x.jsonl").write_text("not json\n") and d / "x.jsonl"])
def test_reduce_on_a_bad_path_is_a_usage_error(tmp_path, make):
    path = make(tmp_path)
    out = tmp_path / "out"
    result = _run("reduce", str(path), "--out", str(out))
    assert result.exit_code == 2 and result.output.startswith("ddcheck: error:"), result.output
    assert not out.exists()
