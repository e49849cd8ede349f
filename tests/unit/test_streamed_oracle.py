"""The layer-streamed oracle (reference/streamed.py) answers as the whole-model
oracle does, on every tiny preset (multi-head latent attention and mixture of
experts included) and on a checkpoint split over shards, reads each layer once
per step (the next one on a background thread) and a routed expert only when
a token picks it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddschema import weight_names
from harness.engine.model.presets import PRESETS, checkpoint_dir
from reference.checkpoint import CheckpointRefused
from reference.deepseek_v3 import moe_layers
from reference.lazy_checkpoint import INDEX, LazyCheckpoint
from reference.oracle import DenseOracle
from reference.streamed import StreamedOracle

TINY = sorted(name for name in PRESETS if name.startswith("tiny"))
MLA = sorted(name for name in TINY if PRESETS[name].mla is not None)
PREFIX = [3, 17, 5, 99, 42, 7, 64, 12, 8, 1, 30]
# a 2-deep, 3-leaf tree under the root: leaves 3, 4 (below 1) and 2
TOKENS, PARENTS = [9, 21, 33, 50, 11], [-1, 0, 0, 1, 1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def both(directory) -> tuple[DenseOracle, StreamedOracle]:
    return DenseOracle.from_checkpoint(directory), StreamedOracle.from_checkpoint(directory)


@pytest.mark.parametrize("preset", TINY)
def test_streamed_equals_dense_on_preset(preset):
    with checkpoint_dir(preset, 0) as d:
        dense, streamed = both(d)
        assert streamed.config == dense.config
        for step in range(3):   # later steps extend the cached prefix (in the leaves' pass, for the streamed one)
            prefix = PREFIX + [int(t) for t in range(step * 3)]
            a, b = streamed.tree_logits(prefix, TOKENS, PARENTS), dense.tree_logits(prefix, TOKENS, PARENTS)
            assert a.shape == b.shape == (len(TOKENS), dense.config.vocab_size)
            assert rel_err(a, b) < 1e-12, preset
        assert rel_err(streamed.rounded_tree_logits(PREFIX, TOKENS, PARENTS, "bfloat16", True),
                       dense.rounded_tree_logits(PREFIX, TOKENS, PARENTS, "bfloat16", True)) < 1e-2
        assert streamed.greedy(PREFIX, 4)[0] == dense.greedy(PREFIX, 4)[0]
        for x, y in zip(streamed.path_hidden(PREFIX[:5]), dense.path_hidden(PREFIX[:5])):
            assert rel_err(x, y) < 1e-12
        (sk, sv), (dk, dv) = streamed.path_kv(PREFIX[:5]), dense.path_kv(PREFIX[:5])
        assert len(sk) == len(dk) == dense.config.num_layers
        for x, y in zip(sk + sv, dk + dv):
            assert rel_err(x, y) < 1e-12
        assert torch.equal(streamed.weight("lm_head.weight"), dense.weight("lm_head.weight"))


def test_streamed_reads_a_sharded_checkpoint(tmp_path):
    """Three shards named by model.safetensors.index.json, read as the single file is."""
    with checkpoint_dir("tiny-qwen3", 1) as d:
        dense = DenseOracle.from_checkpoint(d)
        tensors = {}
        for f in d.glob("*.safetensors"):
            tensors.update(load_file(str(f)))
        (tmp_path / "config.json").write_text((d / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({n: tensors[n] for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    streamed = StreamedOracle.from_checkpoint(tmp_path)
    assert len({e.file for e in streamed.source.entries.values()}) == 3
    assert rel_err(streamed.tree_logits(PREFIX, TOKENS, PARENTS), dense.tree_logits(PREFIX, TOKENS, PARENTS)) < 1e-12
    weight_map[names[0]] = "model-00009-of-00003.safetensors"   # the index names a shard that is not there
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointRefused, match="not there"):
        LazyCheckpoint(tmp_path)


def test_each_layer_read_once_per_step_and_held_alone():
    """A step's leaf paths, and the tokens its prefix gained since the last
    step, go through each layer together: every layer's weights are read once
    per tree_logits call, and without prefetch the last layer is let go before the next is read."""
    with checkpoint_dir("small", 0) as d:
        streamed = StreamedOracle.from_checkpoint(d, prefetch=False)
        streamed.tree_logits(PREFIX, TOKENS, PARENTS)   # the prefix's K/V, cached
        reads, storages, layer_of = [], set(), streamed.source.layer

        def read_layer(layer, buffers=None, routed_experts=True):
            held = {n.split(".")[2] for n in streamed.model.part.w if n.startswith("model.layers.")}
            reads.append((layer, held))
            weights = layer_of(layer, buffers, routed_experts)
            storages.add(weights[f"model.layers.{layer}.mlp.up_proj.weight"].data_ptr())
            return weights
        streamed.source.layer = read_layer
        streamed.tree_logits(PREFIX + [4, 2], TOKENS, PARENTS)   # the last step's commits ride with the leaves
        layers = streamed.config.num_layers
        assert [r[0] for r in reads] == list(range(layers))
        assert all(held == set() for _, held in reads)   # the last layer let go before the next is read
        assert len(storages) == 1   # every layer read into the same float64 memory
        names = set(weight_names(streamed.config))
        assert all(n in names for n in streamed.model.part.w)


def counted_layer_reads(oracle: StreamedOracle) -> list[int]:
    """The layers `oracle` reads from now on, in order (its source's layer() counted)."""
    reads, layer_of = [], oracle.source.layer

    def read_layer(layer, buffers=None, routed_experts=True):
        reads.append(layer)
        return layer_of(layer, buffers, routed_experts)
    oracle.source.layer = read_layer
    return reads


@pytest.mark.parametrize("preset", ["small", "tiny-kimi-k2"])
def test_one_pass_per_step_and_the_prefetch_changes_no_bit(preset):
    """prepare_step judges every request of a step, float64 and rounded, with each layer read once;
    the answers equal one tree at a time to 1e-12, and prefetching the next layer on a thread changes no bit."""
    trees = [(PREFIX, TOKENS, PARENTS), (PREFIX[:7] + [2], [5, 6, 7], [-1, 0, 0])]
    with checkpoint_dir(preset, 0) as d:
        ahead, plain = StreamedOracle.from_checkpoint(d), StreamedOracle.from_checkpoint(d, prefetch=False)
        for oracle in (ahead, plain):
            oracle.prepare_step(trees, [("bfloat16", True)])   # the prompts' K/V cached first
        steps = [[(p + [1, 2], t, q) for p, t, q in trees], [(p + [1, 2, 3], t, q) for p, t, q in trees]]
        reads = counted_layer_reads(ahead)
        for step in steps:
            ahead.prepare_step(step, [("bfloat16", True)])
            plain.prepare_step(step, [("bfloat16", True)])
            for tree in step:
                assert torch.equal(ahead.tree_logits(*tree), plain.tree_logits(*tree))
                assert torch.equal(ahead.rounded_tree_logits(*tree, "bfloat16", True),
                                   plain.rounded_tree_logits(*tree, "bfloat16", True))
        assert reads == 2 * list(range(ahead.config.num_layers))   # both steps, both trees, both models: once
        alone = StreamedOracle.from_checkpoint(d)
        for tree in steps[1]:   # a tree at a time, each a pass of its own
            assert rel_err(alone.tree_logits(*tree), ahead.tree_logits(*tree)) < 1e-12
            if moe_layers(alone.config):
                assert torch.equal(alone.routing(*tree).experts, ahead.routing(*tree).experts)


@pytest.mark.parametrize("preset", MLA)
def test_mla_moe_answers_as_dense(preset):
    """Multi-head latent attention and routed experts: routing (experts and margins), path_latent and
    path_routing equal the whole-model oracle's; a routed expert is read only when a token picks it."""
    with checkpoint_dir(preset, 0) as d:
        dense, streamed = both(d)
        for step in range(2):
            prefix = PREFIX + list(range(step * 2))
            a, b = streamed.routing(prefix, TOKENS, PARENTS), dense.routing(prefix, TOKENS, PARENTS)
            assert a.layers == b.layers == moe_layers(dense.config) and a.layers
            assert torch.equal(a.experts, b.experts)
            assert rel_err(a.margin, b.margin) < 1e-12
        a, b = streamed.rounded_routing(PREFIX, TOKENS, PARENTS, "bfloat16"), dense.rounded_routing(
            PREFIX, TOKENS, PARENTS, "bfloat16")
        assert a.experts.shape == b.experts.shape
        assert rel_err(streamed.path_latent(PREFIX[:6]), dense.path_latent(PREFIX[:6])) < 1e-12
        assert torch.equal(streamed.path_routing(PREFIX[:6]).experts, dense.path_routing(PREFIX[:6]).experts)
        read, experts_read = streamed.source.read, []

        def counted_read(name, out=None):
            if ".mlp.experts." in name:
                experts_read.append((int(name.split(".")[2]), int(name.split(".")[5])))
            return read(name, out)
        streamed.source.read = counted_read
        picked = streamed.path_routing(PREFIX[:4])   # the layer reads before it were all dense
        wanted = {(layer, int(e)) for i, layer in enumerate(picked.layers) for e in picked.experts[:, i].unique()}
        assert set(experts_read) == wanted   # each picked expert read, no other
        assert len(experts_read) == 3 * len(wanted)   # gate, up and down projections, once each


def test_lazy_reads_rows_of_the_embedding(monkeypatch):
    from reference import lazy_checkpoint
    with checkpoint_dir("tiny", 0) as d:
        lazy, dense = LazyCheckpoint(d), DenseOracle.from_checkpoint(d)
        monkeypatch.setattr(lazy_checkpoint, "READ_CHUNK", 1000)   # a tensor read in chunks by several threads
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            assert torch.equal(lazy.read(name), dense.weight(name))
        ids = torch.tensor([5, 1, 5, 127])
        assert torch.equal(lazy.gather_rows("model.embed_tokens.weight", ids),
                           dense.weight("model.embed_tokens.weight")[ids])
        assert torch.equal(lazy.rows("lm_head.weight", 3, 9), dense.weight("lm_head.weight")[3:9])
        with pytest.raises(KeyError):
            lazy.read("model.layers.9.mlp.up_proj.weight")


def test_a_batched_bf16_run_judges_each_step_in_its_prepared_pass(tmp_path, monkeypatch):
    """`ddcheck run` hands the streamed oracle every request's tree of a step first: each
    tree_logits / rounded_tree_logits of the check is then answered from that step's pass."""
    from typer.testing import CliRunner

    from harness.cli import _register, app
    asked, answered = [], StreamedOracle._answered

    def counted(self, model, prefixes, prefix, tokens, parents):
        key = (id(model), tuple(prefix), tuple(tokens), tuple(parents))
        asked.append(key in self.prepared)
        return answered(self, model, prefixes, prefix, tokens, parents)
    monkeypatch.setattr(StreamedOracle, "_answered", counted)
    _register()
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--budget", "8", "--max-new-tokens", "3",
                                      "--batch", "2", "--dtype", "bfloat16", "--no-cuda-graph", "--backend", "torch",
                                      "--oracle", "streamed", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["oracle"] == "streamed" and summary["steps"] >= 1
    assert all(asked) and len(asked) > 2 * summary["steps"]   # (float64, rounded) x requests: none a pass of its own


def test_each_checkpoint_owns_its_chunk_readers_and_closes_them():
    """The chunk-reading threads belong to the checkpoint that reads (no pool at module level, shared by
    every oracle of the process and never shut down): a second checkpoint has its own, close() ends them."""
    from concurrent.futures import ThreadPoolExecutor

    from reference import lazy_checkpoint
    assert not [n for n, v in vars(lazy_checkpoint).items() if isinstance(v, ThreadPoolExecutor)]
    with checkpoint_dir("tiny", 0) as d:
        a, b = LazyCheckpoint(d), LazyCheckpoint(d)
        assert isinstance(a.readers, ThreadPoolExecutor) and a.readers is not b.readers
        a.read("model.embed_tokens.weight")
        a.close()
        with pytest.raises(RuntimeError):   # a shut-down pool takes no more work
            a.readers.submit(int)
        assert torch.equal(b.read("model.embed_tokens.weight"), b.read("model.embed_tokens.weight"))
        b.close()
