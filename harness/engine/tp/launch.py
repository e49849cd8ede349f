"""ddcheck launches the ranks itself (torch.multiprocessing's forkserver, else spawn; the user
never starts a rank by hand). The process that runs the check is not a
rank: it starts `--tp` ranks, each builds its own engine and verify
metadata, and rank 0 streams its rounds back through a queue. A rank that
raises ends the run with its traceback; a rank that dies or goes silent for
DDCHECK_TP_TIMEOUT_S seconds (default 300) is an error, never a hang.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property
from typing import Iterator

import torch
import torch.multiprocessing as mp

from ddschema import ModelConfig
from harness.engine.attn.registry import serves_batches
from harness.engine.ddtree.accept import cut_at_stop
from harness.engine.ddtree.accept_sglang import pick_acceptors
from harness.engine.loop import Request, StepResult
from harness.engine.pipeline import Pipeline
from harness.engine.settings import NotRunnableHere, PromptSpec, RunSettings, UsageError
from harness.engine.tp.group import join, leave, rank_device
from harness.engine.tp.rank import RankEngine, RankJob, on_cpu
from harness.engine.tp.sharding import kv_heads_of_rank, shard_plan, tp_refusal

TIMEOUT_ENV = "DDCHECK_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
AHEAD = 16   # rounds rank 0 may run ahead of the check (each holds its full-vocabulary logits)


class RankFailed(RuntimeError):
    """A rank raised, died or went silent: one line naming the rank; a rank's traceback is its cause."""


class RankTraceback(Exception):
    """The traceback a rank printed, carried as the cause of the RankFailed it led to."""


def rank_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < value < 86400:
        raise UsageError(f"{TIMEOUT_ENV} must be > 0 and under a day of seconds, got {raw!r}")
    return value


def tp_refusals(s: RunSettings, cfg: ModelConfig) -> None:
    """What --tp cannot run with: a usage error (exit 2) before anything is spawned."""
    if serves_batches(s.backend):
        raise NotRunnableHere(f"--tp shards ddcheck's own model; --backend {s.backend} runs SGLang's serving backend "
                              "in one process (use --backend sglang-triton or torch)")
    if s.device.startswith("cuda") and torch.cuda.device_count() < s.tp:
        raise NotRunnableHere(f"--tp {s.tp} on CUDA needs {s.tp} GPUs; this machine has {torch.cuda.device_count()}")
    if s.drafter == "self" or (s.drafter == "auto" and s.drafter_config(cfg.num_layers).kind == "self"):
        raise UsageError("--tp runs the seeded drafter (--drafter noisy): the self-draft's early exit is not sharded")
    reason = tp_refusal(cfg, s.tp)
    if reason:
        raise UsageError(reason)


class TPEngine:
    """The engine under test over `s.tp` ranks, as the check reads one engine:
    `rounds()` yields rank 0's StepResults (each with the ranks' audit findings);
    `requests` and `finish_findings` are rank 0's as of the last round."""

    def __init__(self, settings: RunSettings, cfg: ModelConfig, weights: dict[str, torch.Tensor], backend,
                 prompts: list[PromptSpec], prompt_ids: list[list[int]], pipeline: Pipeline = Pipeline()):
        tp_refusals(settings, cfg)
        self.s, self.cfg, self._weights = settings, cfg, weights
        self.kernel = backend
        self.backend = pipeline.attention(backend) if pipeline.attention is not None else backend
        self.pipeline = pipeline
        self.q_len = pipeline.width(settings.budget)
        self.max_context = max(map(len, prompt_ids)) + settings.max_new_tokens + self.q_len + 2
        if self.max_context > cfg.max_position:
            raise UsageError(f"prompts + --max-new-tokens + q_len need {self.max_context} positions; "
                             f"the model has {cfg.max_position}")
        for rank in range(settings.tp):   # a layout the ranks cannot build is refused here, not in a rank
            shard_plan(cfg, rank, settings.tp, pipeline.kv_head_layout or kv_heads_of_rank)
        self.accept, self.cross_accept = pick_acceptors(settings.accept, pipeline.accept)
        self.requests = [Request(i, list(ids), spec, -1) for i, (spec, ids) in enumerate(zip(prompts, prompt_ids))]
        self.finish_findings: list = []
        self.graph, self.serving, self.served_meta = None, None, None
        self.timeout_s = rank_timeout_s()
        try:
            pickle.dumps(pipeline)
        except Exception as e:  # noqa: BLE001  (a closure in a stage: name it as the user's problem)
            raise UsageError(f"--tp sends the pipeline's stages to each rank; one cannot be pickled ({e})") from None
        self._job = RankJob(settings, cfg, {n: t.detach().cpu() for n, t in weights.items()}, tuple(prompts),
                            tuple(tuple(x) for x in prompt_ids), pipeline, "", self.timeout_s)

    @cached_property
    def model(self):
        """The whole model in one process (the noise-floor twin's; never the one under test)."""
        from harness.engine.model.llama import LlamaModel
        return LlamaModel(self.cfg, self._weights, self.s.torch_dtype, self.s.device)

    def rounds(self) -> Iterator[StepResult]:
        for kind, payload in run_ranks(self._job):
            if kind == "step":
                result, self.requests = payload
                yield self._cross_checked(result)
            else:
                self.requests, self.finish_findings = payload


    def _cross_checked(self, result: StepResult) -> StepResult:
        """Each request's acceptance by the other acceptor over the same rows, here rather than in the ranks
        (the ranks then skip importing SGLang's)."""
        if self.cross_accept is None or self.s.accept != "walk":
            return result
        return replace(result, requests=tuple(
            replace(rs, cross_check=cut_at_stop(rs.tree, self.cross_accept(rs.tree, rs.logits.argmax(-1).tolist()),
                                                self.s.eos_id)) for rs in result.requests))


def rank_context():
    """Forkserver where the platform has it (one server imports torch and the engine once; each rank is a fork
    of it, no CUDA context inherited), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def run_ranks(job: RankJob) -> Iterator[tuple[str, tuple]]:
    """Spawn the ranks; yield rank 0's ("step", (result, requests)) messages, then ("done", (requests,
    finish_findings)). Raises RankFailed for a rank that raised, died or went silent. The ranks are ended
    when the caller stops early."""
    ctx = rank_context()
    results = ctx.Queue(maxsize=AHEAD)   # rank 0 runs at most AHEAD rounds ahead of the check
    fd, init_file = tempfile.mkstemp(prefix="ddcheck-tp-")
    os.close(fd)
    os.unlink(init_file)   # the rendezvous file must not exist before the group forms
    job = replace(job, init_file=init_file)
    procs = [ctx.Process(target=rank_main, args=(r, job, results), daemon=True) for r in range(job.settings.tp)]
    try:
        with _main_not_reimported():
            for p in procs:
                p.start()
        while True:
            kind, payload = _next_message(results, procs, job.timeout_s)
            if kind == "error":
                rank, error, tb = payload
                raise RankFailed(f"rank {rank} of --tp {job.settings.tp} raised {error}") from RankTraceback(tb)
            yield kind, payload
            if kind == "done":
                return
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=10)
        results.close()
        if os.path.exists(init_file):
            os.unlink(init_file)


@contextmanager
def _main_not_reimported():
    """Spawned ranks need only harness's modules: hide the caller's main script from spawn, which would
    otherwise run it again in each rank (a script or notebook without a __main__ guard)."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _next_message(results, procs, timeout_s: float, grace_s: float = 2.0) -> tuple[str, tuple]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return pickle.loads(results.get(timeout=0.2))
        except queue_mod.Empty:
            pass
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead or all(p.exitcode == 0 for p in procs):
            try:   # a rank that raised says so just before it exits; rank 0's last message may be in flight
                return pickle.loads(results.get(timeout=grace_s))
            except queue_mod.Empty:
                if dead:
                    r, code = dead[0]
                    raise RankFailed(f"rank {r} died with exit code {code} without a message") from None
                raise RankFailed("every rank exited without rank 0's results") from None
        if time.monotonic() > deadline:
            raise RankFailed(f"no rank reported for {timeout_s:g} s ({TIMEOUT_ENV}); ranks alive: "
                             f"{[r for r, p in enumerate(procs) if p.is_alive()]}")


def rank_main(rank: int, job: RankJob, results) -> None:
    """One rank's process: join the group, build its engine over its shard, run the rounds. Every message
    waits at most the rank timeout for room in the queue: a rank whose launcher is gone ends, never hangs."""
    def send(msg) -> None:
        results.put(pickle.dumps(msg), timeout=job.timeout_s)

    try:
        s = job.settings
        group = join(rank, s.tp, job.init_file, s.device, job.timeout_s)
        s = replace(s, device=rank_device(s.device, rank))
        p = job.pipeline
        pipeline = p.rank_stages(p, rank, s.tp) if p.rank_stages is not None else p
        shard = shard_plan(job.cfg, rank, s.tp, pipeline.kv_head_layout or kv_heads_of_rank)
        from harness.engine.attn import make_backend
        engine = RankEngine(job, s, shard, group, make_backend(s.backend, s.device, s.torch_dtype), pipeline)
        for result in engine.rounds():
            if rank == 0:
                send(("step", (on_cpu(result), engine.requests)))
        if rank == 0:
            send(("done", (engine.requests, engine.finish_findings)))
    except BaseException as e:  # noqa: BLE001  (reported to the launcher, which ends the run with it)
        error = traceback.format_exception_only(type(e), e)[-1].strip()
        try:
            send(("error", (rank, error, f"rank {rank}: {traceback.format_exc()}")))
        except queue_mod.Full:
            pass   # nobody reads any more: the launcher is gone
    finally:
        leave()
