"""A stage proven guilty by replacing it, not by matching its symptoms
(issue 21 point 3). A run-level drift (every node a little worse than the
oracle's own low-precision twin, harness/verdict/noise_floor.py) says the
model's arithmetic differs but not where: the run is repeated with the
backend's attention replaced by an independent one (a float64 softmax over
the same q, k, v and the keys and mask the metadata names, with the
layer's own scale, cap and sinks). When the drift then goes away, the
attention backend's arithmetic was the cause; when it stays, the rest of
the forward (RoPE, the norms, the MLP, the loader) was.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from harness.engine.attn.base import serving_of
from harness.engine.attn.exact import ExactAttention


@dataclass(frozen=True)
class Replaced:
    stage: str            # the stage whose output was replaced
    drift_before: float
    drift_after: float | None   # None: the rerun could not be judged
    limit: float

    @property
    def cause(self) -> bool:
        """The replacement made the run correct: the replaced stage was the cause."""
        return self.drift_after is not None and self.drift_after <= self.limit

    def sentence(self) -> str:
        after = "could not be judged" if self.drift_after is None else f"{self.drift_after:.2f}"
        verdict = ("so the attention backend's arithmetic is the cause" if self.cause else
                   "so the cause lies in the rest of the forward (RoPE, norms, MLP, loader), not the attention")
        return (f"with the backend's attention replaced by a float64 softmax of the same inputs the drift is "
                f"{after} (was {self.drift_before:.2f}, limit {self.limit:.2f}): {verdict}")


def replace_attention(p, drift_before: float, limit: float, check: Callable) -> Replaced | None:
    """Rerun p's setting with ExactAttention around its backend, judged by `check` (the differential check,
    without localizing); None where the backend builds its own metadata (SGLang's serving backend: the
    wrapper would not see the batch it served)."""
    from harness.check.prepare import derive
    from harness.check.records import RecordWriter
    if serving_of(p.engine.kernel) is not None:
        return None
    pipeline = p.engine.pipeline
    inner = pipeline.attention
    wrap = (lambda b: ExactAttention(inner(b))) if inner is not None else ExactAttention
    rerun = derive(p, pipeline=replace(pipeline, attention=wrap))
    summary = check(rerun, RecordWriter(None), localize=False)
    return Replaced("attention", drift_before, summary.noise_drift, limit)
