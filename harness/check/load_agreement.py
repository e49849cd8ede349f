"""Does the engine run the model that is in the checkpoint? The engine's
loader output (its parsed ModelConfig and weights) against the oracle's own
reading of the same directory: every config field, then every tensor the
forward pass uses. A disagreement is a divergence of kind "config" or
"weights", before any verify step runs.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ddschema import ModelConfig, weight_names


@dataclass(frozen=True)
class LoadMismatch:
    """One config key or one tensor on which the two readings differ."""

    what: str      # config | weights
    key: str       # ModelConfig field, or Hugging Face tensor name
    engine: str    # the engine's value (config) or a description (weights)
    oracle: str
    detail: str    # one sentence
    kind: str = "load"

    def __post_init__(self) -> None:
        if self.what not in ("config", "weights"):
            raise ValueError(f"a load mismatch is about config or weights, not {self.what!r}")


class LoadDivergence(Exception):
    """The engine's loader raised on a checkpoint the oracle read (harness/check/prepare.py): a load
    divergence, judged against the oracle's reading with no engine built, not a refusal or a crash."""

    def __init__(self, mismatches: tuple[LoadMismatch, ...]) -> None:
        if not mismatches:
            raise ValueError("a load divergence names at least one mismatch")
        super().__init__(mismatches[0].detail)
        self.mismatches = tuple(mismatches)


def compare_config(engine: ModelConfig, oracle: ModelConfig) -> list[LoadMismatch]:
    out = []
    for f in fields(ModelConfig):
        a, b = getattr(engine, f.name), getattr(oracle, f.name)
        if a != b:
            out.append(LoadMismatch("config", f.name, repr(a), repr(b),
                                    f"config {f.name}: the engine read {a!r}, the oracle read {b!r}"))
    return out


def effective_weight(cfg: ModelConfig, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor the engine multiplies by under `name` (the embedding for a
    tied lm_head), None when it uses none."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    return weights.get(name)


def compare_weights(engine_cfg: ModelConfig, engine_weights: dict[str, torch.Tensor],
                    oracle) -> list[LoadMismatch]:
    """Every tensor the oracle computes with against the engine's, on the
    oracle's device. The engine keeps the checkpoint's dtype (float64 files
    as float32), so the oracle's float64 tensor is rounded to float32 first:
    exact for bf16, fp16 and fp32 checkpoints."""
    # the oracle's own names (reference/names.py), not the shared schema's: a wrong name there reaches one side
    own = oracle.weight_names() if hasattr(oracle, "weight_names") else weight_names(oracle.config)
    names = list(dict.fromkeys(own + ["lm_head.weight"]))
    names += [n for n in weight_names(engine_cfg) if n not in names]  # tensors only the engine uses
    lacking = set(getattr(oracle, "missing_weights", ()))   # the oracle needs them, the checkpoint lacks them
    out = []
    for name in names:
        if name in lacking and effective_weight(engine_cfg, engine_weights, name) is None:
            out.append(LoadMismatch("weights", name, "absent", "absent from the checkpoint",
                                    f"tensor {name}: the model computes with it (the oracle's own names) and the "
                                    f"checkpoint lacks it; the engine's loader read the checkpoint without it"))
            continue
        got = effective_weight(engine_cfg, engine_weights, name)
        try:
            ref = oracle.weight(name).detach().float()  # [shape] the oracle's, rounded to float32
        except KeyError:
            ref = None
        mismatch = _tensor_mismatch(name, got, ref)
        if mismatch is not None:
            out.append(mismatch)
    return out


def _tensor_mismatch(name: str, got: torch.Tensor | None, ref: torch.Tensor | None) -> LoadMismatch | None:
    if got is None and ref is None:
        return None
    if got is None or ref is None:
        who, other = ("engine", "oracle") if got is None else ("oracle", "engine")
        return LoadMismatch("weights", name, "absent" if got is None else "present",
                            "absent" if ref is None else "present",
                            f"tensor {name}: the {who} uses none, the {other} does")
    if tuple(got.shape) != tuple(ref.shape):
        return LoadMismatch("weights", name, str(list(got.shape)), str(list(ref.shape)),
                            f"tensor {name}: shape {list(got.shape)} in the engine, {list(ref.shape)} in the oracle")
    got = got.detach().to(ref.device).to(torch.float32)   # moved as stored, widened there: exact from bf16, fp16, fp32
    if torch.equal(got, ref) and bool(torch.isfinite(got).all()):   # the common case: one pass, no copies
        return None
    diff = (got.double() - ref.double()).abs()  # [shape]
    if not bool((diff > 0).any()) and bool(torch.isfinite(got).all()):
        return None
    count, scale = int((diff != 0).sum()), float(ref.abs().max()) if ref.numel() else 0.0
    return LoadMismatch("weights", name, f"max |engine - oracle| {float(diff.nan_to_num(float('inf')).max()):.3g}",
                        f"max |oracle| {scale:.3g}",
                        f"tensor {name}: {count} of {ref.numel()} elements differ, max |engine - oracle| "
                        f"{float(diff.nan_to_num(float('inf')).max()):.3g} (max |oracle| {scale:.3g})")


def compare_loaded(engine_cfg: ModelConfig, engine_weights: dict[str, torch.Tensor], oracle) -> list[LoadMismatch]:
    """Config mismatches first, then tensor mismatches."""
    return compare_config(engine_cfg, oracle.config) + compare_weights(engine_cfg, engine_weights, oracle)


def explain(mismatches: list[LoadMismatch]) -> str:
    """One paragraph naming the first key or tensor, and how many more."""
    first = mismatches[0]
    more = f" ({len(mismatches) - 1} more load mismatches in the load records)" if len(mismatches) > 1 else ""
    return (f"the engine's loader disagrees with the oracle's own reading of the checkpoint: {first.detail}"
            f"{more}; the engine does not run the model in the checkpoint, so no verify step was compared.")
