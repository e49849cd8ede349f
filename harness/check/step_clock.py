"""Wall time per verify step, split between the engine and the float64 oracle (issue 10, item 3).

The engine's time is what the rounds generator spends producing a step; the oracle's is what the
comparison of that step spends (its float64 forwards dominate). On CUDA the engine's time is taken
after a synchronize, so queued kernels are counted in the step that queued them.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")


@dataclass
class StepClock:
    engine_s: float = 0.0
    oracle_s: float = 0.0

    def timed(self, rounds: Iterable[T]) -> Iterator[T]:
        """Yield the engine's steps, adding the time each took to produce to engine_s."""
        it = iter(rounds)
        while True:
            t0 = time.perf_counter()
            try:
                step = next(it)
            except StopIteration:
                return
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.engine_s += time.perf_counter() - t0
            yield step

    @contextmanager
    def oracle(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.oracle_s += time.perf_counter() - t0

    def per_step(self, steps: int) -> tuple[float | None, float | None]:
        if steps == 0:
            return None, None
        return self.engine_s / steps, self.oracle_s / steps


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


@contextmanager
def oracle_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the float64 oracle's forwards, restored after: the CLI
    keeps the engine on few threads (tiny presets run faster so), but a checkpoint's float64 oracle
    is matmul-bound and wants every core (issue 10: one thread made the 8B run take ~27 minutes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)
