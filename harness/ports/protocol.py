"""The port adapter protocol: how ddcheck drives a user's own DDTree code.

An adapter translates between a port's native calls and ddcheck's types; it
never repairs what the port produced. Four stages, each optional:

- build(topk_logprobs, topk_ids, roots, budget) -> BuiltTrees
- compile(trees, prefix_lens) -> CompiledVerify (ids, positions, the mask as the port hands it)
- accept(trees, target_argmax) -> list[Acceptance]
- commit(trees, acceptances, state) -> CommitResult (the port's commit on a ServingState)


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.engine.settings import UsageError
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

STAGES = ("build", "compile", "accept", "commit")
MASK_LAYOUTS = ("flat", "rectangle", "draft")       # per-request [q, P_b+q] blocks; [bs, q, max_P+q]; [bs, q, q] draft part only


@dataclass(frozen=True)
class Conventions:
    """What a port means by its inputs and outputs (shown by `ddcheck ports`)."""

    family: str
    summary: str                      # one line: which code, which versions
    budget_counts_root: bool          # True: q_len = budget (root included); False: q_len = budget + 1
    topk_rule: str                    # how K per depth is chosen
    padding: str                      # how padding rows are represented (token, position, parent)
    mask: str                         # dtype, values and layout of the mask it hands to the kernel
    stages: tuple[str, ...]           # the stages the port provides
    max_batch: int | None = None      # None: any
    has_padding: bool = True          # False: the port's trees are never padded (beam trees)
    greedy_only: bool = True
    page_size: int = 1
    functions: tuple[str, ...] = ()   # the port's functions the adapter calls
    # (stage, the port's function that stage calls): a stage whose function the port's worker never
    # calls is not driven (harness/ports/worker_calls.py)
    stage_functions: tuple[tuple[str, str], ...] = ()
    # the declared padding-row inputs, audited every step: token ("zero" | "root") and
    # position ("prefix": the root's, "zero"); None: not declared
    padding_token: str | None = None
    padding_position: str | None = None
    # True: the port builds and compiles in one call (a worker method), so its compile runs only on
    # trees its own build chose; --port-stages compile without build is a usage error
    compile_needs_build: bool = False

    def __post_init__(self) -> None:
        bad = set(self.stages) - set(STAGES)
        if bad or not self.stages:
            raise ValueError(f"{self.family}: stages must be a non-empty subset of {STAGES}, got {self.stages}")
        if self.padding_token not in (None, "zero", "root") or self.padding_position not in (None, "prefix", "zero"):
            raise ValueError(f"{self.family}: padding_token must be zero or root, padding_position prefix or zero")

    def padding_inputs(self, root_token: int, prefix: int) -> tuple[int | None, int | None]:
        """(token, position) a padding row must carry under this convention (None: not declared)."""
        tok = {"zero": 0, "root": root_token}.get(self.padding_token)
        pos = {"prefix": prefix, "zero": 0}.get(self.padding_position)
        return tok, pos

    def q_len(self, budget: int) -> int:
        return budget if self.budget_counts_root else budget + 1

    def num_drafts(self, budget: int) -> int:
        """Draft nodes (root excluded) a budget allows."""
        return budget - 1 if self.budget_counts_root else budget


@dataclass(frozen=True)
class BuiltTrees:
    trees: tuple[DraftTree, ...]      # read back from the port's own outputs
    native: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PortMask:
    """The mask exactly as the port would hand it to SGLang: its dtype and values
    reach the kernel untouched and are read as the kernel reads them (nonzero =
    visible); no adapter says what the port meant by them."""

    data: torch.Tensor                # any dtype, any shape
    layout: str                       # one of MASK_LAYOUTS: how the port laid it out (the kernel reads it flat)

    def __post_init__(self) -> None:
        if self.layout not in MASK_LAYOUTS:
            raise ValueError(f"mask layout {self.layout!r} unknown; one of {MASK_LAYOUTS}")


@dataclass(frozen=True)
class CompiledVerify:
    input_ids: torch.Tensor           # [bs*q_len] the port's verify tokens
    positions: torch.Tensor           # [bs*q_len] the port's positions
    mask: PortMask
    native: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CommitResult:
    seq_lens: tuple[int, ...]         # [bs] committed length after the commit
    kept: tuple[tuple[int, ...], ...] = ()    # per request: slots now holding the accepted rows, in order
    freed: tuple[int, ...] = ()
    copied: tuple[tuple[int, int], ...] = ()  # (source slot, target slot) K/V moves


class PortAdapter(Protocol):
    """What a family's adapter provides; stages it lacks are listed out of `conventions.stages`."""

    conventions: Conventions

    def build(self, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, roots: list[int],
              budget: int, draft_logprobs: torch.Tensor | None = None) -> BuiltTrees:
        """topk_logprobs, topk_ids  # [bs, L, K] per-depth top-K draft log-probs and ids;
        draft_logprobs  # [bs, L, vocab] the same drafts in full, for ports that take logits."""

    def compile(self, trees: list[DraftTree], prefix_lens: list[int]) -> CompiledVerify: ...

    def accept(self, trees: list[DraftTree], target_argmax: torch.Tensor) -> list[Acceptance]:
        """target_argmax  # [bs, q_len] the target's argmax per verify row."""

    def commit(self, trees: list[DraftTree], acceptances: list[Acceptance], state: Any) -> CommitResult: ...


class PortError(UsageError):
    """A port cannot be loaded or driven (missing function, unknown signature): one line, exit 2."""
