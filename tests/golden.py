"""The golden computation: fixed inputs through every codec, method and aggregator, reduced to sha256s.

`compute(workdir)` builds a small base checkpoint and delta files from integer bit patterns (numpy's
legacy RandomState, whose stream is frozen across versions and platforms; torch's own RNG is not used
because its float kernels may differ between CPUs), then encodes, decodes, screens and merges them at
every chunk size from one row to whole tensors, and returns {name: hash}. Inside `compute`, every chunking
and thread count must give the same hash (it raises otherwise); `tests/test_merge_golden.py` compares the
result with hashes written in the test, and runs it again under other CPU kernels and thread counts.

Run it anywhere: `python -m tests.golden` prints the JSON (used to compare machines and torch builds).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

import skillswarm.merge.streaming as streaming
from skillswarm.merge.deltas import DeltaFile, encode_delta
from skillswarm.merge.exact import cast
from skillswarm.merge.pipeline import apply_delta
from skillswarm.merge.screening import screen_deltas
from skillswarm.merge.streaming import MergeSpec, merge_checkpoint
from skillswarm.protocol.hashing import StateDictHasher, sha256_file
from skillswarm.protocol.records import AGGREGATORS, MERGE_METHODS

SHAPES: dict[str, tuple[int, ...]] = {
    "a.emb": (13, 8), "a.w": (8, 12), "b.bias": (12,), "b.conv": (3, 4, 5), "c.scale": (), "e.big": (40, 30),
}
METHOD_PARAMS: dict[str, dict[str, Any]] = {
    "linear": {}, "task_arithmetic": {"lambda": 0.7}, "ties": {"density": 0.3}, "dare_linear": {"density": 0.5},
    "dare_ties": {"density": 0.5}, "breadcrumbs": {"density": 0.3, "gamma": 0.05},
}
# (label, codec, params): one delta file each, from its own seed
CODEC_CASES: list[tuple[str, str, dict[str, float]]] = [
    ("dense_fp32", "dense_fp32", {}), ("dense_bf16", "dense_bf16", {}), ("dense_fp16", "dense_fp16", {}),
    ("topk16", "topk", {"density": 0.3}), ("topk32", "topk", {"density": 0.5, "value_bits": 32}),
    ("int8", "int8", {}), ("lora", "lora", {"rank": 3}), ("topk8", "topk", {"density": 0.3, "value_bits": 8}),
]
# (chunk_elems, workers): one row at a time on one thread .. whole tensors on two
CHUNKINGS = [(1, 1), (37, 2), (1 << 20, 2)]


def _bits(rs: np.random.RandomState, shape: tuple[int, ...], exp_lo: int, exp_hi: int) -> torch.Tensor:
    """float32 values from random sign, exponent in [exp_lo, exp_hi] (biased) and mantissa bits."""
    n = int(np.prod(shape, dtype=np.int64))
    sign = rs.randint(0, 2, n, dtype=np.int64) << 31
    exp = rs.randint(exp_lo, exp_hi + 1, n, dtype=np.int64) << 23
    mant = rs.randint(0, 1 << 23, n, dtype=np.int64)
    bits = (sign | exp | mant).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).reshape(shape).copy())


def _with_specials(x: torch.Tensor, rs: np.random.RandomState) -> torch.Tensor:
    """Plant the values that break careless arithmetic: signed zeros, subnormals, exact ties, cancellations."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n < 8:
        return x
    pos = rs.permutation(n)[:8]
    specials = torch.tensor([0x80000000, 0x00000000, 0x00000001, 0x80400000, 0x007FFFFF], dtype=torch.int64)
    flat[pos[:5]] = specials.to(torch.int32).view(torch.float32)
    flat[pos[5]] = flat[pos[6]] = flat[pos[7]].abs()  # a three-way tie in magnitude (trim thresholds)
    flat[pos[6]] = -flat[pos[6]]
    return x


def _delta(seed: int) -> dict[str, torch.Tensor]:
    rs = np.random.RandomState(seed)
    return {k: _with_specials(_bits(rs, s, 117, 123), rs) for k, s in SHAPES.items()}


def _lora_delta(seed: int, rank: int) -> dict[str, Any]:
    """Ready factors (A, B) for every matrix (as a LoRA trainer gives them), plain tensors for the rest."""
    rs = np.random.RandomState(seed)
    out: dict[str, Any] = {}
    for k, s in SHAPES.items():
        if len(s) == 2:
            out[k] = (_bits(rs, (rank, s[1]), 118, 124), _bits(rs, (s[0], rank), 118, 124))
        else:
            out[k] = _with_specials(_bits(rs, s, 117, 123), rs)
    return out


def _write_base(where: Path, dtype: torch.dtype) -> Path:
    rs = np.random.RandomState(1000)
    state = {k: cast(_bits(rs, s, 120, 127), dtype) for k, s in SHAPES.items()}
    state["d.pos"] = torch.arange(6, dtype=torch.int64)  # not a float: copied, never merged
    where.mkdir(parents=True)
    save_file(state, str(where / "model.safetensors"), metadata={"format": "pt"})
    (where / "config.json").write_text('{"model_type": "golden"}\n')
    return where


def _decoded_hash(f: DeltaFile, rows_per_chunk: int | None) -> str:
    h = StateDictHasher()
    for name in f.names():
        shape = f.shape(name)
        rows = shape[0] if shape else 1
        h.begin(name, torch.float32, shape)
        step = rows if rows_per_chunk is None else rows_per_chunk
        for r0 in range(0, rows, max(1, step)):
            h.update(f.rows(name, r0, min(rows, r0 + step)))
    return h.hexdigest()


def _one(values: dict[str, str], what: str) -> str:
    """The single value every variant produced (a bit-stability bug otherwise)."""
    if len(set(values.values())) != 1:
        raise AssertionError(f"{what} differs between variants of the same computation: {values}")
    return next(iter(values.values()))


@contextlib.contextmanager
def _full_tensor_elems(n: int) -> Iterator[None]:
    old = streaming.FULL_TENSOR_ELEMS
    streaming.FULL_TENSOR_ELEMS = n
    try:
        yield
    finally:
        streaming.FULL_TENSOR_ELEMS = old


def _merge(base: Path, groups: dict[str, list[tuple[Path, float]]], spec: MergeSpec, out: Path, label: str,
           **options: Any) -> str:
    """weights hash + merged-delta sha256 of one merge, the same at every chunking and thread count, with
    exact (whole-tensor) and histogram (streamed) trim thresholds."""
    got: dict[str, str] = {}
    for chunk, workers in CHUNKINGS:
        for full in (streaming.FULL_TENSOR_ELEMS, 0):
            if full == 0 and chunk != 1:
                continue  # streamed (histogram) thresholds once, at one row per chunk: the most chunks
            target = out / f"{label}-{chunk}-{workers}-{full}"
            with _full_tensor_elems(full):
                r = merge_checkpoint(base, groups, spec, target, seed=11, delta_out=target.with_suffix(".delta"),
                                     chunk_elems=chunk, workers=workers, progress=False, **options)
            assert r.delta is not None
            got[target.name] = f"{r.weights_hash}:{r.delta.sha256}"
            shutil.rmtree(target)
    return _one(got, f"merge {label}")


def compute(workdir: Path) -> dict[str, str]:
    """Every golden figure, computed under `workdir`."""
    out: dict[str, str] = {}
    base = _write_base(workdir / "base", torch.float32)
    deltas: dict[str, Path] = {}
    for i, (label, codec, params) in enumerate(CODEC_CASES):
        values = _lora_delta(100 + i, int(params["rank"])) if codec == "lora" else _delta(100 + i)
        info = encode_delta(values, workdir / f"{label}.safetensors", codec, base_hash="ab" * 32, skill="s", **params)
        deltas[label] = info.path
        out[f"file/{label}"] = info.sha256  # encoding is deterministic for every codec given LoRA factors
        with DeltaFile(info.path) as f:
            out[f"decode/{label}"] = _one({str(n): _decoded_hash(f, n) for n in (1, 2, 5, None)}, f"decode {label}")
            out[f"norm/{label}"] = _one({"info": info.norm.hex(), "rows": f.norm(chunk_elems=1).hex(),
                                         "whole": f.norm().hex()}, f"norm {label}")
    screened = screen_deltas(base, list(deltas.values()), max_norm_ratio=None)
    out["screen/norms"] = ",".join(a.norm.hex() for a in screened.accepted)
    assert not screened.rejected, screened.rejected

    groups = {"x": [(deltas["dense_fp32"], 1.0), (deltas["lora"], 0.5)],
              "y": [(deltas["topk16"], 1.0), (deltas["int8"], 2.0)],
              "z": [(deltas["dense_bf16"], 1.0), (deltas["dense_fp16"], 1.0), (deltas["topk32"], 3.0)]}
    for method in MERGE_METHODS:
        spec = MergeSpec(method, METHOD_PARAMS[method], aggregator="mean")
        out[f"merge/{method}"] = _merge(base, groups, spec, workdir, method,
                                        skill_weights={"x": 1.0, "y": 0.75, "z": 1.25})
    five = [(deltas[k], 1.0 + i / 4) for i, k in enumerate(["dense_fp32", "lora", "topk16", "int8", "dense_bf16"])]
    for agg in AGGREGATORS:
        spec = MergeSpec("task_arithmetic", {"lambda": 0.6}, aggregator=agg, trim_fraction=0.2)
        out[f"aggregate/{agg}"] = _merge(base, {"odd": five, "even": five[1:]}, spec, workdir, agg)

    bf16 = _write_base(workdir / "base-bf16", torch.bfloat16)
    spec = MergeSpec("ties", METHOD_PARAMS["ties"], aggregator="median")
    out["merge/bf16-base"] = _merge(bf16, groups, spec, workdir, "bf16", delta_codec="dense_bf16")
    out["merge/fp16-out"] = _merge(base, groups, spec, workdir, "fp16", out_dtype=torch.float16)
    r = merge_checkpoint(bf16, groups, spec, workdir / "v1", seed=11, delta_out=workdir / "v1.delta",
                         delta_codec="dense_bf16", progress=False)
    applied = {str(n): apply_delta(bf16, workdir / "v1.delta", workdir / f"applied-{n}", workers=n, progress=False).weights_hash
               for n in (1, 2)}
    out["apply/bf16"] = _one({**applied, "merge": r.weights_hash}, "apply of the merged delta")
    out["file/merged-bf16"] = sha256_file(workdir / "v1.delta")
    return out


def main() -> None:
    """Print the golden figures of this machine as JSON (with what it ran on)."""
    with tempfile.TemporaryDirectory() as d:
        figures = compute(Path(d))
    import platform

    print(json.dumps({"torch": torch.__version__, "machine": platform.machine(),
                      "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                      "figures": figures}, indent=1, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
