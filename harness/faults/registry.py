"""Named mutations of the engine under test. Each swaps one pipeline stage
(or graph option) for a broken variant, says what it breaks, the settings
under which it can show, and the class the localizer must name for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.runner.pipeline import Pipeline
from harness.runner.settings import RunSettings, UsageError
from harness.ddtree.tree import expected_num_nodes


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
        from harness.localize.explain import CLASSES
        if self.expected_class not in CLASSES:
            raise ValueError(f"fault {self.name!r}: class {self.expected_class!r} is none the localizer can name")
        if "\n" in self.source:
            raise ValueError(f"fault {self.name!r}: its source is one short line")


FAULTS: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    if fault.name in FAULTS:
        raise ValueError(f"fault {fault.name!r} registered twice")
    FAULTS[fault.name] = fault
    return fault


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
    from harness.attn import make_backend
    from harness.attn.base import BackendUnavailable
    try:
        return "prefix" in make_backend(s.backend, "cpu", s.torch_dtype).mask_regions
    except BackendUnavailable:
        return False


def reads_max_kv_len(s: RunSettings, vocab: int) -> bool:
    """The backend bounds its prefix loop by the max_kv_len scalar (SGLang's
    Triton extend kernel takes none)."""
    from harness.attn import make_backend
    from harness.attn.base import BackendUnavailable
    try:
        return bool(getattr(make_backend(s.backend, "cpu", s.torch_dtype), "reads_max_kv_len", False))
    except BackendUnavailable:
        return False


def run_window(s: RunSettings) -> int | None:
    """The run's sliding window: --sliding-window, else a preset's own (None: a checkpoint's is not known here)."""
    if s.sliding_window is not None:
        return s.sliding_window
    from harness.model.presets import PRESETS
    return PRESETS[s.model].sliding_window if s.model in PRESETS else None


def has_window(s: RunSettings, vocab: int) -> bool:
    """The model has sliding-window layers (--sliding-window, or a preset with a window)."""
    return run_window(s) is not None


def all_of(*conds: Callable[[RunSettings, int], bool]) -> Callable[[RunSettings, int], bool]:
    return lambda s, vocab: all(c(s, vocab) for c in conds)


def _load_catalog() -> None:
    from harness.faults import catalog  # noqa: F401  (registers)


def catalog() -> dict[str, Fault]:
    _load_catalog()
    return FAULTS


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
