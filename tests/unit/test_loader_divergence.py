"""The engine's loader raising on a checkpoint the oracle reads is a load divergence (stage `load`, exit 1),
judged against the oracle's reading with no engine built; a checkpoint the oracle cannot read either, or a
user's checkpoint the engine refuses, stays what it was (issue 21: mutants of the config reading)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.check.load_agreement import LoadDivergence
from harness.check.prepare import loader_divergence, prepare
from harness.engine.model import presets
from harness.engine.model.presets import ModelLoadError
from harness.engine.settings import RunSettings

cli._register()
SETTING = RunSettings(backend="torch", budget=4, topk=1, batch=1, max_new_tokens=4)


def _bad_config(path):   # what a mutated config reading does: refuses the preset's own config.json
    raise ModelLoadError(f"--model {path}: bad config.json (TypeError)")


def test_a_preset_whose_config_the_engine_cannot_read_is_a_load_divergence(monkeypatch):
    monkeypatch.setattr(presets, "read_config", _bad_config)
    with pytest.raises(LoadDivergence) as e:
        prepare(SETTING)
    (m,) = e.value.mismatches
    assert (m.what, m.key) == ("config", "config.json") and "the oracle read the same checkpoint" in m.detail
    assert "bad config.json (TypeError)" in m.detail and "ddcheck-preset-" not in m.detail
    assert "harness/engine/model/presets.py:" in m.detail


def test_the_run_is_a_divergence_of_the_load_stage(monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "read_config", _bad_config)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, ["run", "--backend", "torch", "--budget", "4", "--topk", "1",
                                          "--max-new-tokens", "4", "--no-cuda-graph", "--out", str(out)])
    assert result.exit_code == 1, result.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    summary = rows[-1]
    assert [r["kind"] for r in rows] == ["load", "summary"]
    assert summary["verdict"] == "diverge" and summary["first"]["what"] == "config"
    assert (summary["stage"], summary["quantity"]) == ("load", "config")


def test_a_checkpoint_the_oracle_cannot_read_either_keeps_the_engines_error(monkeypatch, tmp_path):
    from harness.check import prepare as prep

    def oracle_refuses(*args, **kwargs):
        raise ModelLoadError("the oracle cannot read it either")
    monkeypatch.setattr(presets, "read_config", _bad_config)
    monkeypatch.setattr(prep, "load_oracle_from", oracle_refuses)
    with pytest.raises(ModelLoadError):
        prepare(SETTING)


def test_a_users_checkpoint_the_engine_refuses_is_not_a_divergence(monkeypatch, tmp_path):
    """The same refusal by the engine's own config reading, the oracle reading the directory: a divergence for
    a preset (ddcheck wrote it: the engine must read it), a usage error for a user's checkpoint."""
    from dataclasses import replace
    from harness.check import prepare as prep
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as e:
        presets.read_config(tmp_path)
    monkeypatch.setattr(prep, "load_oracle_from", lambda *args, **kwargs: object())
    assert loader_divergence(replace(SETTING, model=str(tmp_path)), tmp_path, e.value) is None
    assert isinstance(loader_divergence(SETTING, tmp_path, e.value), LoadDivergence)
