"""Delta files: a task vector (trained - base) stored as one safetensors file that describes itself.

`__metadata__` holds `format` ("skillswarm-delta"), `format_version`, `codec`, `codec_params` (JSON),
`tensors` (JSON: name -> [dtype of the weight it applies to, or "", shape]) and, when known, `base_hash`
and `skill`. Tensors a delta leaves out are zero (a LoRA delta holds only its target matrices). A LoRA delta
in PEFT's format (version 2, `peft_config` metadata: see peft_format.py) is also a PEFT adapter_model.safetensors.

The trainer publishes with `compute_delta` (two model directories, streamed tensor by tensor) or
`encode_delta` (a state dict of deltas, or LoRA factors, already in memory); the coordinator and the
merge read with `read_delta`, which decodes any row range on demand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.codecs import (DENSE_DTYPES, MERGED_DELTA_CODEC, SUFFIXES, TOPK_SCALE, Factors, codec_params,
                                     decode_parts, decode_rows, encode_tensor, part_layout, stored_kind, tensor_kind)
from skillswarm.merge.exact import SquareSum
from skillswarm.merge import peft_format
from skillswarm.merge.progress import progress_bar
from skillswarm.merge.tensorfile import (DTYPES, MAX_DIM, MAX_DIMS, TensorFile, TensorFileWriter, dtype_name, is_int,
                                         numel, parse_json, row_chunks, shown)
from skillswarm.protocol.atomic import atomic_open
from skillswarm.protocol.errors import MergeError

FORMAT = "skillswarm-delta"
FORMAT_VERSION = "1"
READ_VERSIONS = (FORMAT_VERSION, peft_format.FORMAT_VERSION)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class DeltaInfo:
    """What encoding a delta produced: the fields a DeltaManifest needs (blob = sha256), and how exact it is."""

    path: Path
    sha256: str
    size: int
    codec: str
    params: dict[str, float]
    norm: float  # L2 norm of the delta as decoded (what a merge will use)
    num_tensors: int
    error: float | None = None  # ||x - decode(encode(x))|| / ||x||; None when LoRA factors came ready-made
    base_hash: str | None = None
    skill: str | None = None


@dataclass(frozen=True)
class DeltaTensor:
    """One tensor a delta file declares: the weight's dtype (may be ""), shape, and how it is stored."""

    dtype: str
    shape: tuple[int, ...]
    kind: str
    peft: peft_format.PeftParts | None = None  # where its factors lie in a PEFT-format file


class DeltaFile:
    """A delta file opened for reading; tensors are materialized (float32) per tensor or per row range."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.file = TensorFile(self.path)
        try:
            self._parse()
        except BaseException:
            self.file.close()
            raise

    def _parse(self) -> None:
        md, where = self.file.metadata, str(self.path)
        if md.get("format") != FORMAT:
            raise MergeError(f"{where} is not a skillswarm delta (no `format: {FORMAT}` metadata); make one with "
                             "`skillswarm merge delta` or skillswarm.merge.encode_delta")
        if md.get("format_version") not in READ_VERSIONS:
            version = (md.get("format_version") or "")[:32]
            raise MergeError(f"{where} is delta format version {version!r}; this build reads versions "
                             f"{', '.join(READ_VERSIONS)} (upgrade skillswarm)")
        if "tensors" not in md:
            raise MergeError(f"{where}: `codec_params` / `tensors` metadata is missing or not a JSON object")
        params = parse_json(md.get("codec_params", "{}"), f"{where}: its `codec_params` metadata")
        declared = parse_json(md["tensors"], f"{where}: its `tensors` metadata")
        if not isinstance(params, dict) or not isinstance(declared, dict):
            raise MergeError(f"{where}: `codec_params` / `tensors` metadata is missing or not a JSON object")
        self.codec = md.get("codec", "")
        self.params = codec_params(self.codec, params)
        self.base_hash: str | None = md.get("base_hash") or None
        self.skill: str | None = md.get("skill") or None
        self.peft_config: dict | None = self._peft_config(md)
        self.tensors: dict[str, DeltaTensor] = {}
        used: set[str] = set()
        for name, spec in sorted(declared.items()):
            if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], list)
                    and len(spec[1]) <= MAX_DIMS and all(is_int(d) and 0 <= d <= MAX_DIM for d in spec[1])):
                raise MergeError(f"{where}: tensor `{shown(name)}` is declared as {shown(str(spec))}, expected "
                                 "[dtype, shape] (a shape of non-negative integers)")
            dtype, shape = spec[0], tuple(spec[1])
            if dtype and dtype not in DTYPES:
                raise MergeError(f"{where}: tensor `{shown(name)}` declares unknown dtype {dtype[:32]!r}")
            if self.peft_config is not None:
                parts_at = peft_format.locate(self.file, self.peft_config, name, shape)
                used.update((parts_at.a, parts_at.b))
                self.tensors[name] = DeltaTensor(dtype, shape, "lora", parts_at)
                continue
            kind = stored_kind(self.file, name)
            parts = [name] if kind == "dense" else [name + s for s in SUFFIXES[kind]]
            if kind == "topk" and name + TOPK_SCALE in self.file:
                parts.append(name + TOPK_SCALE)
            self._check_parts(name, kind, shape)
            used.update(parts)
            self.tensors[name] = DeltaTensor(dtype, shape, kind)
        stray = sorted(set(self.file.keys()) - used)
        if stray:
            raise MergeError(f"{where}: stored tensors {[shown(n, 100) for n in stray[:5]]} belong to no declared "
                             "tensor; the file is corrupt")

    def _peft_config(self, md: dict[str, str]) -> dict | None:
        """The adapter config of a PEFT-format file (version 2, lora codec only), else None."""
        if md.get("format_version") != peft_format.FORMAT_VERSION:
            return None
        raw = md.get("peft_config")
        config = None if raw is None else parse_json(raw, f"{self.path}: its `peft_config` metadata")
        if not isinstance(config, dict):
            raise MergeError(f"{self.path}: a version {peft_format.FORMAT_VERSION} delta needs `peft_config` "
                             "metadata holding its adapter_config.json; the file is corrupt")
        if self.codec != "lora":
            raise MergeError(f"{self.path}: a PEFT adapter is a lora delta, but the file says codec {self.codec!r}")
        peft_format.check_config(config, str(self.path))
        return config

    def _check_parts(self, name: str, kind: str, shape: tuple[int, ...]) -> None:
        e = self.file.entry
        bad = f"{self.path}: tensor `{shown(name)}` ({kind}, shape {list(shape)})"
        if kind == "dense":
            want = DENSE_DTYPES.get(self.codec, torch.float32) if tensor_kind(self.codec, shape) == "dense" else None
            if e(name).shape != shape or e(name).dtype not in FLOAT_DTYPES or (want and e(name).dtype != want):
                raise MergeError(f"{bad} is stored as {e(name).dtype} {list(e(name).shape)}; the {self.codec} codec "
                                 f"stores {want or 'float'} of the declared shape")
        elif kind == "topk":
            i, v = e(name + "::idx"), e(name + "::val")
            scaled = name + TOPK_SCALE in self.file
            if (len(i.shape) != 1 or i.shape != v.shape or i.dtype not in (torch.int32, torch.int64)
                    or v.dtype not in ((torch.int8,) if scaled else FLOAT_DTYPES) or i.shape[0] > numel(shape)
                    or (scaled and (e(name + TOPK_SCALE).shape != (1,) or e(name + TOPK_SCALE).dtype != torch.float32))):
                raise MergeError(f"{bad}: top-k parts must be 1-D int indices and values of equal length: float values, "
                                 "or int8 values with one float32 scale")
        elif kind == "int8":
            q, s = e(name + "::q"), e(name + "::scale")
            rows = shape[0] if len(shape) >= 2 else 1
            if q.shape != shape or q.dtype != torch.int8 or s.shape != (rows,) or s.dtype != torch.float32:
                raise MergeError(f"{bad}: int8 parts must be int8 {list(shape)} and float32 scales [{rows}]")
        else:
            a, b = e(name + "::A"), e(name + "::B")
            if (len(shape) != 2 or len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != shape[1]
                    or b.shape[0] != shape[0] or a.shape[0] != b.shape[1] or a.dtype not in FLOAT_DTYPES
                    or b.dtype not in FLOAT_DTYPES):
                raise MergeError(f"{bad}: LoRA parts must be A [r, {shape[1] if shape[1:] else '?'}] and B [{shape[0] if shape else '?'}, r]")

    def names(self) -> list[str]:
        """Declared tensor names, sorted."""
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`."""
        return self.tensors[name].shape

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor | None:
        """Rows [r0, r1) of tensor `name` as float32, or None if this delta leaves the tensor out (zero)."""
        t = self.tensors.get(name)
        return None if t is None else self._decode(name, t, r0, r1)

    def _decode(self, name: str, t: DeltaTensor, r0: int, r1: int) -> torch.Tensor:
        if t.peft is not None:
            return peft_format.decode_rows(self.file, t.peft, t.shape, r0, r1)
        return decode_rows(self.file, name, t.kind, t.shape, r0, r1)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32, whole."""
        if name not in self.tensors:
            raise MergeError(f"{self.path} has no tensor `{name}`")
        t = self.tensors[name]
        return self._decode(name, t, 0, t.shape[0] if t.shape else 1)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 tensor) for every declared tensor, one materialized at a time."""
        for name in self.tensors:
            yield name, self.get(name)

    def norm(self, chunk_elems: int = 1 << 22) -> float:
        """L2 norm of the whole delta as decoded (streamed by row chunks; exact, so any chunking agrees)."""
        total = SquareSum()
        for name, t in self.tensors.items():
            for r0, r1 in row_chunks(t.shape, chunk_elems):
                total.add(self.rows(name, r0, r1))
        return total.norm()

    def close(self) -> None:
        """Release the file."""
        self.file.close()

    def __enter__(self) -> "DeltaFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dense_codec_for(model_dir: Path | str) -> str:
    """The dense codec in a checkpoint's own float dtype, so that applying a merged delta stored with it is
    bit-exact (a bf16 checkpoint gets a bf16 merged delta)."""
    ckpt = Checkpoint(model_dir)
    try:
        dtypes = {ckpt.entry(n).dtype for n in ckpt.names()} & set(FLOAT_DTYPES)
    finally:
        ckpt.close()
    for codec, dtype in DENSE_DTYPES.items():
        if dtypes == {dtype}:
            return codec
    return MERGED_DELTA_CODEC


BYTES_PER_PARAM = 12  # the most any codec stores per weight: top-k at density 1 (int64 index + fp32 value)
HEADER_BYTES = 1 << 20  # a delta file's header (names, shapes, metadata) stays far below this


def max_delta_bytes(base_dir: Path | str) -> int:
    """The most bytes a delta of this model can take, whatever its codec (a bound for downloads)."""
    ckpt = Checkpoint(base_dir)
    try:
        params = sum(numel(ckpt.entry(n).shape) for n in ckpt.names() if ckpt.entry(n).dtype in FLOAT_DTYPES)
    finally:
        ckpt.close()
    return params * BYTES_PER_PARAM + HEADER_BYTES


def read_delta(path: Path | str) -> DeltaFile:
    """Open and validate a delta file (MergeError saying what is wrong otherwise)."""
    return DeltaFile(path)


def delta_metadata(codec: str, params: Mapping[str, float], declared: Mapping[str, list], base_hash: str | None,
              skill: str | None, peft_config: Mapping | None = None) -> dict[str, str]:
    md = {"format": FORMAT, "format_version": FORMAT_VERSION, "codec": codec,
          "codec_params": json.dumps(dict(params), sort_keys=True), "tensors": json.dumps(dict(declared), sort_keys=True)}
    if peft_config is not None:
        md["format_version"] = peft_format.FORMAT_VERSION
        md["peft_config"] = json.dumps(dict(peft_config), sort_keys=True)
    if base_hash:
        md["base_hash"] = base_hash
    if skill:
        md["skill"] = skill
    return md


class _DeltaWriter:
    """Encodes tensors one at a time into an open file whose layout was declared up front. With `peft_config`
    (lora only) the factors take PEFT's names and scaling: the file is a PEFT adapter (peft_format.py)."""

    def __init__(self, f, codec: str, params: dict[str, float], specs: list[tuple[str, str, tuple[int, ...], int | None]],
                 base_hash: str | None, skill: str | None, peft_config: Mapping | None = None) -> None:
        self.codec, self.params, self.peft_config = codec, params, peft_config
        self.rename: dict[str, str] = {}
        layout, declared = [], {}
        for name, dtype, shape, rank in specs:
            parts = part_layout(codec, name, shape, params, rank)
            if peft_config is not None:
                if tensor_kind(codec, shape) != "lora":
                    raise MergeError(f"`{name}` {list(shape)}: a PEFT adapter holds only LoRA factors of matrices")
                a_name, b_name = peft_format.part_names(name)
                self.rename.update({name + "::A": a_name, name + "::B": b_name})
                parts = [(self.rename[p], d, s) for p, d, s in parts]
            layout += parts
            declared[name] = [dtype, list(shape)]
        self.layout = {n: (d, s) for n, d, s in layout}
        self.w = TensorFileWriter(f, layout, delta_metadata(codec, params, declared, base_hash, skill, peft_config))
        self.sq_norm = SquareSum()
        self.sq_err = self.sq_ref = 0.0
        self.exact = True

    def add(self, name: str, x: torch.Tensor | Factors, shape: tuple[int, ...]) -> None:
        parts = encode_tensor(self.codec, name, x, self.params)
        for part, t in parts.items():
            stored = self.rename.get(part, part)
            if (t.dtype, tuple(t.shape)) != self.layout[stored]:
                raise MergeError(f"`{name}`: encoded part {stored} is {t.dtype} {list(t.shape)}, "
                                 f"expected {self.layout[stored][0]} {list(self.layout[stored][1])}")
            self.w.write(stored, t)
        kind = tensor_kind(self.codec, shape) if not isinstance(x, tuple) else "lora"
        decoded_parts = {p[len(name):]: t for p, t in parts.items()}
        if self.peft_config is not None:  # PEFT's scaling, applied to B as the reader does
            scale = peft_format.scaling(self.peft_config, peft_format.module_of(name))[1]
            decoded_parts["::B"] = peft_format.scaled(decoded_parts["::B"], scale)
        decoded = decode_parts(kind, decoded_parts, shape)
        self.sq_norm.add(decoded)
        if isinstance(x, tuple):
            self.exact = False
        else:
            ref = x.detach().to(torch.float32)
            self.sq_ref += float(torch.linalg.vector_norm(ref)) ** 2
            if not (kind == "dense" and parts[name].dtype == torch.float32):
                self.sq_err += float(torch.linalg.vector_norm(ref - decoded)) ** 2

    def leave_out(self, x: torch.Tensor) -> None:
        """Count a tensor the file does not hold (zero delta) in the reconstruction error."""
        sq = float(torch.linalg.vector_norm(x.detach().to(torch.float32))) ** 2
        self.sq_ref += sq
        self.sq_err += sq

    def info(self, path: Path, n: int, base_hash: str | None, skill: str | None) -> DeltaInfo:
        sha, size = self.w.close()
        err = math.sqrt(self.sq_err / self.sq_ref) if self.exact and self.sq_ref > 0 else (0.0 if self.exact else None)
        return DeltaInfo(path=path, sha256=sha, size=size, codec=self.codec, params=dict(self.params),
                         norm=self.sq_norm.norm(), num_tensors=n, error=err, base_hash=base_hash, skill=skill)


def encode_delta(delta: Mapping[str, torch.Tensor | Factors] | tuple[Path | str, Path | str], out_path: Path | str,
                 codec: str, *, base_hash: str | None = None, skill: str | None = None,
                 dtypes: Mapping[str, torch.dtype] | None = None, progress: bool = False,
                 peft_config: Mapping | None = None, **params: float) -> DeltaInfo:
    """Encode a delta with `codec` into `out_path` (written atomically) and describe the result.

    `delta` is a state dict of deltas (trained - base, any float dtype; with codec "lora" a value may also
    be ready factors (A, B) meaning B @ A), or a pair (tuned_dir, base_dir) that is streamed through
    `compute_delta`. `dtypes` names the dtype of the weights each delta applies to (recorded so screening
    can check it against the base); `params` are the codec's (density=, value_bits= for topk, rank= for lora).
    `peft_config` (lora, factors only): write a PEFT adapter, the factors as PEFT stores them (B unscaled) and
    this adapter_config.json in the metadata; the delta is then (B * scaling) @ A, as PEFT applies it.
    """
    if isinstance(delta, tuple):
        tuned_dir, base_dir = delta
        return compute_delta(base_dir, tuned_dir, out_path, codec, base_hash=base_hash, skill=skill,
                             progress=progress, **params)
    p = codec_params(codec, params)
    if not delta:
        raise MergeError("the delta is empty; nothing to encode")
    if peft_config is not None:
        peft_config = _writable_peft_config(codec, peft_config, delta)
    specs, shapes = [], {}
    for name in sorted(delta):
        x = delta[name]
        if isinstance(x, tuple):
            shape, rank = (int(x[1].shape[0]), int(x[0].shape[1])), int(x[0].shape[0])
        else:
            if not torch.is_floating_point(x):
                raise MergeError(f"delta tensor `{name}` is {x.dtype}; deltas are floating point")
            if not bool(torch.isfinite(x).all()):
                raise MergeError(f"delta tensor `{name}` has NaN or inf values; refusing to encode a broken delta")
            shape, rank = tuple(x.shape), None
        dt = dtype_name(dtypes[name]) if dtypes and name in dtypes else ""
        specs.append((name, dt, shape, rank))
        shapes[name] = shape
    with atomic_open(out_path, "wb") as f:
        w = _DeltaWriter(f, codec, p, specs, base_hash, skill, peft_config)
        with progress_bar(len(specs), "encoding delta", enabled=progress) as advance:
            for name in shapes:
                w.add(name, delta[name], shapes[name])
                advance()
        info = w.info(Path(out_path), len(specs), base_hash, skill)
    return info


def _writable_peft_config(codec: str, config: Mapping, delta: Mapping[str, Any]) -> dict:
    """A PEFT config the writer can honour: lora codec, ready factors only, no fan_in_fan_out layout."""
    config = peft_format.json_config(config)
    peft_format.check_config(config, "the adapter config")
    if codec != "lora" or not all(isinstance(x, tuple) for x in delta.values()):
        raise MergeError("a PEFT adapter is written from LoRA factors (A, B) with the lora codec")
    if config.get("fan_in_fan_out"):
        raise MergeError("writing fan_in_fan_out (Conv1D) adapters is not supported; merge them as dense deltas")
    return config


def compute_delta(base_dir: Path | str, tuned_dir: Path | str, out_path: Path | str, codec: str, *,
                  base_hash: str | None = None, skill: str | None = None, progress: bool = False,
                  adapter_targets: Sequence[str] | None = None, **params: float) -> DeltaInfo:
    """delta = tuned - base for every floating-point weight, streamed one tensor at a time into `out_path`
    (atomically). Both directories must hold the same tensor names and shapes.

    `adapter_targets` (lora codec): write a PEFT adapter (peft_format.py) holding rank-`rank` SVD factors of
    these weights only (the weight matrices of linear layers); every other weight stays the base's, and its
    change counts in the reconstruction error."""
    p = codec_params(codec, params)
    if adapter_targets is not None and codec != "lora":
        raise MergeError(f"a PEFT adapter is a lora delta; codec {codec} cannot write one")
    base, tuned = Checkpoint(base_dir), Checkpoint(tuned_dir)
    try:
        names = base.names()
        if tuned.names() != names:
            only_b, only_t = sorted(set(names) - set(tuned.names())), sorted(set(tuned.names()) - set(names))
            raise MergeError(f"{tuned_dir} and {base_dir} hold different tensors (only in base: {only_b[:3]}, "
                             f"only in tuned: {only_t[:3]}); a delta needs the same architecture")
        specs = []
        for name in names:
            b, t = base.entry(name), tuned.entry(name)
            if b.shape != t.shape:
                raise MergeError(f"`{name}` is {list(t.shape)} in {tuned_dir} but {list(b.shape)} in the base")
            if torch.is_floating_point(torch.empty(0, dtype=b.dtype)):
                specs.append((name, dtype_name(b.dtype), b.shape, None))
        left_out: list[str] = []
        config = None
        if adapter_targets is not None:
            targets = set(adapter_targets)
            unknown = sorted(targets - {s[0] for s in specs if len(s[2]) == 2})
            if unknown:
                raise MergeError(f"adapter targets {unknown[:3]} are not weight matrices of {base_dir}")
            left_out = [s[0] for s in specs if s[0] not in targets]
            specs = [s for s in specs if s[0] in targets]
            if not specs:
                raise MergeError(f"{base_dir} has no weight matrix to put a LoRA adapter on")
            config = peft_format.adapter_config({s[0]: min(int(p["rank"]), *s[2]) for s in specs})
        with atomic_open(out_path, "wb") as f:
            w = _DeltaWriter(f, codec, p, specs, base_hash, skill, config)
            for name in left_out:  # an adapter leaves them at the base's value: all of their change is error
                x = tuned.read(name).to(torch.float32) - base.read(name).to(torch.float32)
                w.leave_out(x)
            with progress_bar(len(specs), "computing delta", enabled=progress) as advance:
                for name, _, shape, _ in specs:
                    x = tuned.read(name).to(torch.float32) - base.read(name).to(torch.float32)
                    if not bool(torch.isfinite(x).all()):
                        raise MergeError(f"`{name}` of {tuned_dir} has NaN or inf values; refusing to encode")
                    w.add(name, x, shape)
                    advance()
            return w.info(Path(out_path), len(specs), base_hash, skill)
    finally:
        base.close()
        tuned.close()
