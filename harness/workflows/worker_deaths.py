"""A sweep or gate survives a setting whose process dies (a kernel call that
kills it: signal 11 or 6, nothing to catch). Settings run in lanes: each lane
is a one-worker process pool that runs one setting at a time, its Python
stack dumped by the fault handler on a fatal signal. A lane whose worker
dies is that setting's verdict (a crash attributed from the dump to the side
whose frame is innermost, named by the stage of the engine's file,
harness/check/crash.py); the lane gets a fresh worker and goes on with the
next setting, and every other lane is untouched.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import faulthandler
import json
import os
import re
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Callable

FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')
VERDICTS = {"engine": "diverge", "oracle": "oracle-crash", "ddcheck": "internal-error"}


def run_pool_surviving_deaths(ordered: list, n_jobs: int, run: Callable, done: Callable, make_result: Callable,
                              initializer: Callable | None = None) -> None:
    """run(job) -> SettingResult for every job in order of start, `done` called with each as it ends; a dead
    worker costs only its own setting, whose result make_result(index, setting, summary, lines, wall_s) builds."""
    queue = list(ordered)
    lane = lambda: ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=initializer)  # noqa: E731
    lanes = [lane() for _ in range(min(n_jobs, len(queue)))]
    running: dict = {}   # future -> (lane index, job, dump file, start time)

    def start(i: int) -> None:
        job = queue.pop(0)
        with tempfile.NamedTemporaryFile("w", prefix="ddcheck-lane-", suffix=".dump", delete=False) as f:
            dump = f.name
        running[lanes[i].submit(_with_fault_dump, run, job, dump)] = (i, job, dump, time.perf_counter())

    try:
        for i in range(len(lanes)):
            start(i)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                i, job, dump, t0 = running.pop(f)
                try:
                    result = f.result()
                except BrokenProcessPool:   # the lane's one worker died running this job
                    with open(dump) as d:
                        result = died_result(job, d.read(), time.perf_counter() - t0, make_result,
                                             lambda: replaced_rerun(run, job, initializer))
                    lanes[i].shutdown(wait=False)
                    lanes[i] = lane()
                finally:
                    os.unlink(dump)
                done(result)
                if queue:
                    start(i)
    except KeyboardInterrupt:   # cancel what has not started; the running workers are stopped
        for pool in lanes:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    for pool in lanes:
        pool.shutdown()


def _with_fault_dump(run, job, dump: str):
    with open(dump, "w") as f:   # open while the job runs: a fatal signal writes the Python stack here
        faulthandler.enable(file=f, all_threads=False)
        try:
            return run(job)
        finally:
            faulthandler.disable()


def replaced_rerun(run: Callable, job, initializer: Callable | None = None) -> dict | None:
    """The job again in a fresh one-worker process with its attention replaced by a float64 softmax from the
    start (harness/engine/attn/exact.py REPLACE_STAGE_ENV): its summary, or None (it died too, or raised)."""
    pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=initializer)
    try:
        result = pool.submit(_with_replaced_attention, run, job).result()
    except Exception:  # noqa: BLE001  (a rerun that dies or raises proves nothing)
        return None
    finally:
        pool.shutdown(wait=False)
    summary = result.get("summary") if isinstance(result, dict) else getattr(result, "summary", None)
    return summary or None


def _with_replaced_attention(run, job):
    from harness.engine.attn.exact import REPLACE_STAGE_ENV
    os.environ[REPLACE_STAGE_ENV] = "attention"   # this worker process runs only the rerun
    return run(job)


def died_result(job, dump: str, wall_s: float, make_result: Callable, rerun: Callable[[], dict | None] | None = None):
    """The result of a setting whose process died: a crash record and a failing summary; for a death in the
    engine's code, `rerun()` (the job with its attention replaced, its summary) proves or not the attention
    stage (harness/check/crash.py prove_killed)."""
    from harness.check.crash import Crash, crash_stage, project_path, prove_killed, side_of
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
    if engine and rerun is not None:
        prove_killed(summary, rerun())
    lines = (json.dumps(crash.record(setting)), json.dumps(summary))
    return make_result(job.index, setting, summary, lines, wall_s)
