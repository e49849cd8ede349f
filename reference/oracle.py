"""DenseOracle: the ddschema Oracle protocol answered by brute force.

Every answer is defined by a plain causal float64 forward of DenseLlama over
an explicit token sequence: no paged cache, nothing from the engine. The
only work shared is what causality makes identical: a committed prefix's
K/V, computed once and extended (reference/prefix_cache.py), and a step's
tree nodes packed into one forward where each row sees exactly its own path
(reference/packed.py: its own mask, not the engine's), every request of the
step in the same pass (prepare_step); multi-head latent attention runs one
forward per leaf's root path instead. Tests hold each equal to a fresh
forward per node to 1e-12. On the CPU, a step's float64 pass and its
rounded one run side by side, one thread each (side_by_side).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from ddschema.oracle import Routing
from reference.accept import ReferenceAcceptance, greedy_acceptance
from reference.checkpoint import load_checkpoint
from reference.deepseek_v3 import DenseDeepseekV3, moe_layers
from reference.names import weight_names
from reference.model import DenseLlama
from reference.judged import GreedyMemo, StepAnswers, judge_packed, tree_key
from reference.prefix_cache import PrefixCache, extend
from reference.tree import ReferenceTree, best_first_tree


def validate_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raise ValueError unless (tokens, parents) is a tree in topological order:
    same length >= 1, parents[0] == -1 and 0 <= parents[i] < i for i >= 1."""
    if len(tokens) != len(parents):
        raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
    if len(tokens) == 0:
        raise ValueError("a tree needs at least its root")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {parents[0]}")
    for i in range(1, len(parents)):
        if not 0 <= parents[i] < i:
            raise ValueError(f"parents[{i}] = {parents[i]} must satisfy 0 <= parent < {i}")


def leaves(parents: Sequence[int]) -> list[int]:
    """Nodes no other node names as its parent, in index order."""
    inner = {int(p) for p in parents}
    return [i for i in range(len(parents)) if i not in inner]


def ancestry(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to `node`, both included."""
    chain = []
    while node != -1:
        chain.append(node)
        node = int(parents[node])
    return chain[::-1]


def root_path(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """Tokens from the root down to `node`, both included."""
    path = []
    while node != -1:
        path.append(int(tokens[node]))
        node = parents[node]
    return path[::-1]


# the attention layout a config states -> the float64 model class that computes it
MODEL_CLASSES = {"gqa": DenseLlama, "mla": DenseDeepseekV3}


def attention_layout(config: ModelConfig) -> str:
    """"mla" for multi-head latent attention (DeepseekV3ForCausalLM's reader sets config.mla), else "gqa"."""
    return "mla" if config.mla is not None else "gqa"


class DenseOracle:
    """ddschema.Oracle over a DenseLlama computing on `device` (float64 there
    too). All outputs are float64 on CPU."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], device: str = "cpu",
                 owned: bool = False, allow_missing: bool = False) -> None:
        """owned: `weights` are this oracle's alone (its own reading of a checkpoint), kept without a copy;
        allow_missing: a tensor its names (reference/names.py) want and `weights` lack is listed in
        `missing_weights`, not refused (the harness then reports the load divergence)."""
        self.config = config
        model = MODEL_CLASSES[attention_layout(config)]
        # the dense Llama family lists what a checkpoint lacks; DeepSeek-V3's model refuses it (KeyError)
        missing = {"allow_missing": True} if allow_missing and model is DenseLlama else {}
        self.model = model(config, weights, device, owned=owned, **missing)
        self.prefixes = PrefixCache()
        self.low_precision: dict[tuple[str, bool], tuple[DenseLlama, PrefixCache]] = {}   # by (dtype, probabilities), made when asked

    @classmethod
    def from_checkpoint(cls, directory, device: str = "cpu", **options) -> "DenseOracle":
        """The oracle over its own reading of a checkpoint directory
        (reference/checkpoint.py), its tensors read straight to `device`;
        raises CheckpointRefused (a ValueError); allow_missing: a tensor the checkpoint lacks is listed in
        `missing_weights` instead."""
        allow = bool(options.get("allow_missing"))
        config, weights = load_checkpoint(directory, device, keep_missing=allow)
        return cls(config, weights, device, owned=True, **options)  # read here, held by no one else

    def weight_names(self) -> list[str]:
        """The tensors this oracle computes with, by its own names (reference/names.py)."""
        return weight_names(self.config)

    @property
    def missing_weights(self) -> list[str]:
        """Tensors the oracle's own names want that its reading lacks ([] unless built with allow_missing)."""
        return list(getattr(self.model, "missing", ()))

    def weight(self, name: str) -> Tensor:
        """The float64 tensor the oracle computes with under `name` (for a
        tied checkpoint, lm_head.weight is the embedding)."""
        return self.model.w[name]

    def acceptance(self, tokens: Sequence[int], parents: Sequence[int], logits: Tensor) -> ReferenceAcceptance:
        """The oracle's own greedy walk over a tree (reference/accept.py)."""
        return greedy_acceptance(tokens, parents, logits)

    def draft_tree(self, root_token: int, draft_logprobs: Tensor, budget: int, topk: int) -> ReferenceTree:
        """The oracle's own best-first DDTree from a draft distribution (reference/tree.py)."""
        return best_first_tree(root_token, draft_logprobs, budget, topk)

    def tree_logits(self, prefix: Sequence[int], tokens: Sequence[int],
                    parents: Sequence[int]) -> Tensor:
        """Logits [n, V] float64: row i is the last position of a causal
        forward over prefix + root_path(node i). Computed behind the prefix's
        cached K/V, for the Llama family as one packed forward whose rows each
        see exactly their own path (reference/packed.py), else one forward
        per leaf (node i's row at its position in the first leaf's path below
        it); a step prepared by prepare_step answers from that pass."""
        logits = self._answer(None, self.model, self.prefixes, prefix, tokens, parents)
        self._greedy_memo().note(prefix, tokens, parents, logits)
        return logits

    def prepare_step(self, trees: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
                     rounded: Sequence[tuple[str, bool]] = ()) -> None:
        """A verify step's trees, (prefix, tokens, parents) per request, judged
        together: ONE forward per model (the float64 one and each `rounded`
        (dtype, probabilities) one) reads each weight once for every request
        (reference/packed.py). The tree_logits / rounded_tree_logits calls
        that follow for these trees answer from it; only this step is held.
        Optional in the protocol: an oracle without it answers per call."""
        answers = {}
        if not packable(self.model):
            self._step_answers().replace(answers)
            return
        keys = [tree_key(*t) for t in trees]
        for key in keys:
            validate_tree(key[1], key[2])
            if not key[0]:
                raise ValueError("tree_logits needs a non-empty prefix")
        models = [(None, (self.model, self.prefixes))]
        models += [((d, bool(pr)), self._rounded(d, pr)) for d, pr in dict.fromkeys(rounded)]
        passes = [lambda m=model, c=prefixes, w=which: judge_packed(m, c, keys, self._greedy_memo() if w is None
                                                                     else None)
                  for which, (model, prefixes) in models]
        for (which, _), logits in zip(models, side_by_side(passes, self.model.device)):
            answers.update({(which, k): lg for k, lg in zip(keys, logits)})
        self._step_answers().replace(answers)

    def _answer(self, which, model, prefixes: PrefixCache, prefix, tokens, parents) -> Tensor:
        """The prepared step's logits of this tree for `which` model, else judged now."""
        found = self._step_answers().take(which, tree_key(prefix, tokens, parents))
        return found if found is not None else self._judge(model, prefixes, prefix, tokens, parents)

    def _step_answers(self) -> StepAnswers:
        if "step_answers" not in self.__dict__:
            self.step_answers = StepAnswers()
        return self.step_answers

    def _greedy_memo(self) -> GreedyMemo:
        if "judged_walks" not in self.__dict__:
            self.judged_walks = GreedyMemo()
        return self.judged_walks

    def _judge(self, model, prefixes: PrefixCache, prefix: Sequence[int], tokens: Sequence[int],
               parents: Sequence[int]) -> Tensor:
        """tree_logits over `model` and its prefix cache (the float64 model or a rounded one)."""
        if packable(model):
            validate_tree(tokens, parents)
            if len(prefix) == 0:
                raise ValueError("tree_logits needs a non-empty prefix")
            memo = self._greedy_memo() if model is self.model else None
            return judge_packed(model, prefixes, [tree_key(prefix, tokens, parents)], memo)[0]
        return _tree_logits(model, prefixes, prefix, tokens, parents)

    def rounded_tree_logits(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                            dtype: str, probabilities: bool = False) -> Tensor:
        """tree_logits (float64 [n, V]) of the same model storing every tensor
        in `dtype` ("bfloat16" or "float16"; reference/model.py says where it
        rounds), and with `probabilities` attention's probabilities before
        P @ V too (as flash-style kernels store them): a low-precision
        computation of each node by the oracle's own code, with its own
        prefix cache."""
        model, prefixes = self._rounded(dtype, probabilities)
        return self._answer((dtype, bool(probabilities)), model, prefixes, prefix, tokens, parents)

    def _rounded(self, dtype: str, probabilities: bool = False):
        """(this model storing every tensor in `dtype`, its own prefix cache), made once."""
        if dtype not in ROUNDED_DTYPES:
            raise ValueError(f"rounded computations take {sorted(ROUNDED_DTYPES)}, got {dtype!r}")
        key = (dtype, bool(probabilities))
        if key not in self.low_precision:
            self.low_precision[key] = (self.model.rounded(ROUNDED_DTYPES[dtype], bool(probabilities)), PrefixCache())
        return self.low_precision[key]

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Argmax continuation, one causal position at a time over the
        sequence's cached K/V (each step extends the last).

        Returns (new tokens, gaps) with gaps[t] = top-1 minus top-2 logit at
        step t (>= 0; ties go to the lowest token id, as torch.argmax does).
        """
        if len(prompt) == 0:
            raise ValueError("greedy needs a non-empty prompt")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        sequence, emitted, gaps = list(prompt), [], []
        memo, cached = self._greedy_memo(), None
        for _ in range(max_new_tokens):
            known = memo.lookup(sequence)   # a judged tree's node already decided this position
            if known is None:
                if cached is None:
                    cached = self.prefixes.longest(sequence[:-1])
                cached, last = extend(self.model, cached, sequence[len(cached.tokens):])
                last = last.cpu()  # [V]
                known = int(torch.argmax(last)), top_gap(last)
            emitted.append(known[0])
            gaps.append(known[1])
            sequence.append(known[0])
        if cached is not None:
            self.prefixes.put(cached)
        return emitted, gaps

    def path_hidden(self, tokens: Sequence[int]) -> list[Tensor]:
        """Residual stream at the last position after the embedding and after
        each layer: num_layers + 1 tensors [hidden] float64."""
        hiddens = self.model.forward(list(tokens)).hiddens
        return [h[-1].cpu().clone() for h in hiddens]

    def path_kv(self, tokens: Sequence[int]) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer K (after RoPE) and V [len(tokens), kv_heads, head_dim]."""
        result = self.model.forward(list(tokens))
        return [k.cpu() for k in result.ks], [v.cpu() for v in result.vs]

    def path_latent(self, tokens: Sequence[int]) -> Tensor:
        """[num_layers, len(tokens), kv_lora_rank + qk_rope_head_dim] float64:
        each position's cached MLA latent (reference/deepseek_v3.py). ValueError without MLA."""
        if self.config.mla is None:
            raise ValueError("path_latent needs a model with multi-head latent attention (this one has none)")
        return torch.stack(self.model.forward(list(tokens)).ks).cpu()  # [L, T, R + r]

    def path_routing(self, tokens: Sequence[int]) -> Routing | None:
        """The routing of every position of a plain causal forward over
        `tokens` (experts [T, L, k]); None for a model without routed experts."""
        if not moe_layers(self.config):
            return None
        return _routing(self.model.forward(list(tokens)).routes, self.config)

    def routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> Routing | None:
        """Each tree node's routing at its own position of prefix + root_path(node)
        (experts [n, L, k], margin [n, L]), computed as tree_logits is: one forward
        per leaf over the prefix's cached latents. None without routed experts."""
        if not moe_layers(self.config):
            return None
        return _tree_routing(self.model, self.prefixes, prefix, tokens, parents)

    def rounded_routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                        dtype: str) -> Routing | None:
        """routing() of the model storing every tensor in `dtype` (rounded_tree_logits' model):
        where it picks other experts than routing() does, the float64 margin there is
        within that precision's reach. Its margins are the rounded model's own."""
        if not moe_layers(self.config):
            return None
        return _tree_routing(*self._rounded(dtype), prefix, tokens, parents)


def side_by_side(passes: Sequence, device) -> list:
    """Each pass's result, in order. On the CPU with several of torch's threads, the passes (each a whole
    forward of its own model with its own caches) run at once, one thread each, instead of one after the other
    on every thread: a float64 matmul of a step's few hundred rows gains about 1.6x from a second thread, two
    such passes side by side about 1.9x (benchmarks/README.md). Each pass is the same arithmetic either way;
    only BLAS's blocking over threads differs, the last bits of a float64 sum."""
    threads = torch.get_num_threads()
    if len(passes) < 2 or threads < 2 or torch.device(device).type != "cpu":
        return [run() for run in passes]
    torch.set_num_threads(1)   # the intra-op pool is process-wide: each pass computes on its own thread
    try:
        with ThreadPoolExecutor(max_workers=min(threads, len(passes)), thread_name_prefix="oracle-pass") as pool:
            return [f.result() for f in [pool.submit(run) for run in passes]]
    finally:
        torch.set_num_threads(threads)


def packable(model) -> bool:
    """Whether `model` judges a step's packed trees in one pass: the dense Llama family (its
    attention takes any visibility mask); multi-head latent attention judges per leaf."""
    return isinstance(model, DenseLlama) and model.config.mla is None


def _tree_routing(model, prefixes: PrefixCache, prefix: Sequence[int], tokens: Sequence[int],
                  parents: Sequence[int]) -> Routing:
    """DenseOracle.routing over `model` and its prefix cache."""
    validate_tree(tokens, parents)
    if len(prefix) == 0:
        raise ValueError("routing needs a non-empty prefix")
    cached = prefixes.get(model, prefix)
    rows: list[Routing | None] = [None] * len(tokens)
    for leaf in leaves(parents):
        chain = ancestry(parents, leaf)  # root .. leaf
        path = _routing(model.forward([int(tokens[i]) for i in chain], past=cached.past).routes, model.config)
        for position, node in enumerate(chain):
            if rows[node] is None:
                rows[node] = Routing(path.experts[position:position + 1], path.margin[position:position + 1],
                                     path.layers)
    return Routing(torch.cat([r.experts for r in rows]), torch.cat([r.margin for r in rows]), rows[0].layers)


def _routing(routes, config: ModelConfig) -> Routing:
    """The per-layer Selections of one forward (reference/moe.py) as a Routing over its T positions."""
    experts = torch.stack([r.experts for r in routes], dim=1).cpu()  # [T, L, k]
    margin = torch.stack([r.margin for r in routes], dim=1).cpu()  # [T, L]
    return Routing(experts, margin, moe_layers(config))


ROUNDED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _tree_logits(model: DenseLlama, prefixes: PrefixCache, prefix: Sequence[int], tokens: Sequence[int],
                 parents: Sequence[int]) -> Tensor:
    """DenseOracle.tree_logits over `model` and its prefix cache: [n, V] float64 on CPU."""
    validate_tree(tokens, parents)
    if len(prefix) == 0:
        raise ValueError("tree_logits needs a non-empty prefix")
    cached = prefixes.get(model, prefix)
    rows: list[Tensor | None] = [None] * len(tokens)
    for leaf in leaves(parents):
        chain = ancestry(parents, leaf)  # root .. leaf
        logits = model.forward([int(tokens[i]) for i in chain], past=cached.past).logits  # [len, V]
        for position, node in enumerate(chain):
            if rows[node] is None:
                rows[node] = logits[position]
    return torch.stack(rows).cpu()  # [n, V]


def top_gap(logits: Tensor) -> float:
    """Top-1 minus top-2 of logits [V]; 0.0 would be an exact tie. inf for V == 1."""
    if logits.numel() < 2:
        return float("inf")
    top2 = torch.topk(logits, 2).values  # [2]
    return float(top2[0] - top2[1])
