"""The streaming merge: N deltas (or N fine-tuned models) and a base in, a sharded checkpoint out.

Two levels, as a coordinator merges a round: the deltas of each skill are first combined by an
intra-skill aggregator (aggregate.py) into one task vector per skill, then the skills' task vectors are
merged by the network's method (methods/). A plain N-delta merge is the special case of one delta per
group. Everything runs per tensor, per row chunk, through `pipeline.run_pipeline`; whole-tensor statistics
(trim thresholds, clipping norms) are computed first by streaming passes over the chunks, so the result is
the same as merging whole tensors, and memory stays a few chunks per input.

Determinism: tensors in sorted order, fixed summation order, exact thresholds and norms, DARE masks keyed
by (seed, tensor, group key), only elementwise IEEE operations on the values (exact.py): the same inputs give
byte-identical files and the same weights hash on any CPU, with any chunk size or thread count.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from skillswarm.merge.aggregate import aggregate
from skillswarm.merge.checkpoint import DEFAULT_SHARD_BYTES, Checkpoint
from skillswarm.merge.codecs import DENSE_DTYPES, MERGED_DELTA_CODEC
from skillswarm.merge.deltas import DeltaFile
from skillswarm.merge.exact import SquareSum, cast
from skillswarm.merge.methods import Method, get_method
from skillswarm.merge.methods.base import check_params, densities_for, input_limits, merge_chunk, needs_limits
from skillswarm.merge.methods.model_stock import model_stock_rows, model_stock_stats, model_stock_t
from skillswarm.merge.methods.slerp import slerp_coefficients, slerp_rows, slerp_stats
from skillswarm.merge.methods.sparsify import rng_key
from skillswarm.merge.pipeline import CHUNK_ELEMS, MergeResult, apply_rows, check_delta_fits, is_float, run_pipeline
from skillswarm.merge.recipe_params import in_first_layers
from skillswarm.merge.tensorfile import numel
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import AGGREGATORS, MergePolicy

FULL_TENSOR_ELEMS = 1 << 26  # up to this size (256 MiB of float32) thresholds come from the whole tensor at
# once (fast exact selection); beyond it, from two histogram passes over its chunks (flat memory)


@dataclass(frozen=True)
class MergeSpec:
    """How to merge: the method and its parameters (density, lambda/scale, normalize, gamma), and the
    intra-skill aggregator with its trim fraction."""

    method: str = "ties"
    params: Mapping[str, Any] = field(default_factory=dict)
    aggregator: str = "mean"
    trim_fraction: float = 0.1

    @classmethod
    def from_policy(cls, policy: MergePolicy) -> "MergeSpec":
        """The spec a network's MergePolicy describes."""
        m = get_method(policy.method)
        params: dict[str, Any] = {"scale": policy.scale}
        if "density" in m.params.__dataclass_fields__:
            params["density"] = policy.density
        return cls(policy.method, params, policy.aggregator, policy.trim_fraction)

    def resolve(self) -> tuple[Method, Any]:
        """The method entry and its checked parameter struct."""
        if self.aggregator not in AGGREGATORS:
            raise MergeError(f"unknown aggregator {self.aggregator!r}; choose one of {', '.join(AGGREGATORS)}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise MergeError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        m = get_method(self.method)
        return m, m.make_params(self.params)


@dataclass(frozen=True)
class MergeInput:
    """One input of a plain merge: a delta file or a fine-tuned model directory, its weight in the
    method, and optionally its own density (as in a mergekit recipe)."""

    path: Path | str
    weight: float = 1.0
    density: float | None = None


class _ModelDelta:
    """A fine-tuned model seen as a delta: rows of (tuned - base), in float32."""

    def __init__(self, tuned: Checkpoint, base: Checkpoint) -> None:
        self.tuned, self.base, self.path = tuned, base, tuned.dir

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        return self.tuned.read_rows(name, r0, r1).to(torch.float32) - self.base.read_rows(name, r0, r1).to(torch.float32)

    def close(self) -> None:
        self.tuned.close()


class _FirstLayers:
    """A source seen through its first `layers` decoder layers: every other tensor reads as unchanged (no rows),
    so in TIES it neither votes nor dilutes, and the merge there is that of the other groups alone."""

    def __init__(self, src: Any, layers: int) -> None:
        self.src, self.layers, self.path = src, layers, src.path

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor | None:
        return self.src.rows(name, r0, r1) if in_first_layers(name, self.layers) else None

    def close(self) -> None:
        self.src.close()


@dataclass
class _Group:
    """What enters the cross-input method once: a skill's deltas (aggregated) or one input."""

    key: str
    sources: list[Any]
    weights: list[float]
    weight: float
    density: float


@dataclass
class _Prep:
    norms: list[list[float]] | None  # per group, per source: whole-tensor norms (clipped_mean)
    limits: list[Any]  # per group: trim thresholds / DELLA limits; slerp / model_stock: their coefficients


@dataclass(frozen=True)
class TensorParams:
    """One tensor's parameters when they vary by tensor (a recipe's gradients and filters): the method's
    shared ones (lambda, normalize, t, ...) and, per input in order, weight / density / gamma / epsilon."""

    shared: Mapping[str, Any]
    inputs: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class _Resolved:
    params: Any  # the method's parameter struct (lambda, normalize, ...)
    weights: list[float]
    densities: list[float]
    inputs: list[Any]  # per input: the struct with its own density / gamma / epsilon


PER_INPUT = ("density", "gamma", "epsilon")


class _MergeEngine:
    """Per row chunk: aggregate each group, sparsify and combine across groups, add to the base (or, for
    slerp and model_stock, interpolate between the base and the models with per-tensor coefficients)."""

    def __init__(self, base: Checkpoint, groups: list[_Group], spec: MergeSpec, seed: int,
                 delta_codec: str, out_dtype: torch.dtype | None, chunk_elems: int,
                 tensor_params: Callable[[str], TensorParams] | None = None) -> None:
        self.base, self.groups, self.seed, self.chunk_elems = base, groups, seed, chunk_elems
        self.method, self.params = spec.resolve()
        self.aggregator, self.trim = spec.aggregator, spec.trim_fraction
        self._delta = DENSE_DTYPES[delta_codec]
        self._out = out_dtype
        self._tensor_params = tensor_params
        self._cache: dict[str, _Resolved] = {}
        if self.method.kind != "gta" and any(len(g.sources) != 1 for g in groups):
            raise MergeError(f"{self.method.name} merges models, not groups of deltas: give one input per group")
        if self.method.kind == "slerp" and len(groups) != 1:
            raise MergeError(f"slerp interpolates between the base and exactly one other model, got {len(groups)}")
        if self.method.kind == "model_stock" and len(groups) < 2:
            raise MergeError(f"model_stock needs at least two models besides the base, got {len(groups)}")
        densities = densities_for(self.params, len(groups), [g.density for g in groups])
        self._static = _Resolved(self.params, [g.weight for g in groups], densities,
                                 [check_params(self._input_struct(self.params, {"density": d}), self.method.name)
                                  for d in densities])

    def _input_struct(self, p: Any, own: Mapping[str, Any]) -> Any:
        fields = p.__dataclass_fields__
        return dataclasses.replace(p, **{k: v for k, v in own.items() if k in fields}) if own else p

    def resolved(self, name: str) -> _Resolved:
        """The parameters of tensor `name` (the same for every tensor unless the merge has tensor_params)."""
        if self._tensor_params is None:
            return self._static
        r = self._cache.get(name)
        if r is None:
            tp = self._tensor_params(name)
            p = self.method.make_params(tp.shared)
            own = [{k: v for k, v in tp.inputs[i].items() if k in PER_INPUT} for i in range(len(self.groups))]
            ps = [check_params(self._input_struct(p, o), self.method.name) for o in own]
            weights = [float(tp.inputs[i].get("weight", g.weight)) for i, g in enumerate(self.groups)]
            r = _Resolved(p, weights, [float(getattr(q, "density", 1.0)) for q in ps], ps)
            self._cache[name] = r
        return r

    def out_dtype(self, name: str) -> torch.dtype:
        dtype = self.base.entry(name).dtype
        return self._out if self._out is not None and is_float(dtype) else dtype

    def delta_dtype(self, name: str) -> torch.dtype | None:
        return self._delta if is_float(self.base.entry(name).dtype) else None

    def _task_vector(self, g: _Group, name: str, r0: int, r1: int, norms: list[float] | None) -> torch.Tensor:
        shape = self.base.entry(name).shape
        rows_shape = (r1 - r0, *shape[1:]) if shape else ()
        xs = [x if (x := s.rows(name, r0, r1)) is not None else torch.zeros(rows_shape) for s in g.sources]
        return aggregate(self.aggregator, xs, g.weights, trim_fraction=self.trim, norms=norms)

    def _source_norm(self, src: Any, name: str, chunks: Sequence[tuple[int, int]]) -> float:
        total = SquareSum()
        for r0, r1 in chunks:
            x = src.rows(name, r0, r1)
            if x is not None:
                total.add(x)
        return total.norm()

    def _model_rows(self, g: _Group, name: str, r0: int, r1: int, base_rows: torch.Tensor) -> torch.Tensor:
        """The rows of a group's model itself (a delta file's: base + delta), in float32."""
        src = g.sources[0]
        if isinstance(src, _ModelDelta):
            return src.tuned.read_rows(name, r0, r1).to(torch.float32)
        x = src.rows(name, r0, r1)
        return base_rows.to(torch.float32) if x is None else base_rows.to(torch.float32) + x

    def _interp_stats(self, name: str, r0: int, r1: int, base_rows: torch.Tensor, into: Any) -> Any:
        if self.method.kind == "slerp":
            return slerp_stats(base_rows, self._model_rows(self.groups[0], name, r0, r1, base_rows), into)
        b = base_rows.to(torch.float32)  # offsets as mergekit takes them: model - base
        return model_stock_stats([self._model_rows(g, name, r0, r1, base_rows) - b for g in self.groups], into)

    def _interp_coefs(self, name: str, sums: Any) -> Any:
        p = self.resolved(name).params
        if self.method.kind == "slerp":
            return slerp_coefficients(p.t, sums)
        if p.filter_wise:
            raise MergeError("model_stock: filter_wise: true (per-row angles) is not supported; leave it false")
        return model_stock_t(len(self.groups), sums)

    def _interp_rows(self, name: str, r0: int, r1: int, base_rows: torch.Tensor, coefs: Any) -> torch.Tensor:
        models = [self._model_rows(g, name, r0, r1, base_rows) for g in self.groups]
        if self.method.kind == "slerp":
            return slerp_rows(base_rows, models[0], coefs)
        return model_stock_rows(base_rows, models, coefs)

    def prepare(self, name: str, chunks: Sequence[tuple[int, int]], pool: ThreadPoolExecutor) -> _Prep | None:
        if not is_float(self.base.entry(name).dtype):
            return None
        if self.method.kind != "gta":
            sums = None
            for r0, r1 in chunks:
                sums = self._interp_stats(name, r0, r1, self.base.read_rows(name, r0, r1), sums)
            return _Prep(None, [self._interp_coefs(name, sums)])
        norms = None
        if self.aggregator == "clipped_mean":
            pairs = [(gi, s) for gi, g in enumerate(self.groups) for s in g.sources]
            flat = list(pool.map(lambda p: self._source_norm(p[1], name, chunks), pairs))
            norms = [[v for (gi, _), v in zip(pairs, flat) if gi == i] for i in range(len(self.groups))]
        shape = self.base.entry(name).shape
        n = numel(shape)
        res = self.resolved(name)

        def limits(i: int) -> Any:
            g = self.groups[i]
            gn = norms[i] if norms else None
            chunk_iter = lambda: (self._task_vector(g, name, r0, r1, gn) for r0, r1 in chunks)  # noqa: E731
            if not needs_limits(self.method, res.inputs[i], n, res.densities[i]):
                return ()
            key = rng_key(self.seed, name, g.key)
            if n <= FULL_TENSOR_ELEMS:  # one whole tensor at a time: exact selection is fastest on it
                whole, at = torch.empty(n, dtype=torch.float32), 0
                for t in chunk_iter():
                    whole[at:at + t.numel()] = t.reshape(-1)
                    at += t.numel()
                return input_limits(self.method, res.inputs[i], whole, n, res.densities[i], scratch=True, key=key,
                                    shape=shape)
            return input_limits(self.method, res.inputs[i], chunk_iter, n, res.densities[i], key=key, shape=shape)

        return _Prep(norms, list(pool.map(limits, range(len(self.groups)))))

    def compute(self, name: str, r0: int, r1: int, prep: _Prep | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        entry = self.base.entry(name)
        base_rows = self.base.read_rows(name, r0, r1)
        if not is_float(entry.dtype):
            return base_rows, None
        if self.method.kind != "gta":
            coefs = prep.limits[0] if prep else self._interp_coefs(name, self._interp_stats(name, r0, r1, base_rows, None))
            merged = self._interp_rows(name, r0, r1, base_rows, coefs)
            merged -= base_rows.to(torch.float32)
            d = cast(merged, self._delta)
            return apply_rows(base_rows, d, self.out_dtype(name)), d
        n = numel(entry.shape)
        res = self.resolved(name)
        ts = [self._task_vector(g, name, r0, r1, prep.norms[i] if prep and prep.norms else None)
              for i, g in enumerate(self.groups)]
        keys = [rng_key(self.seed, name, g.key) for g in self.groups]
        if prep is None:  # the whole tensor is this one chunk
            limits = [input_limits(self.method, q, t, n, d, key=k, shape=entry.shape)
                      for t, d, q, k in zip(ts, res.densities, res.inputs, keys)]
        else:
            limits = prep.limits
        offset = r0 * (numel(entry.shape[1:]) if entry.shape else 1)
        merged = merge_chunk(self.method, res.params, ts, res.weights, res.densities, limits, keys, offset, owned=True)
        d = cast(merged, self._delta)
        return apply_rows(base_rows, d, self.out_dtype(name)), d


def _check_sources(base: Checkpoint, src: Any) -> None:
    """Every tensor an input changes exists in the base with the same shape and a float dtype."""
    if isinstance(src, DeltaFile):
        check_delta_fits(base, src)
    else:
        if src.tuned.names() != base.names():
            raise MergeError(f"{src.path} and the base hold different tensors; models must share an architecture")
        for name in base.names():
            if src.tuned.entry(name).shape != base.entry(name).shape:
                raise MergeError(f"`{name}` is {list(src.tuned.entry(name).shape)} in {src.path} "
                                 f"but {list(base.entry(name).shape)} in the base")


def _open_source(base: Checkpoint, path: Path | str) -> Any:
    p = Path(path)
    src = _ModelDelta(Checkpoint(p), base) if p.is_dir() else DeltaFile(p)
    try:
        _check_sources(base, src)
    except BaseException:
        src.close()
        raise
    return src


def _run(base_dir: Path | str, plan: list[tuple[str, list[tuple[Path | str, float]], float, float | None]],
         spec: MergeSpec, out_dir: Path | str, *, seed: int, delta_out: Path | str | None, delta_codec: str,
         base_hash: str | None, out_dtype: torch.dtype | None, max_shard_bytes: int, overwrite: bool,
         workers: int | None, chunk_elems: int, progress: bool,
         tensor_params: Callable[[str], TensorParams] | None = None, tokenizer_from: Path | str | None = None,
         first_layers: Mapping[str, int] | None = None) -> MergeResult:
    if delta_codec not in DENSE_DTYPES:
        raise MergeError(f"the merged delta is stored dense; delta_codec must be one of {', '.join(DENSE_DTYPES)}")
    if not plan or any(not members for _, members, _, _ in plan):
        raise MergeError("nothing to merge: every group needs at least one delta")
    spec.resolve()
    base = Checkpoint(base_dir)
    opened: list[Any] = []
    try:
        groups = []
        for key, members, weight, density in plan:
            sources = []
            for path, _ in members:
                opened.append(_open_source(base, path))
                layers = (first_layers or {}).get(key)
                sources.append(opened[-1] if layers is None else _FirstLayers(opened[-1], layers))
            groups.append(_Group(key, sources, [float(w) for _, w in members], float(weight), density))
        engine = _MergeEngine(base, groups, spec, seed, delta_codec, out_dtype, chunk_elems, tensor_params)
        return run_pipeline(engine, out_dir, delta_out=delta_out, delta_codec=delta_codec, delta_base_hash=base_hash,
                            max_shard_bytes=max_shard_bytes, overwrite=overwrite, workers=workers,
                            chunk_elems=chunk_elems, progress=progress, config_dtype=out_dtype,
                            tokenizer_from=tokenizer_from)
    finally:
        for s in opened:
            s.close()
        base.close()


def merge_checkpoint(base_dir: Path | str, groups: Mapping[str, Sequence[tuple[Path | str, float]]],
                     policy: MergePolicy | MergeSpec, out_dir: Path | str, *, seed: int = 0,
                     skill_weights: Mapping[str, float] | None = None, delta_out: Path | str | None = None,
                     delta_codec: str = MERGED_DELTA_CODEC, base_hash: str | None = None,
                     out_dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     overwrite: bool = False, workers: int | None = None, chunk_elems: int = CHUNK_ELEMS,
                     progress: bool = True, first_layers: Mapping[str, int] | None = None) -> MergeResult:
    """A coordinator's round: `groups` maps each skill to its screened deltas [(path, weight)], which the
    policy's aggregator combines per skill; the policy's method then merges the skills (each weighted by
    `skill_weights`, default 1) onto `base_dir`. Writes the checkpoint to `out_dir` (atomically) and, with
    `delta_out`, the merged delta (dense in `delta_codec`, recorded against `base_hash`) that turns the base
    into it: `apply_delta(base_dir, delta_out, ...)` reproduces the checkpoint bit for bit. A skill in
    `first_layers` (skill -> N) has its deltas merged in the model's first N decoder layers only (a saturated
    skill's repair)."""
    if any(n < 1 for n in (first_layers or {}).values()):
        raise MergeError("first_layers: a skill's deltas need at least one layer to change")
    spec = policy if isinstance(policy, MergeSpec) else MergeSpec.from_policy(policy)
    plan = [(skill, list(members), float((skill_weights or {}).get(skill, 1.0)), None)
            for skill, members in sorted(groups.items())]
    return _run(base_dir, plan, spec, out_dir, seed=seed, delta_out=delta_out, delta_codec=delta_codec,
                base_hash=base_hash, out_dtype=out_dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                workers=workers, chunk_elems=chunk_elems, progress=progress, first_layers=first_layers)


def _plain(inputs: Sequence[MergeInput | Path | str]) -> list[tuple[str, list[tuple[Path | str, float]], float, float | None]]:
    plan = []
    for i, item in enumerate(inputs):
        inp = item if isinstance(item, MergeInput) else MergeInput(item)
        plan.append((f"{i}", [(inp.path, 1.0)], float(inp.weight), inp.density))
    return plan


def merge_deltas(base_dir: Path | str, deltas: Sequence[MergeInput | Path | str], spec: MergeSpec,
                 out_dir: Path | str, **options: Any) -> MergeResult:
    """Merge N delta files (or model directories) onto a base, one task vector each (options as for
    `merge_checkpoint`, plus `tensor_params`: name -> TensorParams for per-tensor parameters, and
    `tokenizer_from`: a model directory whose tokenizer files replace the base's in the output)."""
    return _run(base_dir, _plain(deltas), spec, out_dir, **_defaults(options))


def merge_models(base_dir: Path | str, models: Sequence[MergeInput | Path | str], spec: MergeSpec,
                 out_dir: Path | str, **options: Any) -> MergeResult:
    """Merge N fine-tuned model directories of the base's architecture (their task vectors are model - base)."""
    for item in models:
        path = Path(item.path if isinstance(item, MergeInput) else item)
        if not path.is_dir():
            raise MergeError(f"{path} is not a model directory")
    return _run(base_dir, _plain(models), spec, out_dir, **_defaults(options))


def _defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    allowed = {"seed": 0, "delta_out": None, "delta_codec": MERGED_DELTA_CODEC, "base_hash": None, "out_dtype": None,
               "max_shard_bytes": DEFAULT_SHARD_BYTES, "overwrite": False, "workers": None,
               "chunk_elems": CHUNK_ELEMS, "progress": True, "tensor_params": None, "tokenizer_from": None}
    unknown = set(options) - set(allowed)
    if unknown:
        raise TypeError(f"unknown merge options: {sorted(unknown)}")
    return {**allowed, **options}
