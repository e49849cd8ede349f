"""The layer-streamed oracle's part for multi-head latent attention and
mixture-of-experts layers (DeepSeek-V3, Kimi K2): DenseDeepseekV3's own math
(reference/deepseek_v3.py) over the weights held now, several sequences at a
time (reference/streamed.py runs every pending sequence through a layer
together).

What differs from the whole-model oracle is only the grouping: each
sequence's attention is DenseDeepseekV3's _attention_block over its own rows
and its own past latents (the same call the dense oracle makes per leaf),
and the MLP (dense, or router + experts + shared experts) runs over every
sequence's rows at once, row by row the same arithmetic. A routed expert's
weights are read when a token picks it (reference/layer_reader.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.deepseek_v3 import DenseDeepseekV3
from reference.moe import Selection


class StreamedMlaPart(DenseDeepseekV3):
    """DenseDeepseekV3 holding one layer's weights at a time (DenseLlama.over_part's contract)."""

    @classmethod
    def over_part(cls, config: ModelConfig, device: str = "cpu") -> "StreamedMlaPart":
        part = super().over_part(config, device)
        part._route_sink = None
        return part

    def _attention_rows(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, visibles: list[Tensor],
                        pasts: list[tuple[Tensor, Tensor] | None]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """MLA over several sequences' rows one after another: x [N, hidden] normed, cos/sin [N, r/2],
        per sequence visible [T, P+T] and past latents [P, R + r] (twice) or None.
        Returns (output [N, hidden], per sequence its latents [T, R + r], the same latents)."""
        outs, latents, start = [], [], 0
        for visible, past in zip(visibles, pasts):
            rows = slice(start, start + visible.shape[0])
            out, latent, _ = self._attention_block(layer, x[rows], cos[rows], sin[rows], visible, past)
            outs.append(out)   # [T, hidden]
            latents.append(latent)   # [T, R + r]
            start = rows.stop
        return torch.cat(outs), latents, latents

    def routed_layer(self, layer: int, h: Tensor, segments: list, pasts: list) -> tuple:
        """decoder_layer's (h, ks, vs) and the layer's routing over all N rows (a Selection, None for a dense MLP)."""
        sink: list[Selection] = []
        self._route_sink = sink
        try:
            out = self.decoder_layer(layer, h, segments, pasts)
        finally:
            self._route_sink = None
        return (*out, sink[0] if sink else None)


def split_selection(selection: Selection, spans: list[tuple[int, int]]) -> list[Selection]:
    """A Selection over N rows cut into each sequence's rows (spans: [start, stop) per sequence)."""
    return [Selection(selection.experts[a:b], selection.weights[a:b], selection.margin[a:b]) for a, b in spans]
