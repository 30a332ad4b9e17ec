"""Hugging Face checkpoints, read tensor by tensor and written as a directory that appears whole or not at all.

The writer takes tensors in sorted-name order (the order of the canonical state-dict hash), shards them
by size like `save_pretrained` (model.safetensors, or model-0000i-of-0000n.safetensors plus
model.safetensors.index.json), computes the weights hash and every file's sha256 while writing, copies
config and tokenizer files from the base, and renames its temp directory onto the target at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from skillswarm.merge.tensorfile import Entry, Layout, TensorFile, TensorFileWriter, numel
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.hashing import StateDictHasher, sha256_file
from skillswarm.protocol.records import FileEntry

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3  # save_pretrained's long-standing default
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")  # what a checkpoint manifest's FileEntry accepts


class Checkpoint:
    """The safetensors weights of a model directory (every *.safetensors file, as `weights_hash` sees them)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise MergeError(f"{self.dir} is not a directory; pass a Hugging Face model directory")
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise MergeError(f"no *.safetensors weights in {self.dir}; save the model with "
                             "save_pretrained(..., safe_serialization=True)")
        self.files = [TensorFile(p) for p in paths]
        self._owner: dict[str, TensorFile] = {}
        for f in self.files:
            for name in f.keys():
                if name in self._owner:
                    raise MergeError(f"tensor `{name}` is in both {self._owner[name].path.name} and {f.path.name}")
                self._owner[name] = f

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def entry(self, name: str) -> Entry:
        """dtype, shape and byte range of a tensor."""
        if name not in self._owner:
            raise MergeError(f"{self.dir} has no tensor `{name}`")
        return self._owner[name].entry(name)

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor."""
        return self._owner[name].read(name)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of a tensor along dim 0."""
        return self._owner[name].read_rows(name, r0, r1)

    def close(self) -> None:
        """Release the files."""
        for f in self.files:
            f.close()


def aux_files(model_dir: Path) -> list[Path]:
    """The files a checkpoint carries besides weights (config, generation config, tokenizer, chat template)."""
    out = []
    for p in sorted(Path(model_dir).iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        if not _SAFE_NAME.match(p.name):
            log.warning("not copying %s: its name is not a portable file name", p.name)
            continue
        out.append(p)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")


def is_tokenizer_file(name: str) -> bool:
    """Whether a model directory's file belongs to its tokenizer (or chat template)."""
    return name in TOKENIZER_FILES or name.startswith("tokenizer")


def write_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """Record `dtype` in a config.json as both transformers 5 (`dtype`) and 4 (`torch_dtype`) read it, so
    from_pretrained(..., dtype="auto") loads the weights in the dtype they are stored in."""
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise MergeError(f"{path} is not a JSON object")
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def plan_shards(layout: Layout, max_shard_bytes: int) -> list[tuple[str, list]]:
    """Greedy size-bounded shards in layout order, named as save_pretrained names them."""
    groups: list[list] = [[]]
    size = 0
    for item in layout:
        nbytes = numel(item[2]) * item[1].itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes a sharded checkpoint into a temp directory beside `out_dir`; `commit` renames it into place,
    `abort` (or leaving the `with` block by an exception) deletes it. Use `write(name, chunk)` for every
    chunk of every tensor of `layout`, in layout order; the layout must be sorted by name."""

    def __init__(self, out_dir: Path | str, layout: Layout, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False) -> None:
        self.out_dir = Path(out_dir).absolute()
        if self.out_dir.exists() and not overwrite:
            raise MergeError(f"{self.out_dir} already exists; choose another output or overwrite it (--force)")
        names = [n for n, _, _ in layout]
        if names != sorted(names) or len(set(names)) != len(names):
            raise MergeError("internal: checkpoint layout must be sorted by name, without duplicates")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out_dir.parent, prefix=f".{self.out_dir.name}.", suffix=".tmp"))
        self.shards = plan_shards(layout, max_shard_bytes)
        self._meta = {n: (d, tuple(s)) for n, d, s in layout}
        self._shard_of = {n: i for i, (_, items) in enumerate(self.shards) for n, _, _ in items}
        self._hasher = StateDictHasher()
        self._current: str | None = None
        self._open_i = -1
        self._writer: TensorFileWriter | None = None
        self._fh = None
        self._done: dict[str, tuple[str, int]] = {}

    def _switch_to(self, i: int) -> None:
        while self._open_i < i:
            self._close_shard()
            self._open_i += 1
            fname, items = self.shards[self._open_i]
            self._fh = open(self.tmp / fname, "wb")
            self._writer = TensorFileWriter(self._fh, items, {"format": "pt"})

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        sha, size = self._writer.close()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._done[self.shards[self._open_i][0]] = (sha, size)
        self._writer = self._fh = None

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """The next chunk (rows, in order) of tensor `name`."""
        if name != self._current:
            dtype, shape = self._meta[name]
            self._hasher.begin(name, dtype, shape)
            self._current = name
        self._switch_to(self._shard_of[name])
        self._writer.write(name, chunk)
        self._hasher.update(chunk)

    def commit(self, aux_from: Path | str | None = None, *, tokenizer_from: Path | str | None = None,
               dtype: torch.dtype | None = None) -> tuple[str, list[FileEntry]]:
        """Finish the shards, write the index, copy config/tokenizer files from `aux_from` (the tokenizer's
        from `tokenizer_from` when given), record `dtype` in config.json, move the directory into place;
        return (weights hash, files sorted by path)."""
        self._switch_to(len(self.shards) - 1)
        self._close_shard()
        entries = {name: FileEntry(path=name, sha256=sha, size=size) for name, (sha, size) in self._done.items()}
        extra: list[Path] = []
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(numel(s) * d.itemsize for d, s in self._meta.values())},
                     "weight_map": {n: self.shards[i][0] for n, i in self._shard_of.items()}}
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            extra.append(self.tmp / INDEX_NAME)
        sources = aux_files(Path(aux_from)) if aux_from else []
        if tokenizer_from is not None:
            sources = [p for p in sources if not is_tokenizer_file(p.name)]
            sources += [p for p in aux_files(Path(tokenizer_from)) if is_tokenizer_file(p.name)]
        for src in sources:
            shutil.copyfile(src, self.tmp / src.name)
            extra.append(self.tmp / src.name)
        if dtype is not None and (self.tmp / "config.json").is_file():
            write_config_dtype(self.tmp / "config.json", dtype)
        for p in extra:
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            entries[p.name] = FileEntry(path=p.name, sha256=sha256_file(p), size=p.stat().st_size)
        _fsync_dir(self.tmp)
        old = None
        if self.out_dir.exists():  # overwrite: move the old one aside first, delete it after
            old = Path(tempfile.mkdtemp(dir=self.out_dir.parent, prefix=f".{self.out_dir.name}.", suffix=".old"))
            os.replace(self.out_dir, old / "d")
        os.rename(self.tmp, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self._hasher.hexdigest(), [entries[k] for k in sorted(entries)]

    def abort(self) -> None:
        """Delete the temp directory (the target is untouched)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = self._writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
