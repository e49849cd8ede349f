"""A sweep or gate survives a setting whose process dies (a kernel call that
kills it: signal 11 or 6, nothing to catch). Settings run in a shared pool of
workers; when a worker dies the pool breaks and every setting it had not
finished fails with it. Those settings then run again each in a lane of its
own (a one-worker pool, its Python stack dumped by the fault handler on a
fatal signal): a lane whose worker dies is that setting's verdict, a crash
attributed from the dump to the side whose frame is innermost and named by
the stage of the engine's file (harness/check/crash.py); the others finish
as they would have. The settings not yet started go back to a fresh pool.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import faulthandler
import json
import os
import re
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Callable

FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')
VERDICTS = {"engine": "diverge", "oracle": "oracle-crash", "ddcheck": "internal-error"}


def run_pool_surviving_deaths(ordered: list, n_jobs: int, run: Callable, done: Callable,
                              initializer: Callable | None = None) -> None:
    """run(job) -> SettingResult for every job, `done` called with each; a dead worker costs only its setting."""
    pending = list(ordered)
    while pending:
        broken = _run_shared(pending, n_jobs, run, done, initializer)
        if not broken:
            return
        # the settings the broken pool had in flight run alone; the rest wait for the next shared pool
        alone, pending = broken[:n_jobs + 1], broken[n_jobs + 1:]
        with ThreadPoolExecutor(min(n_jobs, len(alone))) as lanes:
            for r in lanes.map(lambda j: run_alone(j, run, initializer), alone):
                done(r)


def _run_shared(jobs: list, n_jobs: int, run, done, initializer) -> list:
    """The jobs a broken pool did not finish, in submission order ([] when none broke it)."""
    pool = ProcessPoolExecutor(min(n_jobs, len(jobs)), mp_context=get_context("spawn"), initializer=initializer)
    futures = {pool.submit(run, j): j for j in jobs}
    broken = []
    try:
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                try:
                    done(f.result())
                except BrokenProcessPool:
                    broken.append(futures[f])
    except KeyboardInterrupt:   # cancel what has not started; the running workers are stopped
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    order = {id(j): i for i, j in enumerate(jobs)}
    return sorted(broken, key=lambda j: order[id(j)])


def run_alone(job, run, initializer=None):
    """The job in a one-worker pool of its own; a worker that dies is the job's verdict (died_result)."""
    with tempfile.NamedTemporaryFile("w+", prefix="ddcheck-lane-", suffix=".dump", delete=False) as f:
        dump = f.name
    pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=initializer)
    t0 = time.perf_counter()
    try:
        return pool.submit(_with_fault_dump, run, job, dump).result()
    except BrokenProcessPool:
        with open(dump) as f:
            return died_result(job, f.read(), time.perf_counter() - t0)
    finally:
        pool.shutdown()
        os.unlink(dump)


def _with_fault_dump(run, job, dump: str):
    with open(dump, "w") as f:   # open while the job runs: a fatal signal writes the Python stack here
        faulthandler.enable(file=f, all_threads=False)
        try:
            return run(job)
        finally:
            faulthandler.disable()


def died_result(job, dump: str, wall_s: float):
    """The SettingResult of a setting whose process died: a crash record and a failing summary."""
    from harness.check.crash import Crash, crash_stage, project_path, side_of
    from harness.workflows.sweep import SettingResult
    side, where = "ddcheck", None
    for m in FRAME.finditer(dump):   # most recent call first
        found = side_of(m["file"])
        if found is not None:
            side, where = found, f"{project_path(m['file'])}:{m['line']} ({m['func']})"
            break
    sig = next((line.partition(": ")[2] for line in dump.splitlines() if line.startswith("Fatal Python error")),
               "a fatal signal")
    crash = Crash(side, where or "?", where or "?", f"the worker process died ({sig.strip()})", None, dump)
    setting = job.settings.command()
    engine = side == "engine"
    stage = crash_stage(crash)
    summary = {"kind": "summary", "setting": setting, "passed": False, "verdict": VERDICTS[side],
               "while": "running", "nodes_checked": 0, "divergent_nodes": 0, "steps": 0,
               "first": ({"step": -1, "request": -1, "node": -1, "depth": None, "padding_present": False,
                          "rel_err": None, "what": "crash", "detail": crash.sentence()} if engine else None),
               "crash": crash.brief(), "error": crash.error, "fault_class": "crash" if engine else None,
               "explanation": (f"The {stage} stage crashed: " if stage else "") + crash.sentence(),
               "stage": stage, "quantity": "crash" if stage else None}
    lines = (json.dumps(crash.record(setting)), json.dumps(summary))
    return SettingResult(job.index, setting, summary, None, lines, wall_s)
