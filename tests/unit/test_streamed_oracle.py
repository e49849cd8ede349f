"""The layer-streamed oracle (reference/streamed.py) answers as the whole-model
oracle does, on every tiny preset and on a checkpoint split over shards, and
holds one layer's weights at a time."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddschema import weight_names
from harness.engine.model.presets import PRESETS, checkpoint_dir
from reference.checkpoint import CheckpointRefused
from reference.lazy_checkpoint import INDEX, LazyCheckpoint
from reference.oracle import DenseOracle
from reference.streamed import StreamedOracle

# the streamed oracle runs the grouped-query families; multi-head latent attention stays on the dense one
# (its refusal is tested below)
TINY = sorted(name for name, cfg in PRESETS.items() if name.startswith("tiny") and cfg.mla is None)
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
    per tree_logits call, and the last layer is let go before the next is read."""
    with checkpoint_dir("small", 0) as d:
        streamed = StreamedOracle.from_checkpoint(d)
        streamed.tree_logits(PREFIX, TOKENS, PARENTS)   # the prefix's K/V, cached
        reads, storages, layer_of = [], set(), streamed.source.layer

        def read_layer(layer, buffers=None):
            held = {n.split(".")[2] for n in streamed.model.part.w if n.startswith("model.layers.")}
            reads.append((layer, held))
            weights = layer_of(layer, buffers)
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


def test_lazy_reads_rows_of_the_embedding():
    with checkpoint_dir("tiny", 0) as d:
        lazy, dense = LazyCheckpoint(d), DenseOracle.from_checkpoint(d)
        ids = torch.tensor([5, 1, 5, 127])
        assert torch.equal(lazy.gather_rows("model.embed_tokens.weight", ids),
                           dense.weight("model.embed_tokens.weight")[ids])
        assert torch.equal(lazy.rows("lm_head.weight", 3, 9), dense.weight("lm_head.weight")[3:9])
        with pytest.raises(KeyError):
            lazy.read("model.layers.9.mlp.up_proj.weight")


def test_multi_head_latent_attention_is_left_to_the_dense_oracle(tmp_path):
    from benchmarks.deepseek_checkpoint import write
    d = write("tiny-deepseek-v3", tmp_path, dtype=torch.float64)
    with pytest.raises(CheckpointRefused, match="--oracle dense"):
        StreamedOracle.from_checkpoint(d)
    assert DenseOracle.from_checkpoint(d).config.mla is not None
