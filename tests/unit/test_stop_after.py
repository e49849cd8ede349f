"""--stop-after: a divergent run ends after N divergent verify steps; 0 runs to the end."""
import json
import os
import subprocess
import sys


def _summary(tmp_path, *extra):
    out = tmp_path / f"r{len(extra)}{'-'.join(extra)}.jsonl"
    cmd = [sys.executable, "-m", "harness", "run", "--budget", "16", "--topk", "1", "--no-cuda-graph",
           "--backend", "torch", "--fault", "padded-kv-visible", "--max-new-tokens", "24",
           "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 1, r.stderr
    return [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]


def test_stop_after_ends_a_divergent_run_early(tmp_path):
    full = _summary(tmp_path, "--stop-after", "0")
    one = _summary(tmp_path, "--stop-after", "1")
    assert full["divergent_steps"] > 1 and not full["stopped_early"]
    assert one["stopped_early"] and one["divergent_steps"] == 1
    assert one["steps"] < full["steps"]
    # one step: its time is the warm-up (check/step_clock.py), no per-step figure after it
    assert one["steps"] == 1 and one["oracle_warmup_s"] > 0 and one["engine_warmup_s"] > 0
    assert one["engine_s_per_step"] is None and one["oracle_time_ratio"] is None
    assert full["oracle_s_per_step"] > 0 and full["engine_s_per_step"] > 0 and full["oracle_time_ratio"] > 0


def test_the_summary_says_where_loading_time_went(tmp_path):
    """Each loading phase and the stream check are timed, in the record and on screen."""
    out = tmp_path / "r.jsonl"
    r = subprocess.run([sys.executable, "-m", "harness", "run", "--budget", "8", "--topk", "2", "--backend", "torch",
                        "--max-new-tokens", "6", "--out", str(out)], capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    summary = [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x][-1]
    assert list(summary["load_s"]) == ["engine_load", "oracle_load", "load_agreement", "backend", "engine_build"]
    assert all(v >= 0 for v in summary["load_s"].values()) and summary["load_s"]["oracle_load"] > 0
    assert summary["streams_s"] > 0
    assert "load time" in r.stdout and "oracle load" in r.stdout and "stream check" in r.stdout


def test_oracle_threads_set_and_restored():
    import torch
    from harness.check.step_clock import machine_cores, oracle_threads
    before = torch.get_num_threads()
    with oracle_threads(machine_cores()):
        assert torch.get_num_threads() == machine_cores()
    assert torch.get_num_threads() == before
