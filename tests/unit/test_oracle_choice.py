"""Which float64 oracle a run takes (`--oracle`, harness/check/oracle_placement.py)
and the lookup's error when an install lacks it (harness/check/oracle_lookup.py)."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from harness.check import oracle_lookup
from harness.check.oracle_lookup import OracleUnavailable, load_oracle_class
from harness.check.oracle_placement import OracleNeeds, OraclePlan, decide, needs_of, plan_oracle
from harness.cli import _register, app
from harness.engine.settings import RunSettings, UsageError

GIB = 1 << 30
NEEDS = OracleNeeds(dense=560 * GIB, streamed=8 * GIB)   # a 70B model's float64 bytes, one layer's


def test_auto_takes_dense_where_the_whole_model_fits():
    plan = plan_oracle("auto", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 600 * GIB, "cpu": 10 * GIB})
    assert (plan.name, plan.device) == ("dense", "cuda:0")


def test_auto_streams_on_the_gpu_before_the_dense_oracle_on_the_host():
    plan = plan_oracle("auto", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 100 * GIB, "cpu": 900 * GIB})
    assert (plan.name, plan.device) == ("streamed", "cuda:0")
    assert "do not" in plan.reason
    plan = plan_oracle("auto", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 4 * GIB, "cpu": 900 * GIB})
    assert (plan.name, plan.device) == ("dense", "cpu")
    plan = plan_oracle("auto", ["cpu"], NEEDS, {"cpu": 20 * GIB})
    assert (plan.name, plan.device) == ("streamed", "cpu")


def test_auto_streams_an_mla_moe_model_where_the_dense_oracle_does_not_fit(monkeypatch):
    """tiny-kimi-k2 (multi-head latent attention, routed experts) with host room for the streamed oracle
    (two layers) but not the whole model: auto loads the streamed oracle, whose reading agrees with the engine's."""
    from harness.check import oracle_placement, prepare
    from harness.engine.model.presets import checkpoint_dir
    from reference.streamed import StreamedOracle
    with checkpoint_dir("tiny-kimi-k2", 0) as d:
        needs = needs_of(prepare.load_checkpoint(d)[1])
    room = needs.streamed + 8   # the host reserve dropped: room for the streamed oracle, none to spare
    monkeypatch.setattr(oracle_placement, "HOST_RESERVE_BYTES", 0)
    free = int(room / (1 - oracle_placement.RESERVE_FRACTION)) + 1
    monkeypatch.setattr(oracle_placement, "host_free_bytes", lambda: free)
    loaded = prepare.load(RunSettings(model="tiny-kimi-k2", backend="torch"))
    assert loaded.oracle_plan.name == "streamed" and "do not" in loaded.oracle_plan.reason
    assert isinstance(loaded.oracle, StreamedOracle) and loaded.load_mismatches == ()


def test_nothing_fits_falls_back_to_the_last_device():
    assert plan_oracle("auto", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 0, "cpu": 0}) == OraclePlan(
        "streamed", "cpu", plan_oracle("auto", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 0, "cpu": 0}).reason)
    plan = plan_oracle("dense", ["cuda:0", "cpu"], NEEDS, {"cuda:0": 100 * GIB, "cpu": 100 * GIB})
    assert (plan.name, plan.device) == ("dense", "cpu")   # asked for: kept, the last resort's device


def test_needs_count_the_largest_layer_and_a_vocabulary_slice():
    w = {"model.embed_tokens.weight": torch.zeros(100, 4), "model.norm.weight": torch.zeros(4),
         "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4), "model.layers.1.mlp.up_proj.weight": torch.zeros(9, 4),
         "model.layers.1.input_layernorm.weight": torch.zeros(4),
         "model.layers.2.mlp.up_proj.weight": torch.zeros(8, 4)}
    needs = needs_of(w)
    assert needs.dense == 8 * (400 + 4 + 32 + 36 + 4 + 32)
    assert needs.streamed == 8 * (2 * (36 + 4) + 400)   # layer 1 twice (the next one read ahead), the tied head's rows
    with pytest.raises(ValueError):
        OracleNeeds(dense=1, streamed=2)
    with pytest.raises(ValueError):
        OraclePlan("sparse", "cpu", "why")


def test_decide_on_a_cpu_run():
    w = {"model.embed_tokens.weight": torch.zeros(10, 4)}
    assert decide(RunSettings(), w).name == "dense"   # a tiny model fits any host
    assert decide(RunSettings(oracle="streamed"), w).name == "streamed"
    assert decide(RunSettings(oracle="streamed", oracle_device="cpu"), w) == OraclePlan(
        "streamed", "cpu", "streamed on cpu, as asked")
    with pytest.raises(UsageError, match="--oracle must be"):
        RunSettings(oracle="sharded")


def test_a_missing_entry_point_says_to_reinstall(monkeypatch):
    class Dense:
        name = "dense"
    monkeypatch.setattr(oracle_lookup, "entry_points", lambda group: [Dense()])
    with pytest.raises(OracleUnavailable, match=r"reinstall.*pip install -e \."):
        load_oracle_class("streamed")
    monkeypatch.setattr(oracle_lookup, "entry_points", lambda group: [])
    with pytest.raises(OracleUnavailable, match=r"pip install -e \."):
        load_oracle_class("dense")


@pytest.mark.parametrize("fault,code", [(None, 0), ("padded-kv-visible", 1)])
def test_run_with_the_streamed_oracle_records_it(tmp_path, fault, code):
    out = tmp_path / "r.jsonl"
    args = ["run", "--model", "tiny", "--budget", "16", "--max-new-tokens", "4", "--no-cuda-graph",
            "--backend", "torch", "--oracle", "streamed", "--out", str(out)] + (["--fault", fault] if fault else [])
    _register()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, result.output
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["oracle"] == "streamed" and summary["oracle_reason"]
    assert summary["settings"]["oracle"] == "streamed" and "--oracle streamed" in summary["setting"]
