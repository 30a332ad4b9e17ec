"""The chunk pipeline every checkpoint-producing operation runs through, and `apply_delta`.

An engine says, per tensor, what to precompute over the whole tensor (`prepare`, only for tensors
split into several row chunks) and how to turn one row chunk into output rows plus the merged delta's
rows (`compute`). The pipeline walks tensors in sorted-name order, runs `compute` on a thread pool with a
bounded window of chunks in flight (torch releases the GIL, so reading, computing, hashing and writing
overlap on both cores), and hands results to the checkpoint writer in order. Peak memory is a few chunks
per input, whatever the model's size.

One rule makes a worker's `apply_delta` bit-identical to the coordinator's checkpoint: every output
weight is `apply_rows(base, D)` where D is the merged delta exactly as stored in its file.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, Sequence

import torch

from skillswarm.merge.checkpoint import DEFAULT_SHARD_BYTES, Checkpoint, CheckpointWriter
from skillswarm.merge.codecs import MERGED_DELTA_CODEC
from skillswarm.merge.deltas import FLOAT_DTYPES, DeltaFile, DeltaInfo, delta_metadata
from skillswarm.merge.exact import SquareSum, cast, check_float_environment
from skillswarm.merge.progress import progress_bar
from skillswarm.merge.tensorfile import TensorFileWriter, dtype_name, row_chunks
from skillswarm.protocol.atomic import atomic_open
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import FileEntry

CHUNK_ELEMS = 1 << 18  # elements per row chunk (1 MiB of float32); results do not depend on it


def default_workers() -> int:
    """Compute threads: both cores of a 2-core machine, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def is_float(dtype: torch.dtype) -> bool:
    """Whether tensors of this dtype are weights a delta can change."""
    return dtype in FLOAT_DTYPES


def check_delta_fits(base: Checkpoint, delta: DeltaFile) -> None:
    """Every tensor the delta changes exists in the base with the same shape and a float dtype."""
    for name in delta.names():
        if name not in base:
            raise MergeError(f"{delta.path} changes `{name}`, which {base.dir} does not have; "
                             "is this delta for another model? (screen deltas with skillswarm.merge.screen_deltas)")
        e = base.entry(name)
        if e.shape != delta.shape(name) or not is_float(e.dtype):
            raise MergeError(f"{delta.path}: `{name}` is {list(delta.shape(name))} but the base holds "
                             f"{e.dtype} {list(e.shape)}; is this delta for another model?")


def apply_rows(base: torch.Tensor, delta: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output weights = base + delta, added in float32 (float64 for a float64 base), cast to `out_dtype`
    (default: the base's). The one definition of applying a delta, shared by merge and apply."""
    if delta is None:
        return base if out_dtype in (None, base.dtype) else base.to(out_dtype)
    work = torch.promote_types(base.dtype, torch.float32)
    return cast(base.to(work) + delta.to(work), out_dtype or base.dtype)


@dataclass(frozen=True)
class MergeResult:
    """A written checkpoint: its weights hash (`state_dict_hash`), files for a CheckpointManifest, and the
    merged delta (parent -> this) when one was requested."""

    out_dir: Path
    weights_hash: str
    files: list[FileEntry]
    num_tensors: int
    seconds: float
    delta: DeltaInfo | None = None


class Engine(Protocol):
    """What the pipeline needs from an operation (merge, apply)."""

    base: Checkpoint

    def out_dtype(self, name: str) -> torch.dtype: ...
    def delta_dtype(self, name: str) -> torch.dtype | None: ...  # None: not in the merged delta
    def prepare(self, name: str, chunks: Sequence[tuple[int, int]], pool: ThreadPoolExecutor) -> Any: ...
    def compute(self, name: str, r0: int, r1: int, prep: Any) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class _MergedDelta:
    """Streams the merged delta (dense, the dtype of its codec) next to the checkpoint."""

    def __init__(self, f: IO[bytes], codec: str, layout: list, declared: dict, base_hash: str | None) -> None:
        self.codec = codec
        self.w = TensorFileWriter(f, layout, delta_metadata(codec, {}, declared, base_hash, None))
        self.sq = SquareSum()
        self.n = len(layout)
        self.base_hash = base_hash

    def write(self, name: str, d: torch.Tensor, sq: SquareSum) -> None:
        self.w.write(name, d)
        self.sq.merge(sq)  # squared on the worker thread that computed d: the writer thread only writes

    def info(self, path: Path) -> DeltaInfo:
        sha, size = self.w.close()
        return DeltaInfo(path=path, sha256=sha, size=size, codec=self.codec, params={}, norm=self.sq.norm(),
                         num_tensors=self.n, error=None, base_hash=self.base_hash)


def run_pipeline(engine: Engine, out_dir: Path | str, *, delta_out: Path | str | None = None,
                 delta_codec: str = MERGED_DELTA_CODEC, delta_base_hash: str | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, workers: int | None = None,
                 chunk_elems: int = CHUNK_ELEMS, progress: bool = True, label: str = "merging",
                 config_dtype: torch.dtype | None = None, tokenizer_from: Path | str | None = None) -> MergeResult:
    """Write `out_dir` (a checkpoint) and optionally `delta_out` (the merged delta) from `engine`.
    `config_dtype`: record this dtype in the output's config.json (what transformers loads it as);
    `tokenizer_from`: take the tokenizer files from this model directory instead of the base's."""
    t0 = time.perf_counter()
    check_float_environment()
    base = engine.base
    names = base.names()
    layout = [(n, engine.out_dtype(n), base.entry(n).shape) for n in names]
    dnames = [n for n in names if engine.delta_dtype(n) is not None]
    if delta_out is not None and not dnames:
        raise MergeError("the base has no floating-point weights; there is no delta to write")
    workers = workers or default_workers()
    with contextlib.ExitStack() as stack:  # on error: the temp checkpoint and the temp delta file are deleted
        cw = stack.enter_context(CheckpointWriter(out_dir, layout, max_shard_bytes=max_shard_bytes, overwrite=overwrite))
        md = None
        if delta_out is not None:
            md = _MergedDelta(stack.enter_context(atomic_open(delta_out, "wb")), delta_codec,
                              [(n, engine.delta_dtype(n), base.entry(n).shape) for n in dnames],
                              {n: [dtype_name(base.entry(n).dtype), list(base.entry(n).shape)] for n in dnames},
                              delta_base_hash)
        _stream(engine, names, cw, md, workers, chunk_elems, progress, label)
        info = md.info(Path(delta_out)) if md else None  # type: ignore[arg-type]
        weights_hash, files = cw.commit(aux_from=base.dir, tokenizer_from=tokenizer_from, dtype=config_dtype)
    return MergeResult(out_dir=Path(out_dir), weights_hash=weights_hash, files=files, num_tensors=len(names),
                       seconds=time.perf_counter() - t0, delta=info)


def _stream(engine: Engine, names: list[str], cw: CheckpointWriter, md: _MergedDelta | None, workers: int,
            chunk_elems: int, progress: bool, label: str) -> None:
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="skillswarm-merge")
    window: collections.deque = collections.deque()

    def compute(name: str, r0: int, r1: int, prep: Any) -> tuple[torch.Tensor, torch.Tensor | None, SquareSum | None]:
        out, d = engine.compute(name, r0, r1, prep)
        sq = None
        if md is not None and d is not None:
            sq = SquareSum()
            sq.add(d)
        return out, d, sq

    def drain_one(advance: Any) -> None:
        name, last, fut = window.popleft()
        out, d, sq = fut.result()
        cw.write(name, out)
        if md is not None and d is not None:
            md.write(name, d, sq)
        if last:
            advance()

    try:
        with progress_bar(len(names), label, enabled=progress) as advance:
            for name in names:
                chunks = row_chunks(engine.base.entry(name).shape, chunk_elems)
                prep = engine.prepare(name, chunks, pool) if len(chunks) > 1 else None
                for i, (r0, r1) in enumerate(chunks):
                    while len(window) > workers:
                        drain_one(advance)
                    window.append((name, i == len(chunks) - 1, pool.submit(compute, name, r0, r1, prep)))
            while window:
                drain_one(advance)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _ApplyEngine:
    """out = apply_rows(base, delta) per chunk; tensors the delta leaves out are copied."""

    def __init__(self, base: Checkpoint, delta: DeltaFile, out_dtype: torch.dtype | None) -> None:
        self.base, self.delta, self._out = base, delta, out_dtype
        check_delta_fits(base, delta)

    def out_dtype(self, name: str) -> torch.dtype:
        dtype = self.base.entry(name).dtype
        return self._out if self._out is not None and is_float(dtype) else dtype

    def delta_dtype(self, name: str) -> torch.dtype | None:
        return None

    def prepare(self, name: str, chunks: Sequence[tuple[int, int]], pool: ThreadPoolExecutor) -> Any:
        return None

    def compute(self, name: str, r0: int, r1: int, prep: Any) -> tuple[torch.Tensor, None]:
        return apply_rows(self.base.read_rows(name, r0, r1), self.delta.rows(name, r0, r1), self.out_dtype(name)), None


def apply_delta(base_dir: Path | str, delta_path: Path | str, out_dir: Path | str, *,
                expected_base_hash: str | None = None, out_dtype: torch.dtype | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, workers: int | None = None,
                progress: bool = True) -> MergeResult:
    """Write base + delta as a new checkpoint. A worker holding version V and the merged delta V -> V+1
    gets files bit-identical to the coordinator's V+1 (same sharding, same bytes, same weights hash).
    `expected_base_hash`: refuse a delta recorded against another base."""
    delta = DeltaFile(delta_path)
    base = Checkpoint(base_dir)
    try:
        if expected_base_hash and delta.base_hash and delta.base_hash != expected_base_hash:
            raise MergeError(f"{delta_path} was made against base {delta.base_hash[:12]}, not {expected_base_hash[:12]}")
        engine = _ApplyEngine(base, delta, out_dtype)
        return run_pipeline(engine, out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite, workers=workers,
                            progress=progress, label="applying delta", config_dtype=out_dtype)
    finally:
        base.close()
        delta.close()


__all__ = ["CHUNK_ELEMS", "MergeResult", "apply_delta", "apply_rows", "run_pipeline"]
