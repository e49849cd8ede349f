"""--stop-after: a divergent run ends after N divergent verify steps; 0 runs to the end."""
import json

import pytest
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def cli():
    """The command line in this process (the exit-code contracts have their real-CLI tests elsewhere:
    test_cli_usage.py, test_stopped_run.py, test_internal_errors.py)."""
    from harness.cli import _register, app
    _register()
    return app


def _summary(cli, tmp_path, *extra):
    out = tmp_path / f"r{len(extra)}{'-'.join(extra)}.jsonl"
    args = ["run", "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch",
            "--fault", "padded-kv-visible", "--max-new-tokens", "24", "--out", str(out), *extra]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1, r.output
    return [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]


def test_stop_after_ends_a_divergent_run_early(cli, tmp_path):
    full = _summary(cli, tmp_path, "--stop-after", "0")
    one = _summary(cli, tmp_path, "--stop-after", "1")
    assert full["divergent_steps"] > 1 and not full["stopped_early"]
    assert one["stopped_early"] and one["divergent_steps"] == 1
    assert one["steps"] < full["steps"]
    # one step: its time is the warm-up (check/step_clock.py), no per-step figure after it
    assert one["steps"] == 1 and one["oracle_warmup_s"] > 0 and one["engine_warmup_s"] > 0
    assert one["engine_s_per_step"] is None and one["oracle_time_ratio"] is None
    assert full["oracle_s_per_step"] > 0 and full["engine_s_per_step"] > 0 and full["oracle_time_ratio"] > 0


def test_the_summary_says_where_loading_time_went(cli, tmp_path):
    """Each loading phase and the stream check are timed, in the record and on screen."""
    out = tmp_path / "r.jsonl"
    r = CliRunner().invoke(cli, ["run", "--budget", "8", "--topk", "2", "--backend", "torch", "--max-new-tokens", "6",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    summary = [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]
    assert list(summary["load_s"]) == ["engine_load", "oracle_load", "load_agreement", "backend", "engine_build"]
    assert all(v >= 0 for v in summary["load_s"].values()) and summary["load_s"]["oracle_load"] > 0
    assert summary["streams_s"] > 0
    assert "load time" in r.output and "oracle load" in r.output and "stream check" in r.output


def test_oracle_threads_set_and_restored():
    import torch
    from harness.check.step_clock import machine_cores, oracle_threads
    before = torch.get_num_threads()
    with oracle_threads(machine_cores()):
        assert torch.get_num_threads() == machine_cores()
    assert torch.get_num_threads() == before
