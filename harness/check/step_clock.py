"""Wall time per verify step, split between the engine and the float64 oracle (issue 10, item 3).

The engine's time is what the rounds generator spends producing a step; the oracle's is what the
comparison of that step spends (its float64 forwards dominate). On CUDA the engine's time is taken
after a synchronize, so queued kernels are counted in the step that queued them.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")


@dataclass
class StepClock:
    """Step 0 is the warm-up (issue 22 point 3): compilation, CUDA graph capture, the prompts' prefill in the
    engine, the prompts' first float64 forwards in the oracle. It is timed apart (engine_warmup_s,
    oracle_warmup_s); engine_s and oracle_s, the per-step figures and their ratio are of the steps after it."""
    engine_s: float = 0.0
    oracle_s: float = 0.0
    engine_warmup_s: float = 0.0
    oracle_warmup_s: float = 0.0
    steps: int = 0   # steps the engine produced so far; the one being checked is steps - 1

    def timed(self, rounds: Iterable[T]) -> Iterator[T]:
        """Yield the engine's steps, adding the time each took to produce to engine_s (step 0's to
        engine_warmup_s)."""
        it = iter(rounds)
        while True:
            t0 = time.perf_counter()
            try:
                step = next(it)
            except StopIteration:
                return
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.steps += 1
            self._add("engine", time.perf_counter() - t0)
            yield step

    @contextmanager
    def oracle(self) -> Iterator[None]:
        """Times the check of the current step (step 0's into oracle_warmup_s)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add("oracle", time.perf_counter() - t0)

    def _add(self, side: str, seconds: float) -> None:
        name = f"{side}_warmup_s" if self.steps <= 1 else f"{side}_s"
        setattr(self, name, getattr(self, name) + seconds)

    def per_step(self, steps: int | None = None) -> tuple[float | None, float | None]:
        """Mean engine and oracle seconds per step after the warm-up; None without such a step. `steps`, when
        given, is the caller's count of the steps produced (the clock's own otherwise)."""
        after = (self.steps if steps is None else steps) - 1
        if after <= 0:
            return None, None
        return self.engine_s / after, self.oracle_s / after

    def ratio(self) -> float | None:
        """Oracle time over engine time after the warm-up: the issue's 4x goal is on this."""
        return self.oracle_s / self.engine_s if self.steps > 1 and self.engine_s > 0 else None


@contextmanager
def timed_phase(into: dict[str, float], name: str) -> Iterator[None]:
    """Adds the wall seconds of the block to into[name]: the phases of loading a
    run (each side's checkpoint reading, the agreement check, the backend) and
    the stream check, so a slow start says where its time went."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = into.get(name, 0.0) + time.perf_counter() - t0


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity call on this platform
        return os.cpu_count() or 1


IDLE_SHARE = 0.75   # a core others keep busy less than a quarter of the time counts as idle


def idle_cores(cores: int | None = None, loadavg: Callable[[], tuple[float, float, float]] | None = None,
               host_cpus: int | None = None, busy: Callable[[], float | None] | None = None) -> int:
    """The cores of this process's affinity that other processes leave idle: `cores` less their share
    (cores / host_cpus) of the host's CPUs the others keep busy, at least 1.

    What the others keep busy is measured, this process's own time taken out (others_busy: /proc/stat over a
    short window). Where that is unreadable, the host's 1-minute load average beyond one running thread
    stands for it (all the cores where no load average is known either): it counts this process's own
    threads too, so a run that follows another in the same minute reads its predecessor's float64 threads as
    another's load (SmolLM2-135M at budget 32, topk 4, batch 4: 1 oracle thread instead of 2 on an idle
    2-core machine, 7.5x the engine's step instead of 5.3x).

    On shared, loaded cores an OpenMP parallel region waits for whichever of its threads the scheduler has
    set aside, a time slice each time: on 2 cores at a load of about 4.6, 2 threads took ~15 ms for any op,
    a 12 x 12 tril included, where 1 took 0.01 ms, and the check of SmolLM2-135M at budget 32, topk 4,
    batch 4 spent 68.5 s per step in the oracle against 4.1 s on 1 thread (benchmarks/README.md)."""
    cores = machine_cores() if cores is None else cores
    share = cores / max(host_cpus or os.cpu_count() or cores, cores)   # the others spread over the host's CPUs
    others = (others_busy if busy is None else busy)()
    if others is None:
        try:
            load = (os.getloadavg if loadavg is None else loadavg)()[0]
        except (OSError, AttributeError):   # no load average on this platform: nothing known against every core
            return cores
        others = max(0.0, load - 1.0)   # this process's engine thread was running: not another's
    return max(1, min(cores, math.floor(cores - others * share + 1.0 - IDLE_SHARE)))


def others_busy(window_s: float = 0.2, read_stat: Callable[[], tuple[int, int]] | None = None,
                own_ticks: Callable[[], float] | None = None, sleep: Callable[[float], None] = time.sleep,
                host_cpus: int | None = None) -> float | None:
    """The host's CPUs other processes kept busy over `window_s` (in CPUs: 1.0 is one CPU all the time),
    from /proc/stat's busy and total ticks with this process's own ticks taken out; None where /proc/stat
    is unreadable (not Linux)."""
    read = _stat_ticks if read_stat is None else read_stat
    own = _own_ticks if own_ticks is None else own_ticks
    try:
        (busy0, total0), own0 = read(), own()
        sleep(window_s)
        (busy1, total1), own1 = read(), own()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    cpus = host_cpus or os.cpu_count() or 1
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * cpus


def _stat_ticks() -> tuple[int, int]:
    """(busy, total) ticks of every CPU since boot: /proc/stat's first line (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]   # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _own_ticks() -> float:
    """This process's CPU time (user + system, every thread) in /proc/stat's ticks."""
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


def oracle_thread_count(model: str, oracle_device: str) -> int:
    """torch's intra-op threads for the float64 oracle's steps: a preset's tiny oracle and a GPU oracle keep the
    caller's (the CLI's: threads only contend there); a checkpoint's on the CPU is matmul-bound and takes the
    cores other processes leave idle (idle_cores), never more."""
    from harness.engine.model.presets import PRESETS   # here: the presets' imports reach the twin, which imports this
    if model in PRESETS or oracle_device != "cpu":
        return torch.get_num_threads()
    return idle_cores()


@contextmanager
def oracle_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the float64 oracle's forwards, restored after: the CLI
    keeps the engine on few threads (tiny presets run faster so), but a checkpoint's float64 oracle
    is matmul-bound and wants the idle cores (issue 10: one thread made the 8B run take ~27 minutes;
    oracle_thread_count says how many)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)
