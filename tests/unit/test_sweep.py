"""`ddcheck sweep`: comma-list flags, the process pool, one JSONL, exit codes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.sweep_cmd import CASE_OWNED, parse_list, plan_case, plan_flags
from harness.engine.settings import RunSettings, UsageError
from harness.workflows.sweep import SettingJob, SettingResult, run_jobs, summary_frame, verdict, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_parse_list():
    assert parse_list("--budget", "4, 8,16,8", int) == (4, 8, 16)
    assert parse_list("--cuda-graph", "on,off", bool) == (True, False)
    with pytest.raises(UsageError, match="--topk"):
        parse_list("--topk", "1,x", int)
    with pytest.raises(UsageError, match="--cuda-graph"):
        parse_list("--cuda-graph", "maybe", bool)



def test_a_backend_given_on_the_command_line_is_taken_without_asking_for_the_default(monkeypatch):
    """The default backend imports SGLang to see whether it imports (seconds of a sweep's start, and of
    each of its usage errors): only a sweep that names no --backend asks for it."""
    import harness.engine.attn as attn

    def default_backend():
        raise AssertionError("the default backend was asked for")

    monkeypatch.setattr(attn, "default_backend", default_backend)
    none = dict.fromkeys(("budget", "topk", "cuda_graph", "batch", "dtype", "sliding_window", "page_size", "tp"))
    jobs = plan_flags({**none, "backend": "torch,nope"}, dict(CASE_OWNED), "cpu", None)
    assert [j.settings.backend for j in jobs] == ["torch", "nope"]
    with pytest.raises(AssertionError, match="default backend"):
        plan_flags({**none, "backend": None}, dict(CASE_OWNED), "cpu", None)

@pytest.mark.slow
def test_pool_runs_settings_in_order_and_one_jsonl_holds_them(tmp_path):
    base = RunSettings(backend="torch", max_new_tokens=2)
    jobs = [SettingJob(0, RunSettings(budget=8, backend="torch", max_new_tokens=2)),
            SettingJob(1, RunSettings(budget=16, backend="torch", max_new_tokens=2, fault="padded-kv-visible"),
                       expect_fault="padded-kv-visible"),
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
    assert [s.get("expect_fault") for s in summaries] == [None, "padded-kv-visible", None]
    assert all(r.get("setting") or r["kind"] == "localize" for r in records)
    df = summary_frame(jobs, results)
    assert list(df["verdict"]) == ["pass", "caught", "pass"]  # the expected fault, named padding-leak
    assert df.loc[1, "divergent"] > 0 and df.loc[1, "first_divergence"].startswith("step 0")
    assert (df["nodes"] > 0).all()


@pytest.mark.slow
def test_sweep_cli_exit_codes_and_nothing_written_on_usage_error(tmp_path):
    out = tmp_path / "s.jsonl"
    # the usage errors in this process (exit 2 from a real process: test_sweep_case_rejects_the_flags_...)
    for flags, named in ((["--budget", "8,x"], "--budget"), (["--backend", "nope"], "nope")):
        bad = _in_process("sweep", *flags, "--out", str(out))
        assert bad.exit_code == 2 and named in bad.stderr and not out.exists(), bad.output
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


def _in_process(*args):
    from typer.testing import CliRunner

    from harness.cli import _register, app
    _register()
    return CliRunner().invoke(app, list(args))


def _ddcheck(*args):
    return subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_an_engine_that_raises_is_a_failing_setting_not_a_crash(monkeypatch):
    from dataclasses import replace

    from harness.faults.fault import Fault
    from harness.faults.registry import catalog

    def boom(trees, prefix_lens):
        raise IndexError("mask buffer too short")

    monkeypatch.setitem(catalog(), "test-raises", Fault("test-raises", "raises in build_mask", "always", "unknown",
                                                      lambda p: replace(p, build_mask=boom), lambda s, v: True))
    job = SettingJob(0, RunSettings(budget=8, backend="torch", max_new_tokens=2, fault="test-raises"),
                     expect_fault="test-raises")
    (r,) = run_jobs([job], 1)
    assert not r.passed and r.usage_error is None
    assert r.summary["error"] == "IndexError: mask buffer too short"
    assert json.loads(r.lines[-1])["kind"] == "summary"
    # the crash summary carries every documented count (docs/RECORDS.md) and the gate's expectation
    for key in ("nodes_checked", "divergent_nodes", "near_ties", "padding_rows", "steps", "stream_mismatches",
                "accept_mismatches", "max_rel_err", "tolerance", "fault_class", "explanation", "schema"):
        assert key in r.summary, key
    assert r.summary["expect_fault"] == "test-raises" and r.summary["passed"] is False
    assert verdict(job, r) == "MISSED"  # crashed, not named as its class: not a caught fault


def _result(summary: dict, usage_error: str | None = None) -> SettingResult:
    return SettingResult(0, "ddcheck run", summary, None, (), 0.1, usage_error)


def test_verdict_tells_a_caught_expected_fault_from_a_divergence():
    plain = SettingJob(0, RunSettings(budget=16))
    expected = SettingJob(0, RunSettings(budget=16, fault="padded-kv-visible"), expect_fault="padded-kv-visible")
    caught = {"passed": False, "fault_class": "padding-leak", "expect_fault": "padded-kv-visible",
              "expect_class": "padding-leak"}
    assert verdict(expected, _result(caught)) == "caught"
    assert verdict(plain, _result({"passed": False, "fault_class": "padding-leak"})) == "DIVERGE"
    assert verdict(expected, _result({**caught, "fault_class": "mask-shift"})) == "MISSED"
    assert verdict(expected, _result({**caught, "passed": True})) == "MISSED"
    assert verdict(plain, _result({"passed": True})) == "pass"
    assert verdict(plain, _result({}, "bad backend")) == "error"


def test_sweep_case_rejects_the_flags_a_case_sets_and_applies_device(tmp_path):
    case = tmp_path / "c.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nbudget = [8, 16]\nbackend = "torch"\n')
    none = dict.fromkeys(("budget", "topk", "cuda_graph", "backend", "batch", "dtype"))
    jobs = plan_case(case, none, dict(CASE_OWNED), "cpu", None)
    assert [(j.settings.budget, j.settings.device, j.settings.max_new_tokens) for j in jobs] == \
        [(8, "cpu", 2), (16, "cpu", 2)]
    for key, value in (("max_new_tokens", 4), ("block_size", 4), ("model", "small"), ("seed", 1),
                       ("accept", "sglang")):
        flag = "--" + key.replace("_", "-")
        with pytest.raises(UsageError, match=f"^{flag} cannot be combined with --case"):
            plan_case(case, none, {**CASE_OWNED, key: value}, "auto", None)
    with pytest.raises(UsageError, match="--device must be auto, cpu or cuda"):
        plan_case(case, none, dict(CASE_OWNED), "tpu", None)
    out = tmp_path / "s.jsonl"
    r = _ddcheck("sweep", "--case", str(case), "--seed", "3", "--out", str(out))
    assert r.returncode == 2 and "--seed cannot be combined with --case" in r.stderr and not out.exists()
