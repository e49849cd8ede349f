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
    assert one["oracle_s_per_step"] > 0 and one["engine_s_per_step"] > 0


def test_oracle_threads_set_and_restored():
    import torch
    from harness.step_clock import machine_cores, oracle_threads
    before = torch.get_num_threads()
    with oracle_threads(machine_cores()):
        assert torch.get_num_threads() == machine_cores()
    assert torch.get_num_threads() == before
