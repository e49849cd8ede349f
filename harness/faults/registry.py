"""Named mutations of the engine under test. Each swaps one pipeline stage
(or graph option) for a broken variant, says what it breaks, the settings
under which it can show, and the class the localizer must name for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.runner.pipeline import Pipeline
from harness.runner.settings import RunSettings, UsageError
from harness.spec.tree import expected_num_nodes


@dataclass(frozen=True)
class Fault:
    name: str
    breaks: str                                    # one line: what it breaks
    shows_when: str                                # one line: the settings it needs
    expected_class: str                            # what the localizer must name
    apply: Callable[[Pipeline], Pipeline]
    can_show: Callable[[RunSettings, int], bool]   # (settings, vocab) -> bool


FAULTS: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    FAULTS[fault.name] = fault
    return fault


def has_padding(s: RunSettings, vocab: int) -> bool:
    """Some verify row is padding: actual < budget (q_len = budget + 1)."""
    return expected_num_nodes(s.budget, s.topk, s.block_size - 1, vocab) < s.budget


def _load_catalog() -> None:
    from harness.faults import catalog  # noqa: F401  (registers)


def why_cannot_show(name: str, s: RunSettings, vocab: int) -> str | None:
    _load_catalog()
    fault = FAULTS.get(name)
    if fault is None:
        return f"unknown fault {name!r}; `ddcheck faults` lists them"
    if not fault.can_show(s, vocab):
        return f"fault {name!r} cannot show under these settings: it needs {fault.shows_when}"
    return None


def apply_fault(name: str | None, s: RunSettings, vocab: int, pipeline: Pipeline = Pipeline()) -> Pipeline:
    if name is None:
        return pipeline
    reason = why_cannot_show(name, s, vocab)
    if reason:
        raise UsageError(reason)
    return FAULTS[name].apply(pipeline)
