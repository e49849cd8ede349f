"""The default executor: one machine, a spawned process pool (or this
process for one worker or one setting).

Workers are spawned (not forked) so that each starts clean, and each dies
with the sweep's process however that dies.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context

from harness.workflows.executors.base import Crashed, Died, Done, ExecutorSpec, Task


@dataclass(frozen=True)
class LocalExecutor:
    workers: int = 1
    name: str = "local"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")

    @classmethod
    def from_spec(cls, spec: ExecutorSpec) -> "LocalExecutor":
        return cls(spec.workers)

    def run(self, jobs: list, done: Done, task: Task, died: Died, crashed: Crashed | None = None) -> None:
        """With `crashed`, settings run in one-worker lanes and a worker that dies (a kernel call that kills
        its process) is only its own setting's verdict (workflows/worker_deaths.py); without it, one shared
        pool whose worker's death breaks it (BrokenProcessPool). `died` is unused: nothing is rerun here."""
        if self.workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                done(task(job))
            return
        if crashed is not None:
            from harness.workflows.worker_deaths import run_pool_surviving_deaths
            run_pool_surviving_deaths(jobs, self.workers, task, done, crashed, _worker_init)
            return
        _run_pool(jobs, self.workers, done, task)


def _run_pool(ordered: list, n_jobs: int, done: Done, task: Task) -> None:
    pool = ProcessPoolExecutor(min(n_jobs, len(ordered)), mp_context=get_context("spawn"), initializer=_worker_init)
    try:
        pending = {pool.submit(task, j) for j in ordered}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                done(f.result())
    except KeyboardInterrupt:   # cancel what has not started; the running workers are stopped
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def _worker_init() -> None:
    _die_with_parent()        # first: importing torch takes seconds on a loaded machine
    import torch
    torch.set_num_threads(1)  # one setting per core; intra-op threads would oversubscribe


def _die_with_parent() -> None:
    """A worker gets SIGKILL when the sweep's process dies, however it dies
    (kill -9 included), instead of running on as an orphan (Linux prctl)."""
    import ctypes
    import signal
    import sys
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except OSError:
            return
        if os.getppid() == 1:   # the parent died before the signal was armed
            os._exit(1)
