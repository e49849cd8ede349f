"""A setting whose worker process dies (a kernel call that kills it) is that
setting's verdict; the sweep or gate around it survives and every other
setting finishes (harness/workflows/worker_deaths.py; issue 21, case i)."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from harness.check.crash import ROOT
from harness.workflows.worker_deaths import died_result, run_pool_surviving_deaths


@dataclass(frozen=True)
class _Settings:
    name: str

    def command(self) -> str:
        return f"ddcheck run --{self.name}"


@dataclass(frozen=True)
class _Job:
    index: int
    settings: _Settings


@dataclass(frozen=True)
class _Died:
    index: int
    setting: str
    summary: dict
    lines: tuple
    wall_s: float


def _run(job: _Job) -> dict:   # in a spawned worker: setting "dies" kills its own process
    if job.settings.name == "dies":
        os.kill(os.getpid(), signal.SIGSEGV)
    return {"index": job.index, "passed": True}


def test_a_dead_worker_is_its_settings_verdict_and_the_rest_finish():
    jobs = [_Job(i, _Settings("dies" if i == 1 else f"ok{i}")) for i in range(4)]
    results = []
    run_pool_surviving_deaths(jobs, 2, _run, results.append, _Died)
    by_index = {(r["index"] if isinstance(r, dict) else r.index): r for r in results}
    assert sorted(by_index) == [0, 1, 2, 3] and len(results) == 4
    assert all(by_index[i] == {"index": i, "passed": True} for i in (0, 2, 3))
    dead = by_index[1]
    assert dead.summary["passed"] is False and dead.setting == "ddcheck run --dies"
    assert "died" in dead.summary["error"] and "Segmentation fault" in dead.summary["error"]


def test_a_death_in_the_engines_code_is_the_engines_crash_named_by_its_stage():
    dump = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
            f'  File "{ROOT}/harness/engine/attn/torch_backend.py", line 32 in forward\n'
            f'  File "{ROOT}/harness/engine/model/llama.py", line 99 in _attention\n')
    r = died_result(_Job(7, _Settings("x")), dump, 1.0, _Died)
    assert r.summary["crash"]["side"] == "engine" and r.summary["first"]["what"] == "crash"
    assert r.summary["stage"] == "attention" and r.summary["quantity"] == "crash" and r.index == 7


def _run_replaced(job: _Job) -> dict:   # dies as run; with the attention replaced (the rerun's env) it passes
    from harness.engine.attn.exact import REPLACE_STAGE_ENV
    if os.environ.get(REPLACE_STAGE_ENV) != "attention":
        os.kill(os.getpid(), signal.SIGSEGV)
    return {"index": job.index, "summary": {"verdict": "pass", "passed": True, "max_rel_err": 1e-7,
                                            "tolerance": 1e-5}}


def _run_still_dies(job: _Job) -> dict:
    os.kill(os.getpid(), signal.SIGSEGV)


_ENGINE_DUMP = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
                f'  File "{ROOT}/harness/engine/attn/torch_backend.py", line 32 in forward\n')


def test_a_dead_worker_whose_float64_attention_rerun_matches_is_a_proven_crash_of_the_attention():
    from harness.workflows.worker_deaths import replaced_rerun
    job = _Job(3, _Settings("x"))
    r = died_result(job, _ENGINE_DUMP, 1.0, _Died, lambda: replaced_rerun(_run_replaced, job))
    assert r.summary["first"]["what"] == "proven-crash" and r.summary["stage"] == "attention"
    assert r.summary["replacements"][0]["correct"] is True


def test_a_dead_worker_whose_rerun_dies_too_stays_a_crash():
    from harness.workflows.worker_deaths import replaced_rerun
    job = _Job(3, _Settings("x"))
    r = died_result(job, _ENGINE_DUMP, 1.0, _Died, lambda: replaced_rerun(_run_still_dies, job))
    assert r.summary["first"]["what"] == "crash" and not r.summary.get("replacements")
