"""`ddcheck run --tp N`: ddcheck spawns N gloo-connected ranks on the CPU, each building its own verify
metadata; a fault-free run passes, padded-kv-visible and a TP fault are caught and named, a rank that
raises ends the run with its traceback, and what --tp cannot run with is refused with exit 2."""
from __future__ import annotations

import json
import queue
from dataclasses import replace
from functools import partial
from operator import truediv

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from harness.engine.tp.launch import RankFailed, _next_message

cli._register()
TP2 = ["run", "--tp", "2", "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch"]


def _summary(path) -> dict:
    return [json.loads(x) for x in path.read_text().splitlines() if '"kind": "summary"' in x][-1]


def test_tp2_fault_free_run_passes(tmp_path):
    out = tmp_path / "tp2.jsonl"
    result = CliRunner().invoke(cli.app, TP2 + ["--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = _summary(out)
    assert summary["passed"] and summary["steps"] >= 3 and "--tp 2" in summary["setting"]


@pytest.mark.parametrize("fault,cls", [("tp-shifted-kv-indices", "rank-kv-indices"), ("padded-kv-visible", "padding-leak")])
def test_tp2_catches_and_names_the_fault(tmp_path, fault, cls):
    """A TP fault by the ranks' audit; padded-kv-visible by the oracle, named by a replay in one process."""
    out = tmp_path / "f.jsonl"
    result = CliRunner().invoke(cli.app, TP2 + ["--fault", fault, "--max-new-tokens", "10", "--stop-after", "1",
                                                "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert _summary(out)["fault_class"] == cls


def test_a_rank_that_raises_ends_the_run_with_its_traceback():
    """Every rank's stage raises (a TypeError inside the rank): an engine crash naming the rank, not a hang."""
    p = prepare(RunSettings(tp=2, backend="torch", max_new_tokens=10))
    p = replace(p, engine=type(p.engine)(p.settings, p.engine.cfg, p.loaded.weights, p.engine.kernel, p.prompts,
                                         p.prompt_ids, replace(p.engine.pipeline, rank_stages=partial(truediv, 1))))
    writer = RecordWriter(None)
    summary = check(p, writer)
    assert summary.crash["side"] == "engine" and summary.verdict == "diverge"
    assert "RankFailed: rank " in summary.error and "raised TypeError" in summary.error
    crash = next(json.loads(x) for x in writer.lines if '"kind": "crash"' in x)
    assert "in rank_main" in crash["traceback"] and "RankTraceback" in crash["traceback"]


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def is_alive(self):
        return self.exitcode is None


def test_a_rank_dead_without_a_message_is_an_error():
    with pytest.raises(RankFailed, match="rank 1 died with exit code -9"):
        _next_message(queue.Queue(), [_Proc(None), _Proc(-9)], 30.0, grace_s=0.1)


def test_silent_ranks_time_out():
    with pytest.raises(RankFailed, match=r"no rank reported for 0.3 s \(DDCHECK_TP_TIMEOUT_S\); ranks alive: \[0, 1\]"):
        _next_message(queue.Queue(), [_Proc(None), _Proc(None)], 0.3)


@pytest.mark.parametrize("flags,env,words", [
    (["--cuda-graph"], {}, "runs eagerly"),
    (["--impl", "sglang:x"], {}, "a port under test"),
    (["--tp", "3"], {}, "attention heads"),
    (["--drafter", "self"], {}, "seeded drafter"),
    ([], {"DDCHECK_TP_TIMEOUT_S": "soon"}, "DDCHECK_TP_TIMEOUT_S"),
    ([], {"DDCHECK_TP_TIMEOUT_S": "inf"}, "DDCHECK_TP_TIMEOUT_S"),
])
def test_what_tp_cannot_run_is_a_usage_error(tmp_path, flags, env, words):
    out = tmp_path / "r.jsonl"
    args = [a for a in TP2 if a != "--no-cuda-graph"] + flags + ["--out", str(out)]
    result = CliRunner().invoke(cli.app, args, env=env)
    assert result.exit_code == 2, result.output
    assert words in result.output and not out.exists()


CASE = """
name = "t"
model = "tiny"
max_new_tokens = 12
[[prompts]]
name = "code"
length = 6
accuracy = 0.9
[[matrix]]
tp = [1, 2]
[[faults]]
name = "tp-stale-mask"
tp = 2
"""


def test_tp_is_a_case_and_sweep_axis(tmp_path):
    from harness.workflows.cases import load_case
    from harness.workflows.sweep import short_label
    (tmp_path / "c.toml").write_text(CASE)
    case = load_case(tmp_path / "c.toml")
    assert [s.tp for s in case.settings()] == [1, 2]
    assert case.faults[0].under.settings(case.base)[0].tp == 2
    assert [short_label(s).endswith("tp2") for s in case.settings()] == [False, True]


def test_fault_self_check_skips_tp_faults_where_ranks_cannot_run():
    """A port under test, or too few GPUs: the TP faults are skipped rows, not a usage error of the whole check."""
    from harness.workflows.fault_selftest import base_settings, self_check, tp_runs_here
    base = base_settings("torch", True)
    assert tp_runs_here(4, base) and tp_runs_here(1, replace(base, impl="x:y"))
    assert not tp_runs_here(2, replace(base, impl="x:y")) and not tp_runs_here(2, replace(base, backend="sglang-serving"))
    rows = list(self_check("torch", seeds=0, quick=True, faults=["tp-stale-mask"], device="cpu", impl="sglang:nowhere"))
    assert rows == [None]


@pytest.mark.parametrize("backend", ["sglang-serving", "sglang-serving-dflash"])
def test_serving_backends_are_refused_under_tp(backend):
    """SGLang's serving backend builds its own metadata in one process: refused before any rank starts."""
    from harness.engine.model.presets import PRESETS
    from harness.engine.settings import NotRunnableHere
    from harness.engine.tp.launch import tp_refusals
    with pytest.raises(NotRunnableHere, match="serving backend"):
        tp_refusals(RunSettings(tp=2, backend=backend), PRESETS["tiny"])
    tp_refusals(RunSettings(tp=2, backend="torch"), PRESETS["tiny"])   # ddcheck's own backends are not


class _FullQueue:
    """A queue nobody reads: every put times out."""

    def __init__(self):
        self.timeouts = []

    def put(self, msg, timeout=None):
        self.timeouts.append(timeout)
        raise queue.Full


def test_a_rank_whose_launcher_is_gone_ends(tmp_path):
    """rank_main in this process as a group of one: its step and then its error wait the rank timeout for
    room in the queue, and the rank returns instead of blocking forever."""
    from harness.engine.tp.launch import rank_main
    job = prepare(RunSettings(tp=2, backend="torch", max_new_tokens=10)).engine._job
    job = replace(job, settings=replace(job.settings, tp=1), init_file=str(tmp_path / "rendezvous"), timeout_s=7.0)
    q = _FullQueue()
    rank_main(0, job, q)
    assert q.timeouts == [7.0, 7.0]   # the first round, then the error saying it could not be sent
