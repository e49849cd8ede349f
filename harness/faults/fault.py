"""A fault: one named mutation of the engine under test (a pipeline stage or
graph option swapped for a broken variant), what it breaks, the settings
under which it can show, and the class the localizer must name for it
(tests/unit/test_localize_evidence.py holds every class against the
localizer's). Owns the Fault record and the conditions a fault may need;
imports only the engine.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings
from harness.engine.ddtree.tree import expected_num_nodes


@dataclass(frozen=True)
class Fault:
    name: str
    breaks: str                                    # one line: what it breaks
    shows_when: str                                # one line: the settings it needs
    expected_class: str                            # what the localizer must name
    apply: Callable[[Pipeline], Pipeline]
    can_show: Callable[[RunSettings, int], bool]   # (settings, vocab) -> bool
    source: str = ""                               # the public issue it models ("SGLang #6309"), "seed" for
                                                   # the original bug, "" for a generic class

    def __post_init__(self) -> None:
        if not (self.name and self.breaks and self.shows_when and self.expected_class):
            raise ValueError("a fault needs a name, a `breaks` line, a `shows_when` line and a class")
        if "\n" in self.source:
            raise ValueError(f"fault {self.name!r}: its source is one short line")


# -- conditions a fault may need (each a (settings, vocab) -> bool) ----------------

def num_nodes(s: RunSettings, vocab: int) -> int:
    """actual: draft nodes per tree (the tree is full: the drafter never runs dry)."""
    return expected_num_nodes(s.budget, s.topk, s.block_size - 1, vocab)


def has_padding(s: RunSettings, vocab: int) -> bool:
    """Some verify row is padding: actual < budget (q_len = budget + 1)."""
    return num_nodes(s, vocab) < s.budget


def has_branch(s: RunSettings, vocab: int) -> bool:
    """Every tree has a node off the first chain (so row index != depth and
    causal != ancestor visibility): topk >= 2 and budget > depth cap L."""
    return min(s.topk, vocab) >= 2 and s.budget > s.block_size - 1


def two_steps(s: RunSettings, vocab: int) -> bool:
    """A second verify round always runs: one round emits at most block_size tokens."""
    return s.max_new_tokens > s.block_size + 1


def batch_padded(s: RunSettings, vocab: int) -> bool:
    """The first batch runs in a larger graph bucket (buckets are powers of two)."""
    return s.batch & (s.batch - 1) != 0


def reads_prefix_mask(s: RunSettings, vocab: int) -> bool:
    """The backend reads the mask's prefix columns (SGLang's kernel, under
    skip_prefix_custom_mask, always sees the prefix, so no row is empty there)."""
    from harness.engine.attn import make_backend
    from harness.engine.attn.base import BackendUnavailable
    try:
        return "prefix" in make_backend(s.backend, "cpu", s.torch_dtype).mask_regions
    except BackendUnavailable:
        return False


def reads_max_kv_len(s: RunSettings, vocab: int) -> bool:
    """The backend bounds its prefix loop by the max_kv_len scalar (SGLang's
    Triton extend kernel takes none)."""
    from harness.engine.attn import make_backend
    from harness.engine.attn.base import BackendUnavailable
    try:
        return bool(getattr(make_backend(s.backend, "cpu", s.torch_dtype), "reads_max_kv_len", False))
    except BackendUnavailable:
        return False


def run_window(s: RunSettings) -> int | None:
    """The run's sliding window: --sliding-window, else a preset's own (None: a checkpoint's is not known here)."""
    if s.sliding_window is not None:
        return s.sliding_window
    from harness.engine.model.presets import PRESETS
    return PRESETS[s.model].sliding_window if s.model in PRESETS else None


def has_window(s: RunSettings, vocab: int) -> bool:
    """The model has sliding-window layers (--sliding-window, or a preset with a window)."""
    return run_window(s) is not None


def all_of(*conds: Callable[[RunSettings, int], bool]) -> Callable[[RunSettings, int], bool]:
    return lambda s, vocab: all(c(s, vocab) for c in conds)
