"""Delta codecs, one tensor at a time: how a task vector is stored, and how any row range of it is decoded.

| codec        | stored parts of tensor `w`                       | params (defaults)           |
|--------------|--------------------------------------------------|-----------------------------|
| dense_fp32   | `w` (float32)                                    |                             |
| dense_bf16   | `w` (bfloat16)                                   |                             |
| dense_fp16   | `w` (float16)                                    |                             |
| topk         | `w::idx` (sorted flat indices), `w::val`         | density 0.1, value_bits 16  |
|              | (value_bits 8: int8 `w::val`, f32 `w::vscale`)   |                             |
| int8         | `w::q` (int8, w's shape), `w::scale` (f32/row)   |                             |
| lora         | `w::A` (r x in), `w::B` (out x r); w = B @ A     | rank 16                     |

A lora delta may instead be a PEFT adapter (PEFT's tensor names and scaling; see peft_format.py), which
decodes through the same exact product. Tensors a codec cannot take (scalars and empty tensors for all,
non-matrices for lora) are stored dense float32 under their own name. A tensor's encoding is read back from the parts it has, so every file
decodes without outside knowledge. Decoding always yields float32, and any row range decodes to the same bits as
the same rows of the whole tensor on every machine (a LoRA product is ordered rank-1 updates, not a matmul:
see exact.py); encoding runs once, by the delta's author, and others check its bytes by hash.
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping, Sequence

import torch

from skillswarm.merge.exact import cast, lora_product
from skillswarm.merge.methods.sparsify import kth_largest_magnitudes
from skillswarm.merge.tensorfile import TensorFile, numel, shown
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import CODECS

DENSE_DTYPES: dict[str, torch.dtype] = {
    "dense_fp32": torch.float32, "dense_bf16": torch.bfloat16, "dense_fp16": torch.float16,
}
# A merged delta's storage where no checkpoint dtype picks one (deltas.dense_codec_for): fp32 keeps the merge's exactly.
MERGED_DELTA_CODEC = "dense_fp32"
DEFAULT_PARAMS: dict[str, dict[str, float]] = {
    "dense_fp32": {}, "dense_bf16": {}, "dense_fp16": {},
    "topk": {"density": 0.1, "value_bits": 16.0},
    "int8": {},
    "lora": {"rank": 16.0},
}
SUFFIXES = {"topk": ("::idx", "::val"), "int8": ("::q", "::scale"), "lora": ("::A", "::B")}
TOPK_VALUES = {8.0: torch.int8, 16.0: torch.bfloat16, 32.0: torch.float32}  # value_bits -> stored dtype
TOPK_SCALE = "::vscale"  # the float32 scale of a top-k tensor's 8-bit values (absent for 16 and 32 bits)
Factors = tuple[torch.Tensor, torch.Tensor]  # LoRA (A, B): delta = B @ A


def codec_params(codec: str, params: Mapping[str, float] | None = None) -> dict[str, float]:
    """The codec's parameters with defaults filled in; a clear error for an unknown codec, name or value."""
    if codec not in CODECS:
        raise MergeError(f"unknown codec {str(codec)[:64]!r}; choose one of {', '.join(CODECS)}")
    out = dict(DEFAULT_PARAMS[codec])
    for k, v in (params or {}).items():
        if k not in out:
            allowed = ", ".join(out) or "none"
            raise MergeError(f"codec {codec} has no parameter {str(k)[:64]!r} (it takes: {allowed})")
        try:
            x = float(v)
        except (TypeError, ValueError, OverflowError):  # a value from a file may be anything JSON holds
            x = math.nan
        if not math.isfinite(x):
            raise MergeError(f"codec {codec} parameter {k} must be a finite number, got {str(v)[:64]!r}")
        out[k] = x
    if codec == "topk" and not (0.0 < out["density"] <= 1.0):
        raise MergeError(f"topk density must be in (0, 1], got {out['density']}")
    if codec == "topk" and out["value_bits"] not in (8.0, 16.0, 32.0):
        raise MergeError(f"topk value_bits must be 8 (int8 with a scale per tensor), 16 (bfloat16) or 32 (float32), "
                         f"got {out['value_bits']:g}")
    if codec == "lora" and (out["rank"] < 1 or out["rank"] != int(out["rank"])):
        raise MergeError(f"lora rank must be a positive integer, got {out['rank']:g}")
    return out


def tensor_kind(codec: str, shape: Sequence[int]) -> str:
    """How `codec` stores a tensor of this shape: "dense", "topk", "int8" or "lora"."""
    if codec in DENSE_DTYPES or numel(shape) == 0 or not shape:
        return "dense"
    if codec == "lora" and len(shape) != 2:
        return "dense"
    return codec


def topk_count(n: int, density: float) -> int:
    """Entries a top-k encoding keeps: floor(density * n), at least one."""
    return min(n, max(1, int(density * n))) if n else 0


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def part_layout(codec: str, name: str, shape: Sequence[int], params: Mapping[str, float],
                lora_rank: int | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The stored parts (name, dtype, shape) of one tensor, known before encoding so headers come first."""
    shape = tuple(shape)
    kind = tensor_kind(codec, shape)
    if kind == "dense":
        return [(name, DENSE_DTYPES.get(codec, torch.float32), shape)]
    if kind == "topk":
        k = topk_count(numel(shape), params["density"])
        parts = [(name + "::idx", _index_dtype(numel(shape)), (k,)), (name + "::val", TOPK_VALUES[params["value_bits"]], (k,))]
        return parts + ([(name + TOPK_SCALE, torch.float32, (1,))] if params["value_bits"] == 8 else [])
    if kind == "int8":
        return [(name + "::q", torch.int8, shape), (name + "::scale", torch.float32, (_int8_rows(shape),))]
    r = lora_rank if lora_rank is not None else min(int(params["rank"]), *shape)
    return [(name + "::A", torch.float32, (r, shape[1])), (name + "::B", torch.float32, (shape[0], r))]


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: q = round(x / s) with s = max|x| / 127 (1 for an all-zero row); x ~= q * s."""
    scale = rows.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def _int8_rows(shape: Sequence[int]) -> int:
    """int8 keeps one scale per row of a matrix (or higher), one scale for a vector."""
    return shape[0] if len(shape) >= 2 else 1


def magnitude_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted flat indices of the k largest |x|; ties at the threshold go to the lowest indices, so the
    choice is exact and the same on every machine."""
    a = x.reshape(-1).abs()
    if k >= a.numel():
        return torch.arange(a.numel())
    t = kth_largest_magnitudes(a, [k])[0]
    above = torch.nonzero(a > t).reshape(-1)
    at = torch.nonzero(a == t).reshape(-1)[: k - above.numel()]
    return torch.sort(torch.cat([above, at])).values


def lora_factors(x: torch.Tensor, rank: int) -> Factors:
    """Rank-`rank` factors (A, B) of a matrix with B @ A ~= x: exact SVD for small matrices, seeded randomized
    SVD for large ones (the seed makes encoding deterministic)."""
    m, n = x.shape
    r = min(rank, m, n)
    if min(m, n) <= 4 * (r + 8):
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        u, s, v = u[:, :r], s[:r], vh[:r].T
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            u, s, v = torch.svd_lowrank(x, q=r + 8, niter=4)
        u, s, v = u[:, :r], s[:r], v[:, :r]
    root = s.sqrt()
    return (root[:, None] * v.T).contiguous(), (u * root[None, :]).contiguous()


def encode_tensor(codec: str, name: str, x: torch.Tensor | Factors, params: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Stored parts of one delta tensor (float32 in; LoRA also takes ready factors (A, B))."""
    if isinstance(x, tuple):
        if codec != "lora":
            raise MergeError(f"`{name}`: LoRA factors (A, B) can only be stored with the lora codec, not {codec}")
        a, b = (t.detach().to(torch.float32).contiguous() for t in x)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise MergeError(f"`{name}`: LoRA factors need A (r x in) and B (out x r), got {list(a.shape)}, {list(b.shape)}")
        return {name + "::A": a, name + "::B": b}
    x = x.detach().to(torch.float32)
    kind = tensor_kind(codec, x.shape)
    if kind == "dense":
        return {name: cast(x, DENSE_DTYPES.get(codec, torch.float32)).contiguous()}
    if kind == "topk":
        idx = magnitude_topk_indices(x, topk_count(x.numel(), params["density"]))
        values = x.reshape(-1)[idx]
        if params["value_bits"] == 8:
            q, scale = _quantize(values.reshape(1, -1))
            return {name + "::idx": idx.to(_index_dtype(x.numel())), name + "::val": q.reshape(-1), name + TOPK_SCALE: scale}
        return {name + "::idx": idx.to(_index_dtype(x.numel())), name + "::val": cast(values, TOPK_VALUES[params["value_bits"]])}
    if kind == "int8":
        q, scale = _quantize(x.reshape(_int8_rows(x.shape), -1))
        return {name + "::q": q.reshape(x.shape), name + "::scale": scale}
    a, b = lora_factors(x, int(params["rank"]))
    return {name + "::A": a, name + "::B": b}


def stored_kind(f: TensorFile, name: str) -> str:
    """The encoding of tensor `name` in a delta file, read from which parts exist."""
    if name in f:
        return "dense"
    for kind, (p0, p1) in SUFFIXES.items():
        if name + p0 in f and name + p1 in f:
            return kind
    raise MergeError(f"{f.path}: tensor `{shown(name)}` has no complete stored parts")


class _FlatIndex(Sequence[int]):
    """A sorted index part seen as a sequence, each item one positioned read (for bisect)."""

    def __init__(self, f: TensorFile, part: str) -> None:
        self.f, self.part, self.n = f, part, numel(f.entry(part).shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return int(self.f.read_flat(self.part, i, i + 1)[0])


def decode_parts(kind: str, parts: Mapping[str, torch.Tensor], shape: Sequence[int], flat_offset: int = 0) -> torch.Tensor:
    """Materialize a (row range of a) tensor as float32 from its parts, keyed by suffix ("", "::idx", ...).
    For topk, `parts` hold the entries of the range and `flat_offset` is the range's first flat index."""
    shape = tuple(shape)
    if kind == "dense":
        return parts[""].to(torch.float32).reshape(shape)
    if kind == "topk":
        out = torch.zeros(numel(shape), dtype=torch.float32)
        values = parts["::val"].to(torch.float32)
        if TOPK_SCALE in parts:  # 8-bit values: one float32 multiply each, exact rounding on every machine
            values = values * parts[TOPK_SCALE].to(torch.float32)
        index = parts["::idx"].to(torch.int64) - flat_offset
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= out.numel()):
            raise MergeError("top-k indices out of order or out of range; the file is corrupt")
        out[index] = values
        return out.reshape(shape)
    if kind == "int8":
        q, scale = parts["::q"].to(torch.float32), parts["::scale"].to(torch.float32)
        if len(shape) >= 2:
            return (q.reshape(shape[0], -1) * scale[:, None]).reshape(shape)
        return (q * scale[0]).reshape(shape)
    return lora_product(parts["::B"], parts["::A"]).reshape(shape)


def decode_rows(f: TensorFile, name: str, kind: str, shape: Sequence[int], r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) (dim 0) of a stored delta tensor, materialized as float32 (reads only those rows)."""
    shape = tuple(shape)
    rows_shape = (r1 - r0, *shape[1:]) if shape else ()
    if kind == "dense":
        return decode_parts(kind, {"": f.read_rows(name, r0, r1)}, rows_shape)
    if kind == "topk":
        per_row = numel(shape[1:])
        lo_el, hi_el = r0 * per_row, r1 * per_row
        index = _FlatIndex(f, name + "::idx")
        lo, hi = bisect.bisect_left(index, lo_el), bisect.bisect_left(index, hi_el)
        parts = {"::idx": f.read_flat(name + "::idx", lo, hi), "::val": f.read_flat(name + "::val", lo, hi)}
        if name + TOPK_SCALE in f:
            parts[TOPK_SCALE] = f.read(name + TOPK_SCALE)
        return decode_parts(kind, parts, rows_shape, lo_el)
    if kind == "int8":
        scale = f.read_rows(name + "::scale", r0, r1) if len(shape) >= 2 else f.read(name + "::scale")
        return decode_parts(kind, {"::q": f.read_rows(name + "::q", r0, r1), "::scale": scale}, rows_shape)
    return decode_parts(kind, {"::B": f.read_rows(name + "::B", r0, r1), "::A": f.read(name + "::A")}, rows_shape)
