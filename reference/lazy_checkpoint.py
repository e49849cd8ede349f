"""A checkpoint read one tensor at a time, when asked: the layer-streamed
oracle's source (reference/streamed.py). Only the safetensors headers are
read up front; a tensor's bytes (or a range of its rows) are read when the
oracle computes with it, widened to float64 on its device, and let go after.

It is the oracle's own reader, like reference/checkpoint.py (whose header
parser and config mapping it shares): nothing here comes from harness/ or the
safetensors package, so a loader bug on the engine's side cannot hide in both
readings. A multi-shard checkpoint is read through its
model.safetensors.index.json (each name in the shard its weight_map gives);
without an index, every *.safetensors file in the directory is read, as the
whole-model oracle does.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.checkpoint import (SAFETENSORS_DTYPES, CheckpointRefused, read_checkpoint_config, read_header,
                                  with_tensors)
from reference.names import weight_names

INDEX = "model.safetensors.index.json"
READ_CHUNK = 64 << 20   # a large tensor's bytes are read in chunks of this size by several threads at once
READ_THREADS = 4        # copying from the page cache: one thread alone does not reach the memory's speed


def _pread(fd: int, into: memoryview, offset: int, file: Path) -> None:
    """Fill `into` with the file's bytes from `offset` (one pread returns at most about 2 GiB)."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            raise CheckpointRefused(f"{file.name}: a tensor runs past the end of the file")
        done += got


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: `file`, from byte `begin` (absolute) to `end`."""

    file: Path
    begin: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        if self.end - self.begin != numel * self.dtype.itemsize:
            raise CheckpointRefused(f"{self.file.name}: a tensor of shape {list(self.shape)} takes "
                                    f"{numel * self.dtype.itemsize} bytes, its header gives {self.end - self.begin}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index of the first dimension)."""
        return (self.end - self.begin) // self.shape[0] if self.shape and self.shape[0] else 0


def _entries_of(path: Path, only: set[str] | None = None) -> dict[str, TensorEntry]:
    """The tensors of one .safetensors file (those in `only` when given) by name."""
    with path.open("rb") as f:
        body, header = read_header(f, path)
    out = {}
    for name, entry in header.items():
        if only is not None and name not in only:
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointRefused(f"{path.name}: {name} has dtype {entry['dtype']}, "
                                    f"the oracle reads {', '.join(SAFETENSORS_DTYPES)}")
        begin, end = entry["data_offsets"]
        out[name] = TensorEntry(path, body + begin, body + end, SAFETENSORS_DTYPES[entry["dtype"]],
                                tuple(int(d) for d in entry["shape"]))
    return out


def tensor_entries(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor's location in a checkpoint directory (see the module doc)."""
    directory = Path(directory)
    index = directory / INDEX
    if not index.is_file():
        entries: dict[str, TensorEntry] = {}
        for f in sorted(directory.glob("*.safetensors")):
            entries.update(_entries_of(f))
        return entries
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointRefused(f"{directory}: {INDEX} has no weight_map") from None
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, set()).add(name)
    entries = {}
    for file, names in sorted(by_file.items()):
        if not (directory / file).is_file():
            raise CheckpointRefused(f"{directory}: {INDEX} names shard {file}, which is not there")
        found = _entries_of(directory / file, names)
        if len(found) != len(names):
            raise CheckpointRefused(f"{directory}: shard {file} lacks {sorted(names - set(found))[0]}, "
                                    f"which {INDEX} puts there")
        entries.update(found)
    return entries


class LazyCheckpoint:
    """A checkpoint directory's config and tensor locations; tensors read on demand."""

    def __init__(self, directory, device: str = "cpu") -> None:
        self.directory = Path(directory)
        self.device = torch.device(device)
        base = read_checkpoint_config(self.directory)
        self.entries = tensor_entries(self.directory)
        self.config: ModelConfig = with_tensors(base, {n: e.shape for n, e in self.entries.items()}, self.directory)
        self.names = set(weight_names(self.config))   # the tensors the forward pass uses
        # each file opened once, for the oracle's life: a temporary directory (a preset written out for the
        # run) may go once both sides have read the headers, and an open file stays readable
        self.files = {path: path.open("rb") for path in sorted({e.file for e in self.entries.values()})}
        self.local = threading.local()   # per thread (the oracle's, its layer reader's): the staging bytes
        # the chunk readers of one large tensor: owned by this checkpoint, shut down with it
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="oracle-pread")

    def close(self) -> None:
        for f in getattr(self, "files", {}).values():   # (a refused checkpoint opened none)
            f.close()
        if getattr(self, "readers", None) is not None:
            self.readers.shutdown(wait=False)   # (from __del__ too: never wait there)

    def __del__(self) -> None:
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.names or name not in self.entries:
            raise KeyError(name)
        return self.entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def nbytes_float64(self) -> int:
        """What the whole model takes in float64 (every tensor the forward pass uses)."""
        return sum(8 * (self._entry(n).end - self._entry(n).begin) // self._entry(n).dtype.itemsize
                   for n in weight_names(self.config))

    def read(self, name: str, out: Tensor | None = None) -> Tensor:
        """The tensor under a Hugging Face name, float64 on the device (lm_head.weight is the embedding when tied);
        written into `out` when it has the tensor's shape (a buffer reused: no fresh memory to fault in)."""
        entry = self._entry(name)
        return self._widened(self._bytes(entry, entry.begin, entry.end), entry.shape, out)

    def rows(self, name: str, start: int, stop: int, out: Tensor | None = None) -> Tensor:
        """Rows start..stop-1 of a tensor's first dimension [stop - start, ...], float64 on the device
        (into `out` when it has that shape)."""
        entry = self._entry(name)
        if not 0 <= start <= stop <= entry.shape[0]:
            raise ValueError(f"rows {start}..{stop} outside {name}'s {entry.shape[0]}")
        flat = self._bytes(entry, entry.begin + start * entry.row_bytes, entry.begin + stop * entry.row_bytes)
        return self._widened(flat, (stop - start, *entry.shape[1:]), out)

    def gather_rows(self, name: str, ids: Tensor) -> Tensor:
        """Rows ids [T] of a tensor -> [T, ...] float64 on the device, each distinct row read once."""
        wanted = sorted({int(i) for i in ids.tolist()})
        table = torch.stack([self.rows(name, i, i + 1)[0] for i in wanted])  # [distinct, ...]
        where = torch.tensor([wanted.index(int(i)) for i in ids.tolist()], device=table.device)  # [T]
        return table[where]

    def layer(self, layer: int, buffers: dict[str, Tensor] | None = None,
              routed_experts: bool = True) -> dict[str, Tensor]:
        """Every tensor of decoder layer `layer`, float64 on the device. buffers: float64 tensors by
        the name after `model.layers.N.`, reused for (and updated with) this layer's: every layer
        of a model has the same shapes, so a model streamed layer by layer allocates one layer once.
        routed_experts False: a mixture of experts' routed experts are left out (read when picked)."""
        prefix, buffers = f"model.layers.{layer}.", {} if buffers is None else buffers
        out = {}
        for n in weight_names(self.config):
            if n.startswith(prefix) and (routed_experts or ".mlp.experts." not in n):
                key = n[len(prefix):]
                out[n] = buffers[key] = self.read(n, buffers.get(key))
        return out

    def _widened(self, flat: Tensor, shape: tuple[int, ...], out: Tensor | None) -> Tensor:
        """flat [numel] (the staging bytes, or their copy on the device) as a NEW float64 tensor [shape]
        on the device, or written into `out`: never a view of the staging buffer, which the next read reuses."""
        if out is None or tuple(out.shape) != tuple(shape) or out.dtype != torch.float64 or out.device != self.device:
            out = torch.empty(shape, dtype=torch.float64, device=self.device)
        return out.copy_(flat.view(shape))

    def _bytes(self, entry: TensorEntry, begin: int, end: int) -> Tensor:
        """Bytes begin..end of the entry's file as a flat tensor of its dtype, moved to the device before
        widening. On the CPU it is a view of this thread's staging buffer (reused by its next read: widen
        it first); for a GPU the staging buffer is pinned host memory, copied before this returns.
        Read at an offset (pread): threads share the open files, never a file position."""
        n = end - begin
        if n == 0:
            return torch.empty(0, dtype=entry.dtype, device=self.device)
        staging = getattr(self.local, "staging", None)
        if staging is None or staging.numel() < n:   # grown to the largest read so far, kept; pinned for a GPU
            staging = self.local.staging = torch.empty(n, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        raw, fd = memoryview(staging[:n].numpy()), self.files[entry.file].fileno()
        chunks = [(start, min(n, start + READ_CHUNK)) for start in range(0, n, READ_CHUNK)]
        list(self.readers.map(lambda c: _pread(fd, raw[c[0]:c[1]], begin + c[0], entry.file), chunks))
        return staging[:n].view(entry.dtype).to(self.device)   # from pinned memory: the copy runs at full speed
