"""A run with one stage replaced from its very start, in a process of its own: the proof of a crash that left no
engine to rerun in-process (one raised while the engine under test was imported or built, or a kernel that
killed its process). The crashed command runs again with DDCHECK_REPLACE_STAGE naming one replacement; when
that rerun ends without a crash and matches the oracle, the replaced stage is proven the one that crashed
(harness/workflows/reruns.py climbs the ladder, harness/check/crash.py prove_from_start writes the proof).

A replacement is tried only where it can change the crash: its `reach` (the code it stands in for) holds a frame
of the crash's traceback. Choosing what to try by where the crash is proves nothing by itself; the rerun does.

  DDCHECK_REPLACE_STAGE=<key>                    one of REGISTRY's keys
  DDCHECK_REPLACE_STAGE=refusal:<module>:<class> that class's validator skipped (harness/check/refusal.py)

The ladder is read where the engine under test may not even import (a raise at its import): this module, and
each entry until it is applied, import nothing of the engine.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass, is_dataclass, replace
from typing import Callable

from harness.check.project import project_path
from harness.check.refusal import REFUSAL_PREFIX, REPLACE_STAGE_ENV


_ENGINE_CODE = ("harness/engine/", "harness/ports/", "harness/faults/", "ddschema/")


@dataclass(frozen=True)
class FromStart:
    """One stage replaced from the start of a run."""

    stage: str                # the localizer's stage word (localize/wrong.py STAGE_WORDS' values)
    replaced_by: str          # what stands in for it, as the proof's sentence says
    # the code it stands in for: project paths, a prefix ("harness/engine/mem/") or one function
    # ("harness/engine/loop.py::__init__"); a crash with no frame there is not tried with it
    reach: tuple[str, ...]
    # (settings, pipeline, prompt ids) -> (settings, pipeline, built) as the rerun builds its engine: built(engine),
    # or None, runs once the engine is built (prepare.build), before anything runs
    apply: Callable

    def __post_init__(self) -> None:
        if not self.stage or not self.reach:
            raise ValueError("a from-start replacement names its stage and the code it reaches")

    def reaches(self, frames: list[tuple[str, str]]) -> bool:
        """frames: (project path, function) of a crash's engine frames."""
        for path, func in frames:
            for r in self.reach:
                where, _, fn = r.partition("::")
                if (path == where and (not fn or fn == func)) or (not fn and where.endswith("/")
                                                                  and path.startswith(where)):
                    return True
        return False


def _attention(s, pipeline, prompt_ids):
    """The backend's attention computed in float64 from the start (engine/attn/exact.py, armed throughout): the
    backend under test is never called, so it is not even made (a raise while it is made, SGLang's interpreter
    set up, its buffers sized, is taken away too); the plain torch backend stands under it, never computing."""
    from harness.engine.attn.exact import with_replaced_attention
    return replace(s, backend="torch"), with_replaced_attention(pipeline), None


def budget_plus_one(budget: int) -> int:
    """The verify width from the budget alone: the root and `budget` draft nodes, one row each."""
    return int(budget) + 1


def _with(pipeline, **stages):
    """The pipeline with these stages replaced; where the engine's Pipeline is not the dataclass it claims to be (its
    decorator lost), a copy with them set: the rerun then shows what else breaks, not a crash of ddcheck's own."""
    if is_dataclass(pipeline):
        return replace(pipeline, **stages)
    out = copy.copy(pipeline)
    for name, stage in stages.items():
        object.__setattr__(out, name, stage)
    return out


def _verify_width(s, pipeline, prompt_ids):
    return s, _with(pipeline, width=budget_plus_one), None


def _prefill_metadata(s, pipeline, prompt_ids):
    from harness.check.prefill_layout import independent_prefill_metadata
    return s, _with(pipeline, prefill_metadata=independent_prefill_metadata), None


def _eager(s, pipeline, prompt_ids):
    return replace(s, cuda_graph=False), pipeline, None


def _kv_allocation(s, pipeline, prompt_ids):
    """The engine's KV memory replaced from its construction for the rest of this process (the rerun's own), then
    the KV allocation rung's hooks on the engine built (localize/memory_start.py, memory_rungs.py)."""
    from harness.check.localize.memory_rungs import strict_allocation_throughout
    from harness.check.localize.memory_start import enter_for_process
    enter_for_process(s, prompt_ids)
    return s, pipeline, strict_allocation_throughout(None, 0)


# in ladder order, narrowest first (as localize/stage_swap.py prove_crash climbs)
REGISTRY: dict[str, FromStart] = {
    "attention": FromStart("attention", "a float64 softmax of the same inputs, from the start, in a new process",
                           ("harness/engine/attn/",), _attention),
    # a wrong width raises where it is used (the pools, the graph's buffers sized by it), not in verify_width:
    # the engine's build is reached too
    "tree build": FromStart("tree build", "the verify width budget + 1, from the start, in a new process",
                            ("harness/engine/pipeline.py", "harness/engine/loop.py::__init__"), _verify_width),
    # wrong prefill metadata raises where the prefill's forward reads it: the prefill is reached too
    "verify inputs": FromStart("verify inputs", "the prefill's metadata laid out from the prompts' lengths and "
                               "slots, from the start, in a new process",
                               ("harness/engine/ddtree/verify_inputs.py", "harness/engine/loop.py::prefill"),
                               _prefill_metadata),
    "graph": FromStart("graph", "the eager forward (no graph runner), from the start, in a new process",
                       ("harness/engine/graph.py", "harness/engine/serving_graph.py"), _eager),
    # the broadest (as the in-process rung, after the commit's): all the KV allocation rung stands in for, and the
    # memory's construction (the engine's constructor, the pool's sizing)
    "KV allocation": FromStart("KV allocation", "a KV pool, a strict token-slot allocator and a req_to_token table "
                               "of its own, sized from the settings and the prompts (every row on a fresh slot, the "
                               "cache rebuilt from the token ids after each round), from the start, in a new process",
                               ("harness/engine/mem/", "harness/engine/loop.py::__init__",
                                "harness/engine/round_stages.py", "harness/engine/ddtree/verify_slots.py",
                                "harness/engine/ddtree/commit.py", "harness/engine/ddtree/commit_paged.py"),
                               _kv_allocation),
}


def engine_frames(e: BaseException) -> list[tuple[str, str]]:
    """(project path, function) of every frame of e's traceback (and its cause's) in the engine under test's code
    or the schema it shares, outermost first."""
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            rel = project_path(frame.filename)
            if rel is not None and rel.startswith(_ENGINE_CODE):
                out.append((rel, frame.name))
        e = e.__cause__
    return out


def ladder(frames: list[tuple[str, str]], refusal: str | None) -> list[str]:
    """The DDCHECK_REPLACE_STAGE values to try for a crash with these engine frames, in order: every registered
    replacement that reaches one of them, then (where the crash is a validator's refusal) the refusal skipped."""
    keys = [k for k, fs in REGISTRY.items() if fs.reaches(frames)]
    return keys + ([refusal] if refusal else [])


def described(key: str) -> tuple[str, str]:
    """(stage word, what replaced it) of a DDCHECK_REPLACE_STAGE value."""
    if key.startswith(REFUSAL_PREFIX):
        from harness.check.refusal import refusal_stage
        module, _, cls = key[len(REFUSAL_PREFIX):].partition(":")
        return refusal_stage(module), (f"the same run without {cls}'s validator (its refusal then proven false), "
                                       "from the start, in a new process")
    fs = REGISTRY[key]
    return fs.stage, fs.replaced_by


def replaced_from_env(s, pipeline, prompt_ids: list[list[int]]):
    """(settings, pipeline, built) as this process's rerun builds its engine over these prompts: unchanged (built
    None) unless DDCHECK_REPLACE_STAGE names a registered replacement (a refusal is applied at start-up instead:
    harness/check/refusal.py); built(engine), where not None, runs once the engine is built."""
    key = os.environ.get(REPLACE_STAGE_ENV)
    if not key or key.startswith(REFUSAL_PREFIX):
        return s, pipeline, None
    if key not in REGISTRY:
        raise ValueError(f"{REPLACE_STAGE_ENV}={key!r}: not one of {', '.join(REGISTRY)} or {REFUSAL_PREFIX}...")
    return REGISTRY[key].apply(s, pipeline, prompt_ids)
