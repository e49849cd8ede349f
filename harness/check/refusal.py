"""A refusal proven false: the engine under test raised inside a validator (a frozen dataclass's
`__post_init__`: the shared schema's configs, the protocol types' checks, DraftTree's), and the same run with
that class's validator skipped from the start ends without a crash and matches the oracle at every node it
judges. The validator refused values the engine then computes with correctly: the check is the bug, and its
file names the stage. A validator that refused rightly (its class's other code needs what it checked, or a
stage upstream handed it a wrong value) proves nothing this way: the run without it crashes or diverges.

Used in-process by the crash rungs (localize/stage_swap.py, the validator skipped for one replaced run and put
back) and at the start of a rerun in a new process (harness/cli/__init__.py, before the engine is imported:
a refusal at import time leaves nothing to rerun in-process).

Imports only the standard library: it runs before anything of the engine is imported.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import builtins
import importlib
import os
import sys
import traceback
from contextlib import contextmanager
from typing import Iterator

from harness.check.project import project_path

REFUSAL_PREFIX = "refusal:"
REPLACE_STAGE_ENV = "DDCHECK_REPLACE_STAGE"   # as harness/engine/attn/exact.py names it
VALIDATOR = "__post_init__"
# the code whose validators a refusal may skip: the engine under test and the schema it shares
_OWNERS = ("ddschema/", "harness/engine/", "harness/ports/", "harness/faults/")
# a validator's module -> the stage word its refusal names (the first prefix that matches)
_STAGES = (("ddschema/", "shared schema"), ("harness/engine/ddtree/tree.py", "tree build"),
           ("harness/engine/ddtree/verify_", "verify inputs"), ("harness/engine/attn/", "attention"),
           ("harness/engine/mem/", "KV allocation"), ("harness/engine/graph.py", "graph"),
           ("harness/engine/model/", "model"), ("harness/engine/ddtree/accept", "accept"),
           ("harness/engine/ddtree/commit", "commit"), ("harness/engine/ddtree/mask.py", "mask"))


def refused_by(e: BaseException) -> str | None:
    """"module:Class" of the validator the exception was raised in (the innermost `__post_init__` frame of the
    engine's or the schema's code, its `self` the instance being checked), or None: not a refusal."""
    for frame, _ in reversed(list(traceback.walk_tb(e.__traceback__))):
        rel = project_path(frame.f_code.co_filename)
        if rel is None or not rel.startswith(_OWNERS) or frame.f_code.co_name != VALIDATOR:
            continue
        cls = type(frame.f_locals.get("self"))
        if cls is type(None) or VALIDATOR not in vars(cls):
            return None
        return f"{cls.__module__}:{cls.__qualname__}"
    return None


def refusal_stage(module: str) -> str:
    """The stage word of a validator's module (dotted)."""
    path = module.replace(".", "/") + ".py"
    return next((stage for prefix, stage in _STAGES if path.startswith(prefix)), "unknown")


def _class(spec: str):
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _skip(self) -> None:   # the validator's stand-in: checks nothing, sets nothing
    return None


@contextmanager
def validator_skipped(spec: str) -> Iterator[None]:
    """Within the block, class `spec` ("module:Class") is constructed without its validator; put back after."""
    cls = _class(spec)
    own = vars(cls)[VALIDATOR]
    setattr(cls, VALIDATOR, _skip)
    try:
        yield
    finally:
        setattr(cls, VALIDATOR, own)


def skip_from_env() -> str | None:
    """At a rerun's start: the validator DDCHECK_REPLACE_STAGE=refusal:<module>:<Class> names skipped for the
    process's life; the spec, or None when the variable names no refusal. The class may be built and checked
    while its own module is imported (a module-level instance): so the class is caught as it is built, by the
    class-building builtin, before its module's next statement runs; one already imported is patched at once."""
    key = os.environ.get(REPLACE_STAGE_ENV, "")
    if not key.startswith(REFUSAL_PREFIX):
        return None
    spec = key[len(REFUSAL_PREFIX):]
    module, _, qualname = spec.partition(":")
    if module in sys.modules:
        setattr(_class(spec), VALIDATOR, _skip)
        return spec
    build = builtins.__build_class__

    def build_class(body, name, *bases, **kwargs):
        cls = build(body, name, *bases, **kwargs)
        if body.__qualname__ == qualname and body.__globals__.get("__name__") == module:
            setattr(cls, VALIDATOR, _skip)   # before a decorator (dataclass) or the module uses it
        return cls
    builtins.__build_class__ = build_class
    return spec
