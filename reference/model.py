"""A dense float64 Llama-family forward pass with no KV cache.

This is the oracle's model: slow, obvious and independent of harness/.
Every call recomputes every position from the token ids; attention is an
explicit [heads, T, T] score matrix with an explicit boolean visibility mask.

Conventions (all Hugging Face's):
  * RMSNorm: x * rsqrt(mean(x^2) + eps) * w
  * RoPE "rotate_half": inv_freq = 1 / theta^(arange(0, d, 2) / d),
    angles = position * inv_freq, cos/sin of cat(angles, angles)
  * GQA: each kv head serves num_heads // num_kv_heads query heads
  * SwiGLU MLP: down(silu(gate(x)) * up(x))
  * Qwen2 (`qkv_bias`): bias on q, k, v projections; `o_bias`: on o_proj too
  * rope_scaling llama3: see reference/rope.py
  * Qwen3 (`qk_norm`): per-head RMSNorm over head_dim on q and k, before RoPE
  * sliding window W on the config's sliding layers: a query at absolute
    position q sees a key at absolute position k only if q - k < W, on top of
    whatever else hides the key (Hugging Face's convention: W keys, itself
    included)
  * Gemma 2's attn_logit_softcapping c: scores c * tanh(s / c), before the mask
  * gpt-oss's sinks: a per-head logit in the softmax's denominator, no value
  * Gemma 3: see reference/gemma3.py ((1 + w) norms, sandwich norms, GELU-tanh,
    scaled embeddings, query_pre_attn_scalar, local RoPE base, final soft cap)

`DenseLlama.rounded(dtype)` is the same model storing every tensor in a low
precision: each weight, and each activation a low-precision engine writes
to memory (embedding rows, norm outputs, every projection's output, q and k
after RoPE, the attention output, the residual stream after each add, the
MLP's inner product, the logits) is rounded to `dtype` (round to nearest
even); everything between two stores (sums, softmax, RoPE's cos/sin) stays
float64. It is a second, independent low-precision computation of the
model: the harness measures a bf16/fp16 engine's noise against it
(harness/verdict/noise_floor.py). The float64 model stores exactly (no
rounding at all).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ddschema.config import ModelConfig, RopeScaling
from reference.names import weight_names
from reference.gemma3 import gelu_tanh, gemma_rms_norm, layer_rope, soft_cap
from reference.rope import rope_inv_freq

DTYPE = torch.float64


class ForwardResult(NamedTuple):
    """What one dense forward returns: a 4-tuple with named fields.

    logits:  [T, V] float64
    hiddens: num_layers + 1 tensors [T, hidden]: the residual stream after the
             embedding and after each layer (the last is before the final norm)
    ks, vs:  one tensor per layer [T, kv_heads, head_dim]; K is after RoPE
    """

    logits: Tensor
    hiddens: list[Tensor]
    ks: list[Tensor]
    vs: list[Tensor]


def exact(x: Tensor) -> Tensor:
    """The float64 model's store: nothing is rounded."""
    return x


def rounding_to(dtype: torch.dtype):
    """A store that rounds float64 values to `dtype` (and back to float64)."""
    def store(x: Tensor) -> Tensor:
        return x.to(dtype).to(DTYPE)
    store.dtype = dtype
    return store


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2 over the last dim) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rotate_half(x: Tensor) -> Tensor:
    """[..., d] -> cat(-x[..., d/2:], x[..., :d/2])."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin tables [T, head_dim] float64 for integer positions [T]
    (frequencies scaled as reference/rope.py says when `scaling` is set)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [d/2]
    angles = positions.to(DTYPE)[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d] rotated by per-position cos/sin [T, d]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def causal_mask(t: int) -> Tensor:
    """[T, T] bool, True where query row i may see key column j (j <= i)."""
    return torch.ones(t, t, dtype=torch.bool).tril()


def window_visibility(query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """[T, S] bool: True where query_pos[t] - key_pos[s] < window (ints [T], [S])."""
    return (query_pos[:, None] - key_pos[None, :]) < window


def attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, sinks: Tensor | None = None,
              softcap: float | None = None, probs_store=None) -> Tensor:
    """Softmax attention in float64.

    q [T, heads, d], k and v [S, kv_heads, d] (S >= T: a cached prefix's keys
    come first), visible [T, S] bool. Returns [T, heads, d]. Every row must
    see at least one key. softcap c: each score s (after the 1/sqrt(d)
    scale) becomes c * tanh(s / c). sinks [heads]: one extra logit per head
    that joins the softmax's normalisation and carries no value (its
    probability is dropped). probs_store: where a flash-style kernel stores
    its probabilities before P @ V (SGLang's Triton kernels round
    exp(s - max) to the value dtype there, and divide by a denominator summed
    before that rounding); None: nothing is stored.
    """
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    k_full = k.repeat_interleave(group, dim=1)  # [T, heads, d]
    v_full = v.repeat_interleave(group, dim=1)  # [T, heads, d]
    scores = torch.einsum("qhd,khd->hqk", q, k_full) / math.sqrt(d)  # [heads, T, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[None, :, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores)[:, None, None].expand(heads, scores.shape[1], 1)  # [heads, T, 1]
        scores = torch.cat([scores, sink_col], dim=-1)  # [heads, T, S + 1]
    if probs_store is None:
        probs = torch.softmax(scores, dim=-1)  # [heads, T, S(+1)]
        return torch.einsum("hqk,khd->qhd", probs[..., :v_full.shape[0]], v_full)  # [T, heads, d]
    unnorm = torch.exp(scores - scores.amax(-1, keepdim=True))  # [heads, T, S(+1)] in (0, 1]
    denom = unnorm.sum(-1)  # [heads, T], before the store
    out = torch.einsum("hqk,khd->hqd", probs_store(unnorm[..., :v_full.shape[0]]), v_full)  # [heads, T, d]
    return (out / denom[..., None]).transpose(0, 1)  # [T, heads, d]


class Segment(NamedTuple):
    """One sequence's frame through the decoder layers (DenseLlama.segment)."""

    ids: Tensor        # [T] token ids (CPU)
    length: int        # T
    mask: Tensor       # [T, P+T] bool, on the model's device: what each row sees (its past first)
    windowed: Tensor | None   # [T, P+T] bool: mask within the sliding window (None without one)
    rope: list         # per layer (cos, sin) [T, d] (DenseLlama._rope_tables)


class DenseLlama:
    """Dense float64 Llama / Qwen2 / Qwen3 decoder, without a KV cache.

    `weights` uses Hugging Face tensor names (ddschema.weight_names); every
    tensor is held as float64 on `device` (the CPU, or a GPU: float64 there
    too), a copy of the caller's tensor unless `owned` says the caller hands
    them over (tensors it read for this model and keeps no reference to).
    Missing names raise KeyError, unless allow_missing: then `missing` lists
    them and a forward that needs one raises KeyError.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], device: str = "cpu",
                 owned: bool = False, allow_missing: bool = False) -> None:
        self.config = config
        self.device = torch.device(device)
        self.store = exact   # what writing a tensor to memory does: nothing, in float64
        self.probs_store = None   # where attention stores its probabilities before P @ V: nowhere
        self.missing = [n for n in weight_names(config) if n not in weights]
        if self.missing and not allow_missing:
            raise KeyError(f"weights lack {len(self.missing)} tensors, e.g. {self.missing[:3]}")
        take = (lambda t: t.to(device=self.device, dtype=DTYPE)) if owned else (lambda t: _own_copy(t, self.device))
        self.w = {name: take(weights[name].detach()) for name in weight_names(config) if name in weights}
        if config.tie_word_embeddings and "model.embed_tokens.weight" in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

    @classmethod
    def over_part(cls, config: ModelConfig, device: str = "cpu") -> "DenseLlama":
        """The model's math holding no weights yet: its caller puts in `w`
        (with `hold`) the float64 tensors on `device` that the next call reads
        (one layer's, the final norm's, a slice of the output projection's
        rows), as the layer-streamed oracle does (reference/streamed.py)."""
        part = object.__new__(cls)
        part.config, part.device, part.w, part.stored_w = config, torch.device(device), {}, {}
        part.store, part.probs_store = exact, None
        return part

    def hold(self, weights: dict[str, Tensor]) -> None:
        """Compute with these float64 tensors from now on (a part's weights; any rounded copies dropped)."""
        self.w = weights
        self.stored_w = {}

    def rounded(self, dtype: torch.dtype, probabilities: bool = False) -> "DenseLlama":
        """This model (its float64 weights shared, not copied) storing every
        tensor in `dtype`: see the module's docstring. probabilities: also
        attention's unnormalized probabilities before P @ V, as flash-style
        kernels do (`attention`'s probs_store)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)   # the same config, device and float64 weights
        other.store = rounding_to(dtype)
        other.probs_store = other.store if probabilities else None
        other.stored_w = {}   # each weight rounded once (held as _weight says)
        other.hold_wide = None
        return other

    def _weight(self, name: str) -> Tensor:
        """The weight as this model stores it: float64 itself, or rounded (and read back as float64).
        A weight rounding leaves unchanged (a bf16 checkpoint's, for a bf16 store) is the float64 model's
        own tensor: no second copy in memory. Another is held as float64 once when the rounded copies of
        every weight fit in half the device's free memory (no widening per use), else in its dtype (a
        quarter of the bytes), widened at each use: the same values either way."""
        if self.store is exact:
            return self.w[name]
        if name not in self.stored_w:
            rounded = self.store(self.w[name])
            if torch.equal(rounded, self.w[name]):   # on the dtype's grid already (a checkpoint stored in it):
                self.stored_w[name] = self.w[name]   # the float64 tensor itself, no copy and no widening
                return self.w[name]
            if getattr(self, "hold_wide", None) is None:   # decided once, at the first weight rounding moves
                self.hold_wide = _room_for(self._float64_bytes(), self.device)
            self.stored_w[name] = rounded if self.hold_wide else rounded.to(self.store.dtype)
        held = self.stored_w[name]
        return held if held.dtype == DTYPE else held.to(DTYPE)

    def _float64_bytes(self) -> int:
        """Bytes of the float64 weights held (a tied output projection counted once)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self.w.values()}
        return sum(seen.values())

    def _rope_tables(self, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer (cos, sin) [T, head_dim] on the device for positions [T]
        (Gemma 3's sliding layers rotate with their own base)."""
        c = self.config
        tables = {}   # (base, scaling) -> cos, sin [T, d]
        for base_scaling in {layer_rope(c, layer) for layer in range(c.num_layers)}:
            tables[base_scaling] = tuple(t.to(self.device) for t in rope_cos_sin(pos, c.head_dim, *base_scaling))
        return [tables[layer_rope(c, layer)] for layer in range(c.num_layers)]

    def _norm(self, x: Tensor, name: str) -> Tensor:
        norm = gemma_rms_norm if self.config.norm_plus_one else rms_norm
        return self.store(norm(x, self._weight(name), self.config.rms_norm_eps))

    def _linear(self, x: Tensor, name: str, bias: bool = False) -> Tensor:
        """x [T, in] @ W[out, in]^T (+ b[out]) -> [T, out], stored."""
        y = x @ self._weight(name + ".weight").T
        return self.store(y + self._weight(name + ".bias") if bias else y)

    def _attention_block(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, visible: Tensor,
                         past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One layer's attention on the normed input x [T, hidden]; `past`:
        this layer's K, V [P, kv_heads, d] of the tokens before, visible [T, P+T].

        Returns (output [T, hidden], k [T, kv_heads, d] after RoPE, v [T, kv_heads, d]).
        """
        out, ks, vs = self._attention_rows(layer, x, cos, sin, [visible], [past])
        return out, ks[0], vs[0]

    def _attention_rows(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, visibles: list[Tensor],
                        pasts: list[tuple[Tensor, Tensor] | None]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One layer's attention over several independent sequences' rows one
        after another: x [N, hidden] normed, cos/sin [N, d], per sequence its
        visible [T, P+T] and past K, V [P, kv_heads, d] (or None). The
        projections and RoPE run on all N rows at once, attention per sequence.

        Returns (output [N, hidden], per sequence k [T, kv_heads, d] after RoPE, v [T, kv_heads, d]).
        """
        c, p = self.config, f"model.layers.{layer}.self_attn."
        n = x.shape[0]
        b = c.qkv_bias
        q = self._linear(x, p + "q_proj", b).view(n, c.num_heads, c.head_dim)  # [N, H, d]
        k = self._linear(x, p + "k_proj", b).view(n, c.num_kv_heads, c.head_dim)  # [N, KV, d]
        v = self._linear(x, p + "v_proj", b).view(n, c.num_kv_heads, c.head_dim)  # [N, KV, d]
        if c.qk_norm:
            q, k = self._norm(q, p + "q_norm.weight"), self._norm(k, p + "k_norm.weight")
        q, k = self.store(apply_rope(q, cos, sin)), self.store(apply_rope(k, cos, sin))
        if c.query_pre_attn_scalar is not None:   # attention divides by sqrt(d): scores / sqrt(scalar) instead
            q = q * math.sqrt(c.head_dim / c.query_pre_attn_scalar)
        sinks = self.w[p + "sinks"] if c.attn_sinks else None  # [H]
        outs, ks, vs, start = [], [], [], 0
        for visible, past in zip(visibles, pasts):
            rows = slice(start, start + visible.shape[0])
            k_all = k[rows] if past is None else torch.cat([past[0], k[rows]])  # [P+T, KV, d]
            v_all = v[rows] if past is None else torch.cat([past[1], v[rows]])  # [P+T, KV, d]
            outs.append(self.store(attention(q[rows], k_all, v_all, visible, sinks, c.attn_logit_softcap,
                                             self.probs_store)))   # [T, H, d]
            ks.append(k[rows])
            vs.append(v[rows])
            start = rows.stop
        out = torch.cat(outs).reshape(n, c.num_heads * c.head_dim)  # [N, H * d]
        return self._linear(out, p + "o_proj", c.o_bias), ks, vs

    def _mlp(self, layer: int, x: Tensor) -> Tensor:
        """down(act(gate(x)) * up(x)), x [T, hidden] -> [T, hidden]; act SiLU (SwiGLU) or GELU-tanh (Gemma)."""
        p = f"model.layers.{layer}.mlp."
        act = torch.nn.functional.silu if self.config.hidden_act == "silu" else gelu_tanh
        gate = act(self._linear(x, p + "gate_proj"))  # [T, I]
        return self._linear(self.store(gate * self._linear(x, p + "up_proj")), p + "down_proj")

    def forward(self, token_ids: list[int], positions: list[int] | None = None,
                visible: Tensor | None = None, last_logits_only: bool = False,
                past: tuple[list[Tensor], list[Tensor]] | None = None) -> ForwardResult:
        """Run the whole sequence at once.

        token_ids: T ints in [0, vocab). positions: T RoPE positions, default
        0..T-1. visible: [T, T] bool (row = query, column = key), default causal.
        Returns ForwardResult(logits [T, V], hiddens, ks, vs); see its docstring.
        last_logits_only: the output projection for the last position alone
        (logits [1, V]): callers that read one row skip T - 1 rows of [hidden, V].
        past: per layer K and V [P, kv_heads, d] of a causal forward over the
        P tokens before these (this class's own ks, vs): the tokens then sit at
        positions P..P+T-1, see every past key and each other causally, and
        ks, vs hold only theirs. (Causal attention makes this equal to the
        forward over all P + T tokens: the past's keys never see these.)
        """
        seg = self.segment(token_ids, positions, visible, past)
        h = self.embed(self.w["model.embed_tokens.weight"][seg.ids.to(self.device)])  # [T, hidden]
        hiddens, ks, vs = [h], [], []
        for layer in range(self.config.num_layers):
            h, k, v = self.decoder_layer(layer, h, [seg], [None if past is None else (past[0][layer], past[1][layer])])
            hiddens.append(h)
            ks += k
            vs += v
        return ForwardResult(self.head(h[-1:] if last_logits_only else h), hiddens, ks, vs)

    def segment(self, token_ids: list[int], positions: list[int] | None = None, visible: Tensor | None = None,
                past: tuple[list[Tensor], list[Tensor]] | None = None) -> "Segment":
        """One sequence's frame for `decoder_layer` (forward's arguments, checked)."""
        c = self.config
        t = len(token_ids)
        if t == 0:
            raise ValueError("forward needs at least one token")
        ids = torch.tensor(list(token_ids), dtype=torch.long)  # [T]
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        p = 0 if past is None else past[0][0].shape[0]
        if past is not None and (positions is not None or visible is not None):
            raise ValueError("a forward over a cached past is causal at positions P..P+T-1")
        pos = torch.arange(p, p + t) if positions is None else torch.tensor(list(positions))  # [T]
        if pos.shape != (t,):
            raise ValueError("positions must have one entry per token")
        mask = causal_mask(t) if visible is None else visible.to(torch.bool)  # [T, T]
        if mask.shape != (t, t):
            raise ValueError(f"visible must be [{t}, {t}], got {list(mask.shape)}")
        if not mask.any(dim=-1).all():
            raise ValueError("every row of visible must see at least one key")
        mask = torch.cat([torch.ones(t, p, dtype=torch.bool), mask], dim=1).to(self.device)  # [T, P+T]
        key_pos = torch.cat([torch.arange(p), pos])  # [P+T] absolute positions: the past sits at 0..P-1
        windowed = None
        if c.sliding_window is not None:
            windowed = mask & window_visibility(pos, key_pos, c.sliding_window).to(self.device)  # [T, P+T]
        return Segment(ids, t, mask, windowed, self._rope_tables(pos))

    def embed(self, rows: Tensor) -> Tensor:
        """The residual stream's start [T, hidden] from the embedding's rows [T, hidden] of the tokens."""
        h = self.store(rows)  # rows as stored
        if self.config.embed_scale != 1.0:   # Gemma: the stored rows times sqrt(hidden), stored again
            h = self.store(h * self.config.embed_scale)
        return h

    def decoder_layer(self, layer: int, h: Tensor, segments: list["Segment"],
                      pasts: list[tuple[Tensor, Tensor] | None]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Layer `layer` over the residual stream h [N, hidden] of `segments`
        (their rows one after another) with each one's past K, V of this layer
        (or None). Reads only this layer's weights. Returns (h [N, hidden],
        per segment K [T, kv_heads, d] after RoPE, V [T, kv_heads, d])."""
        c, pre = self.config, f"model.layers.{layer}."
        visibles = [seg.mask if c.window_of(layer) is None else seg.windowed for seg in segments]   # [T, P+T] each
        normed = self._norm(h, pre + "input_layernorm.weight")
        if len(segments) == 1:   # one sequence: the layer's own attention (a subclass's, e.g. MLA)
            cos, sin = segments[0].rope[layer]
            attn_out, k, v = self._attention_block(layer, normed, cos, sin, visibles[0], pasts[0])
            ks, vs = [k], [v]
        else:
            cos = torch.cat([seg.rope[layer][0] for seg in segments])  # [N, d]
            sin = torch.cat([seg.rope[layer][1] for seg in segments])  # [N, d]
            attn_out, ks, vs = self._attention_rows(layer, normed, cos, sin, visibles, pasts)
        if c.sandwich_norms:   # Gemma: the attention's output and the MLP's are normed before their adds
            h = self.store(h + self._norm(attn_out, pre + "post_attention_layernorm.weight"))
            mlp_out = self._mlp(layer, self._norm(h, pre + "pre_feedforward_layernorm.weight"))
            h = self.store(h + self._norm(mlp_out, pre + "post_feedforward_layernorm.weight"))
        else:
            h = self.store(h + attn_out)
            h = self.store(h + self._mlp(layer, self._norm(h, pre + "post_attention_layernorm.weight")))
        return h, ks, vs

    def final_norm(self, h: Tensor) -> Tensor:
        """The final norm of the residual stream [T, hidden]."""
        return self._norm(h, "model.norm.weight")

    def unembed(self, normed: Tensor) -> Tensor:
        """Logits [T, V'] of normed rows [T, hidden] against the held lm_head.weight [V', hidden] (stored, capped)."""
        return soft_cap(self.store(normed @ self._weight("lm_head.weight").T), self.config.final_logit_softcap)

    def head(self, h: Tensor) -> Tensor:
        """Logits [T, V] of the residual stream [T, hidden]: final norm, output projection, soft cap."""
        return self.unembed(self.final_norm(h))

    __call__ = forward


def _room_for(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` fit in half the free memory of `device` (a GPU's, or the host's MemAvailable)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:   # Linux's MemAvailable; elsewhere nothing is known, and the rounded weights stay narrow
            with open("/proc/meminfo") as f:
                free = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            free = 0
    return nbytes <= free // 2


def _own_copy(t: Tensor, device: torch.device) -> Tensor:
    """t as float64 on device, never sharing the caller's storage (a float64
    tensor already there is cloned; anything else is converted, a copy anyway)."""
    out = t.to(device=device, dtype=DTYPE)
    return out.clone() if out.data_ptr() == t.data_ptr() else out
