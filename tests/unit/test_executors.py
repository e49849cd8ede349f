"""The executors behind sweep and gate (harness/workflows/executors): the
spec's usage errors, the local executor's results in setting order whatever
order they finish in, a task's resources, reruns counted in the summary,
and `--executor ray` without Ray installed (exit 2, nothing written)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engine.settings import RunSettings, UsageError
from harness.workflows.executors import ExecutorSpec, make_executor
from harness.workflows.executors.local import LocalExecutor
from harness.workflows.executors.ray_executor import resources_for, with_reruns
from harness.workflows.sweep import SettingJob, SettingResult, run_jobs

ROOT = Path(__file__).resolve().parents[2]
HAS_RAY = importlib.util.find_spec("ray") is not None


def test_spec_refuses_an_unknown_executor_no_workers_and_an_address_without_ray():
    with pytest.raises(UsageError, match="--executor must be one of local, ray"):
        ExecutorSpec("dask", 2)
    with pytest.raises(UsageError, match="--workers must be at least 1"):
        ExecutorSpec("local", 0)
    with pytest.raises(UsageError, match="--ray-address needs --executor ray"):
        ExecutorSpec("local", 2, "10.0.0.1:6379")
    assert isinstance(make_executor(ExecutorSpec("local", 3)), LocalExecutor)


class _Reversed:
    """An executor that finishes the settings last to first."""
    name = "reversed"

    def run(self, jobs, done, task, died, crashed=None):
        for job in reversed(jobs):
            done(SettingResult(job.index, job.settings.command(), {"passed": True}, None, (), 0.0))


def test_results_come_back_in_setting_order_whatever_order_they_finish(monkeypatch):
    import harness.workflows.sweep as sweep
    monkeypatch.setattr(sweep, "make_executor", lambda spec: _Reversed())
    jobs = [SettingJob(i, RunSettings(budget=b, backend="torch")) for i, b in enumerate((16, 8, 4))]
    streamed = []
    results = run_jobs(jobs, 2, lambda job, r: streamed.append(job.index))
    assert [r.index for r in results] == [0, 1, 2]
    assert sorted(streamed) == [0, 1, 2] and streamed != [0, 1, 2]   # streamed as they finished


def test_a_setting_holds_a_gpu_on_cuda_and_a_tp_groups_devices_together():
    assert (resources_for(RunSettings(device="cpu")).num_cpus, resources_for(RunSettings(device="cpu")).num_gpus) == (1, 0)
    cuda = resources_for(RunSettings(device="cuda"))
    assert (cuda.num_cpus, cuda.num_gpus) == (1, 1)

    tp2 = resources_for(RunSettings(device="cuda", tp=2, cuda_graph=False))
    assert (tp2.num_cpus, tp2.num_gpus) == (1, 2)   # a TP group's GPUs in one task: on one node, together
    tp2_cpu = resources_for(RunSettings(device="cpu", tp=2, cuda_graph=False))
    assert (tp2_cpu.num_cpus, tp2_cpu.num_gpus) == (2, 0)   # a gloo rank per CPU


def test_reruns_are_counted_in_the_summary_record_and_nothing_else_changes():
    lines = (json.dumps({"kind": "node", "node": 0}), json.dumps({"kind": "summary", "passed": True}))
    r = SettingResult(0, "ddcheck run", {"kind": "summary", "passed": True}, None, lines, 1.0)
    assert with_reruns(r, ()) is r
    again = with_reruns(r, ("WorkerCrashedError: killed",))
    summary = json.loads(again.lines[-1])
    assert summary["reruns"] == 1 and summary["rerun_reasons"] == ["WorkerCrashedError: killed"]
    assert again.summary == summary and again.lines[0] == lines[0] and again.passed


def test_a_setting_whose_worker_kept_dying_is_one_ddcheck_could_not_judge():
    from harness.workflows.sweep import exit_code, unjudged_lines, worker_died
    job = SettingJob(0, RunSettings(budget=8, backend="torch"))
    r = worker_died(job, ("WorkerCrashedError: a", "WorkerCrashedError: b", "WorkerCrashedError: c"))
    assert not r.passed and r.summary["verdict"] == "internal-error" and "died 3 times" in r.summary["error"]
    assert [json.loads(ln)["kind"] for ln in r.lines] == ["crash", "summary"]
    assert exit_code([r], True) == 3 and "died 3 times" in unjudged_lines([r])[0]


@pytest.mark.skipif(HAS_RAY, reason="Ray is installed here: the missing-extra message cannot show")
@pytest.mark.parametrize("command", ["gate", "sweep"])
def test_executor_ray_without_ray_is_a_usage_error_that_writes_nothing(tmp_path, command):
    out = tmp_path / "r.jsonl"
    args = [command, "--executor", "ray", "--out", str(out)] + (["--budget", "4"] if command == "sweep" else [])
    r = subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--executor ray needs Ray" in r.stderr and "ddcheck[ray]" in r.stderr
    assert not out.exists()
