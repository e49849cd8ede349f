"""Settings as Ray tasks: a local Ray cluster by default (`workers` CPUs),
an existing one by address. Each setting is one task holding the resources
it needs (a GPU for a setting on cuda, a tensor-parallel group's devices
together where the setting has a `tp` axis); results stream back as tasks
finish. A worker that dies (killed, out of memory, its node lost) reruns its
setting, up to MAX_RERUNS times; the setting's summary record then counts
them (`reruns`, `rerun_reasons`). Ray is an optional extra (`.[ray]`).

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Callable

from harness.engine.settings import RunSettings, UsageError
from harness.workflows.executors.base import Died, Done, ExecutorSpec, Task

MAX_RERUNS = 2     # a setting whose worker dies this many times more is reported as one ddcheck could not judge
ENV_PASSED = ("TRITON_INTERPRET", "DDCHECK_THREADS")   # what a worker must see as the driver does


def import_ray():
    """The ray module, or a usage error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray, an optional extra: pip install 'ddcheck[ray]' "
                         "(or use --executor local, the default)") from None
    return ray


@dataclass(frozen=True)
class TaskResources:
    """What one setting's task holds: CPUs, and GPUs on cuda (a TP group's together)."""
    num_cpus: int
    num_gpus: int

    def __post_init__(self) -> None:
        if self.num_cpus < 1 or self.num_gpus < 0:
            raise ValueError(f"a task needs at least one CPU and no negative GPUs, got {self}")


def resources_for(s: RunSettings) -> TaskResources:
    """One rank per device: a setting with tp N holds N GPUs on cuda, N CPUs on the CPU."""
    ranks = s.tp   # tensor-parallel ranks (harness/engine/tp): one device each, held together
    on_gpu = s.device.startswith("cuda")
    return TaskResources(num_cpus=1 if on_gpu else ranks, num_gpus=ranks if on_gpu else 0)


def _run_in_worker(task: Callable, job, cpus: int):
    import torch
    torch.set_num_threads(cpus)   # one setting per CPU it holds; more intra-op threads would oversubscribe
    return task(job)


@dataclass(frozen=True)
class RayExecutor:
    workers: int = 1
    address: str | None = None     # None: start a local cluster of `workers` CPUs for this run
    max_reruns: int = MAX_RERUNS
    name: str = "ray"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_reruns < 0:
            raise ValueError(f"workers >= 1 and max_reruns >= 0, got {self.workers}, {self.max_reruns}")

    @classmethod
    def from_spec(cls, spec: ExecutorSpec) -> "RayExecutor":
        import_ray()   # a missing extra is a usage error before anything runs
        return cls(spec.workers, spec.address)

    def run(self, jobs: list, done: Done, task: Task, died: Died, crashed=None) -> None:
        # `crashed` is unused: a Ray worker's death is rerun (`died` once it keeps dying)
        ray = import_ray()
        started = self._connect(ray)
        remote = ray.remote(_run_in_worker)
        deaths = _worker_deaths(ray)

        def submit(job):
            need = resources_for(job.settings)
            return remote.options(num_cpus=need.num_cpus, num_gpus=need.num_gpus, max_retries=0,
                                  name=f"ddcheck setting {job.index}").remote(task, job, need.num_cpus)

        pending = {submit(j): (j, ()) for j in jobs}
        try:
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                job, reasons = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except deaths as e:
                    reasons = (*reasons, _reason(e))
                    if len(reasons) <= self.max_reruns:
                        pending[submit(job)] = (job, reasons)
                        continue
                    result = died(job, reasons)
                done(with_reruns(result, reasons, reruns=min(len(reasons), self.max_reruns)))
        except KeyboardInterrupt:   # stop what runs; the finished settings are the caller's
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            if started:
                ray.shutdown()

    def _connect(self, ray) -> bool:
        """Join the cluster at `address`, or start a local one; True when this run started it."""
        if ray.is_initialized():
            return False
        env = {k: os.environ[k] for k in ENV_PASSED if k in os.environ}
        common = dict(include_dashboard=False, log_to_driver=False, configure_logging=False,
                      runtime_env={"env_vars": env} if env else None)
        if self.address is not None:
            try:
                ray.init(address=self.address, **common)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise UsageError(f"--ray-address {self.address}: cannot join that Ray cluster: {e}") from None
        else:
            ray.init(num_cpus=self.workers, **common)
        return True


def _worker_deaths(ray) -> tuple[type, ...]:
    """The errors that mean the worker (or its node) went, not the setting raising."""
    ex = ray.exceptions
    return (ex.WorkerCrashedError, ex.NodeDiedError, ex.OutOfMemoryError, ex.ObjectLostError,
            ex.LocalRayletDiedError)


def _reason(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def with_reruns(result, reasons: tuple[str, ...], reruns: int | None = None):
    """The result with its summary record counting the reruns (`reruns`, by
    default one per death) and each worker death's reason (unchanged when no
    worker died)."""
    if not reasons:
        return result
    lines = list(result.lines)
    ats = [i for i, ln in enumerate(lines) if json.loads(ln).get("kind") == "summary"]
    if not ats:   # a usage error: no records to count them in
        return result
    at = ats[-1]
    summary = {**json.loads(lines[at]), "reruns": len(reasons) if reruns is None else reruns,
               "rerun_reasons": list(reasons)}
    lines[at] = json.dumps(summary, allow_nan=False)
    return replace(result, summary=summary, lines=tuple(lines))
