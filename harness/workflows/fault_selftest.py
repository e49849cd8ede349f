"""`ddcheck faults --check`: every fault under settings where it can show
must be detected and named (localizer class == the fault's expected class),
and the fault-free matrix must pass over several seeds (no false alarm).

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

from harness.faults.registry import catalog, why_cannot_show
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

# The settings each fault is checked under (on top of the base settings).
SHOW_SETTINGS: dict[str, dict] = {
    "padded-kv-visible": {},
    "mask-row-stride": {},
    "padded-rectangle-mask": {"batch": 2},
    "short-graph-mask": {"cuda_graph": True, "batch": 3, "backend": "torch"},
    "graph-captured-causal": {"cuda_graph": True, "topk": 2},
    "stale-graph-mask": {"cuda_graph": True},
    "stale-kv-indices": {"cuda_graph": True},
    "no-kv-compaction": {"topk": 2},
    "padded-row-fully-masked": {"backend": "torch"},
    "child-before-parent": {},
    "position-from-index": {"topk": 2},
    "padding-slot-alias": {},
    "bonus-from-wrong-node": {"max_new_tokens": 24},  # the tiny model's first tokens repeat one token
    "free-slot-read": {},
    "position-base-offset": {},
    "stale-graph-positions": {"cuda_graph": True},
    "mask-request-permutation": {"batch": 2, "topk": 2},
    "bonus-stride-cross-request": {"batch": 2},
    "duplicate-sibling-token": {"topk": 2},
    "commit-past-stop": {"eos_id": "auto"},   # a token of the first round's greedy stream (stop_token)
    "padded-entry-live": {"cuda_graph": True, "batch": 3},
    "stale-graph-scalar": {"cuda_graph": True, "backend": "torch"},
    "accept-topology-mismatch": {"topk": 2},
    "paged-compaction-permutation": {"page_size": 16},
    "paged-branch-shared-tail": {"page_size": 16, "topk": 2},
    "swa-window-by-row-index": {"sliding_window": 8, "topk": 2},
    "swa-window-ignored": {"sliding_window": 8},
    "sinks-first-row-only": {"model": "tiny-sinks"},
    "tp-stale-mask": {"tp": 2},
    "tp-shifted-kv-indices": {"tp": 2},
    "tp-kv-heads-sharded": {"tp": 4},   # tiny has 2 KV heads: replicated over 4 ranks
    "mla-rope-flat-index": {"model": "tiny-deepseek-v3", "topk": 2},
    "mla-latent-wrong-slot": {"model": "tiny-deepseek-v3"},
    "moe-router-reads-padding": {"model": "tiny-deepseek-v3"},
}

# The fault-free matrix, run once per seed.
CLEAN_MATRIX = ({}, {"topk": 2}, {"cuda_graph": True, "batch": 3}, {"cuda_graph": True, "topk": 2, "batch": 2},
                {"eos_id": "auto", "batch": 2}, {"model": "tiny-sinks", "topk": 2}, {"model": "tiny-softcap"},
                {"sliding_window": 8, "topk": 2, "batch": 2}, {"sliding_window": 8, "cuda_graph": True, "topk": 2, "batch": 3},
                {"page_size": 16, "topk": 2, "batch": 2}, {"model": "tiny-deepseek-v3", "topk": 2, "batch": 2})
CLEAN_QUICK = ({}, {"cuda_graph": True, "topk": 2, "batch": 3}, {"model": "tiny-sinks", "topk": 2},
               {"sliding_window": 8, "topk": 2}, {"page_size": 16, "topk": 2, "batch": 2})


@dataclass(frozen=True)
class CheckRow:
    fault: str | None          # None: a fault-free run
    settings: RunSettings
    detected: bool             # the run diverged
    fault_class: str | None    # the localizer's class
    expected_class: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        if self.fault is None:
            return not self.detected
        return self.detected and self.fault_class == self.expected_class

    @property
    def named(self) -> bool:
        return self.fault_class == self.expected_class


def base_settings(backend: str, quick: bool, device: str = "cpu", impl: str | None = None) -> RunSettings:
    return RunSettings(backend=backend, max_new_tokens=10 if quick else 24, device=device, impl=impl)


def fault_settings(name: str, base: RunSettings, seed: int = 0) -> RunSettings:
    return with_extra(replace(base, seed=seed, fault=name), SHOW_SETTINGS[name])


def with_extra(s: RunSettings, extra: dict) -> RunSettings:
    """`s` with `extra`; eos_id "auto" becomes stop_token(s)."""
    if extra.get("eos_id") == "auto":
        extra = {**extra, "eos_id": stop_token(replace(s, **{k: v for k, v in extra.items() if k != "eos_id"}))}
    return replace(s, **extra)


def stop_token(s: RunSettings) -> int:
    """An end-of-sequence id the first request meets inside its first verify
    round: the first token of its greedy stream, at position 2 or later (the
    drafts, not the prefill's root), that does not appear before it."""
    from harness.engine.model.llama import LlamaModel
    from harness.engine.model.presets import load_model
    from harness.engine.dense import dense_greedy
    from harness.engine.settings import prompt_tokens, prompts_for_batch
    cfg, weights = load_model(s.model, s.seed, s.sliding_window)
    prompt = prompt_tokens(prompts_for_batch(1)[0], 0, cfg.vocab_size, s.seed)
    stream = dense_greedy(LlamaModel(cfg, weights, s.torch_dtype, "cpu"), prompt, s.block_size)
    return next((t for i, t in enumerate(stream) if i >= 2 and t not in stream[:i]), stream[-1])


def tp_runs_here(tp: int, base: RunSettings) -> bool:
    """A --tp setting can run on top of `base` here: ddcheck's own engine, not a serving backend, enough GPUs."""
    if tp == 1:
        return True
    import torch
    from harness.engine.attn.registry import serves_batches
    return (base.impl is None and not base.cuda_graph and not serves_batches(base.backend)
            and (not base.device.startswith("cuda") or torch.cuda.device_count() >= tp))


def run_one(s: RunSettings, expected_class: str | None) -> CheckRow | None:
    """None: a port under test cannot run this setting (or the fault's stage is the port's)."""
    from harness.check.differential import check
    from harness.check.prepare import prepare
    from harness.ports.attach import SettingSkipped
    t0 = time.perf_counter()
    try:
        prepared = prepare(s)
    except SettingSkipped:
        return None
    summary = check(prepared, RecordWriter(None))
    return CheckRow(s.fault, s, not summary.passed, summary.fault_class, expected_class, time.perf_counter() - t0)


def self_check(backend: str = "torch", seeds: int = 5, quick: bool = False, fault_seeds: int = 1,
               faults: list[str] | None = None,
               device: str = "cpu", impl: str | None = None) -> Iterator[CheckRow | None]:
    """Yields one row per run: each fault (x fault_seeds), then the clean matrix x seeds;
    None for a run a port under test cannot make."""
    from harness.engine.model.presets import load_model
    base = base_settings(backend, quick, device, impl)
    cat = catalog()
    for name in faults or list(cat):
        for seed in range(fault_seeds):
            if not tp_runs_here(SHOW_SETTINGS[name].get("tp", 1), base):
                yield None   # a TP fault where its ranks cannot run (a port under test, too few GPUs)
                continue
            s = fault_settings(name, base, seed)
            vocab = load_model(s.model, s.seed)[0].vocab_size
            reason = why_cannot_show(name, s, vocab)
            if reason:
                raise ValueError(f"self-check settings for {name}: {reason}")
            if s.cuda_graph and s.backend == "torch" and s.device.startswith("cuda"):
                continue  # the torch backend cannot be captured in a CUDA graph: this fault is a CPU-twin check
            yield run_one(s, cat[name].expected_class)
    for seed in range(seeds):
        for extra in (CLEAN_QUICK if quick else CLEAN_MATRIX):
            yield run_one(with_extra(replace(base, seed=seed), extra), None)
