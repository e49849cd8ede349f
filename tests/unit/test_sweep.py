"""`ddcheck sweep`: comma-list flags, the process pool, one JSONL, exit codes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.sweep_cmd import parse_list
from harness.runner.settings import RunSettings, UsageError
from harness.sweep import SettingJob, run_jobs, summary_frame, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_parse_list():
    assert parse_list("--budget", "4, 8,16,8", int) == (4, 8, 16)
    assert parse_list("--cuda-graph", "on,off", bool) == (True, False)
    with pytest.raises(UsageError, match="--topk"):
        parse_list("--topk", "1,x", int)
    with pytest.raises(UsageError, match="--cuda-graph"):
        parse_list("--cuda-graph", "maybe", bool)


@pytest.mark.slow
def test_pool_runs_settings_in_order_and_one_jsonl_holds_them(tmp_path):
    base = RunSettings(backend="torch", max_new_tokens=2)
    jobs = [SettingJob(0, RunSettings(budget=8, backend="torch", max_new_tokens=2)),
            SettingJob(1, RunSettings(budget=16, backend="torch", max_new_tokens=2, fault="padded-kv-visible")),
            SettingJob(2, base)]
    seen = []
    results = run_jobs(jobs, 2, lambda job, r: seen.append(job.index))
    assert sorted(seen) == [0, 1, 2] and [r.index for r in results] == [0, 1, 2]
    assert [r.passed for r in results] == [True, False, True]
    assert results[1].summary["first"] is not None
    out = tmp_path / "sweep.jsonl"
    write_jsonl(results, out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = [r for r in records if r["kind"] == "summary"]
    assert [s["setting"] for s in summaries] == [j.settings.command() for j in jobs]
    assert all(r.get("setting") or r["kind"] == "localize" for r in records)
    df = summary_frame(jobs, results)
    assert list(df["verdict"]) == ["pass", "DIVERGE", "pass"]
    assert df.loc[1, "divergent"] > 0 and df.loc[1, "first_divergence"].startswith("step 0")
    assert (df["nodes"] > 0).all()


@pytest.mark.slow
def test_sweep_cli_exit_codes_and_nothing_written_on_usage_error(tmp_path):
    out = tmp_path / "s.jsonl"
    bad = _ddcheck("sweep", "--budget", "8,x", "--out", str(out))
    assert bad.returncode == 2 and "--budget" in bad.stderr and not out.exists()
    bad = _ddcheck("sweep", "--backend", "nope", "--out", str(out))
    assert bad.returncode == 2 and "nope" in bad.stderr and not out.exists()
    div = _ddcheck("sweep", "--budget", "4,16", "--backend", "torch", "--max-new-tokens", "2", "--jobs", "1",
                   "--fault", "padded-kv-visible", "--out", str(out), "--html", str(tmp_path / "s.html"))
    # budget 4 with topk 1 fills every verify row (no padding): the fault cannot show there, so only budget 16 runs
    assert div.returncode == 1, div.stderr
    assert "DIVERGE" in div.stdout and (tmp_path / "s.html").exists()
    summaries = [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x]
    assert [s["settings"]["budget"] for s in summaries] == [16]
    ok = _ddcheck("sweep", "--budget", "8", "--topk", "1,2", "--backend", "torch", "--max-new-tokens", "2",
                  "--jobs", "1", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert out.read_text().count('"kind": "summary"') == 2


def _ddcheck(*args):
    return subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_an_engine_that_raises_is_a_failing_setting_not_a_crash():
    from dataclasses import replace

    from harness.faults import FAULTS
    from harness.faults.registry import Fault, register

    def boom(trees, prefix_lens):
        raise IndexError("mask buffer too short")

    register(Fault("test-raises", "raises in build_mask", "always", "none",
                   lambda p: replace(p, build_mask=boom), lambda s, v: True))
    try:
        job = SettingJob(0, RunSettings(budget=8, backend="torch", max_new_tokens=2, fault="test-raises"))
        (r,) = run_jobs([job], 1)
    finally:
        del FAULTS["test-raises"]
    assert not r.passed and r.usage_error is None
    assert r.summary["error"] == "IndexError: mask buffer too short"
    assert json.loads(r.lines[-1])["kind"] == "summary"
