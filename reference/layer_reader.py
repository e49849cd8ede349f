"""Decoder layers read in order for the layer-streamed oracle (reference/streamed.py),
the next one on a background thread while the current one is computed.

A pass of the streamed oracle reads every layer's float64 weights once. Read
one after another, the file reads and widening (bf16 bytes -> float64 on the
device) wait for the arithmetic and the arithmetic for them; with `prefetch`
layer l + 1 is read into a second set of buffers while layer l computes, so a
pass costs about the longer of the two, not their sum. Memory: two layers'
float64 weights instead of one.

On a GPU the reading thread copies and widens on a CUDA stream of its own:
it waits for the compute stream's work on the buffers it refills (the layer
before last), and the compute stream waits for the copy before it uses them.

Routed experts are not read here: a mixture-of-experts layer's experts are
read when a token picks them (`ExpertsOnDemand`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch
from torch import Tensor

ROUTED_EXPERT = ".mlp.experts."   # in the name of a routed expert's tensor


class ExpertsOnDemand(dict):
    """One layer's weights by name; a routed expert's tensor missing here is read (once) when asked for."""

    def __init__(self, weights: dict[str, Tensor], read: Callable[[str], Tensor]) -> None:
        super().__init__(weights)
        self.read = read

    def __missing__(self, name: str) -> Tensor:
        if ROUTED_EXPERT not in name:
            raise KeyError(name)
        self[name] = tensor = self.read(name)
        return tensor


class LayerReader:
    """source.layer(l, buffers, routed_experts=False) for l = 0 .. num_layers - 1, one pass at a time."""

    def __init__(self, source, num_layers: int, device: torch.device, prefetch: bool = True) -> None:
        self.source, self.num_layers, self.prefetch = source, num_layers, prefetch
        self.buffers: tuple[dict, dict] = ({}, {})   # layer l is read into buffers[l % 2]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="oracle-layer-reader") if prefetch else None
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None

    def layers(self) -> Iterator[tuple[int, ExpertsOnDemand]]:
        """(layer, its weights) in order; with prefetch the next layer is being read while the caller
        computes with this one (the caller lets layer l go before asking for layer l + 1)."""
        if not self.prefetch:
            for layer in range(self.num_layers):
                yield layer, self._on_demand(self.source.layer(layer, self.buffers[0], routed_experts=False))
            return
        pending: Future | None = self.pool.submit(self._read, 0, self._compute_done())
        try:
            for layer in range(self.num_layers):
                weights, ready = pending.result()
                pending = None
                if ready is not None:   # the compute stream's next work waits for the copy
                    ready.wait(torch.cuda.current_stream(self.stream.device))
                if layer + 1 < self.num_layers:   # into the buffers layer - 1 used: its work is enqueued
                    pending = self.pool.submit(self._read, layer + 1, self._compute_done())
                yield layer, self._on_demand(weights)
        finally:
            if pending is not None:   # a pass left early: no read may still write into the buffers after
                pending.result()

    def _on_demand(self, weights: dict[str, Tensor]) -> ExpertsOnDemand:
        return ExpertsOnDemand(weights, self.source.read)

    def _compute_done(self):
        """A CUDA event after the compute stream's work so far (None on the CPU)."""
        if self.stream is None:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.stream.device))
        return done

    def _read(self, layer: int, after) -> tuple[dict[str, Tensor], "torch.cuda.Event | None"]:
        """Layer `layer` into its buffers, on the reader's stream after `after` (on a GPU)."""
        buffers = self.buffers[layer % 2]
        if self.stream is None:
            return self.source.layer(layer, buffers, routed_experts=False), None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            weights = self.source.layer(layer, buffers, routed_experts=False)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return weights, ready

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
