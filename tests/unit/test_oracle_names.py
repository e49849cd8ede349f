"""The oracle names the tensors it reads itself (reference/names.py): a wrong
name in the shared schema (ddschema.weight_names, what the engine's loader
and the presets use) is a load divergence naming the tensor, never a KeyError
of the oracle (issue 21, case g)."""
from __future__ import annotations

import ddschema.config
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.model.presets import PRESETS
from harness.engine.settings import RunSettings
from reference import names


def test_the_oracle_names_agree_with_the_schema_on_every_preset():
    for name, cfg in PRESETS.items():
        assert names.weight_names(cfg) == ddschema.config.weight_names(cfg), name


def test_the_oracle_derives_mla_and_moe_shapes_itself_and_agrees_with_the_schema():
    """reference/names.py's shapes, from the config alone, equal the schema's on every preset (the MLA and MoE
    presets list 43 to 121 tensors); no module of reference/ takes names or shapes from the schema."""
    import pathlib
    checked = 0
    for name, cfg in PRESETS.items():
        assert names.mla_moe_shapes(cfg) == ddschema.config.weight_shapes(cfg), name
        checked += len(names.mla_moe_shapes(cfg))
    assert checked > 200
    src = pathlib.Path(names.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        assert "weight_shapes" not in text and "config import ModelConfig, weight_names" not in text, f.name


def _misnamed(cfg):
    return [n.replace("post_attention_layernorm", "post_attn_layernorm") for n in _schema(cfg)]


_schema = ddschema.config.weight_names


def test_a_wrong_name_in_the_shared_schema_is_a_load_divergence(monkeypatch, tmp_path):
    # every module that reads the schema's names sees the wrong one, as a patch of ddschema/config.py would
    import harness.check.load_agreement as agreement
    import harness.engine.model.presets as presets
    import reference.checkpoint
    import reference.model
    import reference.oracle
    readers = [m for m in (presets, agreement, reference.checkpoint, reference.model, reference.oracle)
               if getattr(m, "weight_names", None) is _schema]
    for module in (ddschema.config, *readers):
        monkeypatch.setattr(module, "weight_names", _misnamed)
    s = RunSettings(backend="torch", budget=4, max_new_tokens=2)
    p = prepare(s)
    assert p.oracle.missing_weights and all("post_attention_layernorm" in n for n in p.oracle.missing_weights)
    summary = check(p, RecordWriter(tmp_path / "r.jsonl"))
    assert summary.stage == "load" and summary.quantity == "weights"
    assert summary.first.what == "weights" and "post_attention_layernorm" in summary.explanation


def test_the_oracle_gives_every_config_field_itself(monkeypatch):
    """Each of the oracle's config readers passes every ModelConfig field (reference/own_config.py): a default
    of the shared schema changed (as a patch of ddschema/config.py would) changes nothing the oracle reads."""
    import json
    from dataclasses import fields

    import reference.own_config as own
    from harness.engine.model.presets import checkpoint_dir
    from reference.checkpoint import read_config
    given = []
    real = own.ModelConfig

    def strict(**kw):   # the record format's constructor, refusing to fill any field from its defaults
        given.append(set(kw))
        assert set(kw) == {f.name for f in fields(real)}
        return real(**kw)
    monkeypatch.setattr(own, "ModelConfig", strict)
    for preset in ("tiny", "tiny-qwen3", "tiny-gemma3", "tiny-deepseek-v3", "tiny-swa"):
        with checkpoint_dir(preset, 0) as d:
            cfg = read_config(json.loads((d / "config.json").read_text()))
        assert cfg == PRESETS[preset], preset
    assert len(given) == 5
    import pathlib
    for f in pathlib.Path(own.__file__).parent.glob("*.py"):   # no reader of the oracle builds one otherwise
        assert f.name == "own_config.py" or "return ModelConfig(" not in f.read_text(), f.name
