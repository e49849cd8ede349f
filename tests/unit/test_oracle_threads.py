"""The float64 oracle's threads (check/step_clock.py): a checkpoint's oracle on the CPU takes the cores other
processes leave idle, never every core of a loaded machine, and the causal twin computes on the engine's threads
whatever the oracle's are. On 2 shared cores at a load of ~4.6, 2 threads made every op wait for a descheduled
thread: the oracle of SmolLM2-135M at budget 32, topk 4, batch 4 took 68.5 s per step, 4.1 s on 1 thread
(benchmarks/README.md, oracle-speed)."""
from __future__ import annotations

from dataclasses import replace

import os

import torch

import harness.check.differential as differential
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
import harness.check.step_clock as step_clock
from harness.check.step_clock import idle_cores, machine_cores, oracle_thread_count, others_busy
from harness.engine.settings import RunSettings


def test_idle_cores_leave_what_others_keep_busy():
    assert idle_cores(2, busy=lambda: 0.0, host_cpus=2) == 2              # nothing else runs: every core
    assert idle_cores(2, busy=lambda: 0.2, host_cpus=2) == 2              # a core busy a tenth of the time: idle
    assert idle_cores(2, busy=lambda: 0.3, host_cpus=2) == 1              # busy over a quarter of the time: taken
    assert idle_cores(2, busy=lambda: 4.6, host_cpus=2) == 1              # loaded: one thread, never two
    assert idle_cores(16, busy=lambda: 2.5, host_cpus=16) == 13
    assert idle_cores(8, busy=lambda: 8.0, host_cpus=64) == 7             # 8 of 64 host CPUs: their share
    # a load average that counts this process's own threads is not read where the measurement is known
    assert idle_cores(2, lambda: (1.8, 1.0, 1.0), 2, busy=lambda: 0.0) == 2


def test_without_proc_stat_the_load_average_stands_for_the_others():
    none = lambda: None   # noqa: E731  (no /proc/stat)
    assert idle_cores(2, lambda: (4.6, 4.0, 3.0), 2, busy=none) == 1     # loaded: one thread, never two
    assert idle_cores(2, lambda: (1.0, 1.0, 1.0), 2, busy=none) == 2     # one running thread: this process's
    assert idle_cores(16, lambda: (3.5, 0.0, 0.0), 16, busy=none) == 13  # 2.5 CPUs busy elsewhere
    assert idle_cores(16, lambda: (0.2, 0.0, 0.0), 16, busy=none) == 16
    assert idle_cores(2, lambda: (30.0, 0.0, 0.0), 64, busy=none) == 1   # 2 of 64 host CPUs: their share
    assert idle_cores(8, lambda: (9.0, 0.0, 0.0), 64, busy=none) == 7

    def unknown():
        raise OSError("no load average")
    assert idle_cores(4, unknown, 4, busy=none) == 4


def test_others_busy_takes_this_process_out_of_the_hosts_busy_ticks():
    """Over the window: 150 of 400 ticks busy on 4 CPUs, 50 of them this process's: 100 / 400 * 4 = 1 CPU."""
    stats, own = iter([(1000, 10000), (1150, 10400)]), iter([20.0, 70.0])
    assert others_busy(read_stat=lambda: next(stats), own_ticks=lambda: next(own), sleep=lambda s: None,
                       host_cpus=4) == 1.0
    stats, own = iter([(1000, 10000), (1100, 10400)]), iter([0.0, 120.0])   # own ticks counted apart: never < 0
    assert others_busy(read_stat=lambda: next(stats), own_ticks=lambda: next(own), sleep=lambda s: None,
                       host_cpus=4) == 0.0

    def unreadable():
        raise OSError("no /proc/stat")
    assert others_busy(read_stat=unreadable, sleep=lambda s: None) is None
    if os.path.exists("/proc/stat"):   # Linux: a measurement, in CPUs
        assert 0.0 <= others_busy(window_s=0.05) <= (os.cpu_count() or 1)


def test_a_checkpoint_oracle_on_the_cpu_takes_the_idle_cores(monkeypatch):
    monkeypatch.setattr(step_clock, "others_busy", lambda: 50.0 * (os.cpu_count() or 1))
    assert oracle_thread_count("smollm2-135m", "cpu") == 1
    monkeypatch.setattr(step_clock, "others_busy", lambda: 0.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0 * (os.cpu_count() or 1), 0.0, 0.0), raising=False)
    assert oracle_thread_count("smollm2-135m", "cpu") == machine_cores()   # this process's load is not another's
    before = torch.get_num_threads()
    assert oracle_thread_count("tiny", "cpu") == before            # a preset: the caller's threads
    assert oracle_thread_count("smollm2-135m", "cuda") == before   # a GPU oracle: the caller's threads


def test_the_twin_runs_on_the_engine_threads_the_oracle_on_its_own(monkeypatch):
    torch.set_num_threads(1)   # the CLI's engine threads
    p = prepare(RunSettings(backend="torch", dtype="bfloat16", topk=2, budget=6, batch=2, max_new_tokens=6))
    p = replace(p, every_twin=True)   # the twin of every node: called on every step
    assert p.twin is not None and p.rule is not None
    monkeypatch.setattr(differential, "oracle_thread_count", lambda model, device: 2)
    seen: dict[str, set[int]] = {"twin": set(), "oracle": set()}
    twin_logits, prepare_step = p.twin._step_logits, p.oracle.prepare_step

    def twin(*a, **k):
        seen["twin"].add(torch.get_num_threads())
        return twin_logits(*a, **k)

    def oracle(*a, **k):
        seen["oracle"].add(torch.get_num_threads())
        return prepare_step(*a, **k)
    monkeypatch.setattr(p.twin, "_step_logits", twin)
    monkeypatch.setattr(p.oracle, "prepare_step", oracle)
    summary = check(p, RecordWriter(None), localize=False)
    assert summary.passed and summary.steps > 1
    assert seen == {"twin": {1}, "oracle": {2}}
    assert torch.get_num_threads() == 1
