"""What every merge method shares: its registry entry, the combine step, and the whole-tensor merge.

A method is data, not a class hierarchy: a sparsifier (none, magnitude, band, random, della), whether
signs are elected (TIES consensus), and a parameter struct with `scale` (lambda) and `normalize`. The
merged task vector of inputs x_i with weights w_i is

    y_i   = sparsify(x_i)                        (per input, thresholds over the whole tensor)
    s     = sign(sum_i w_i y_i)  (+ where 0)     (only with consensus)
    m_i   = [sign(w_i y_i) == s]  (else all 1)
    merged = scale * sum_i m_i w_i y_i / (sum_i m_i w_i if normalize else 1)

which is mergekit's generalized task arithmetic, so its recipes mean the same here. Sums run input by
input in a fixed order with separately rounded multiplies and adds, so results are bit-identical
across thread counts and machines. Methods of another `kind` (slerp, model_stock) interpolate between
the base and the models with per-tensor coefficients instead; see their files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from skillswarm.merge.methods.sparsify import della_limits, rng_key, sparsify, thresholds, trim_ranks
from skillswarm.protocol.errors import MergeError


@dataclass(frozen=True)
class Method:
    """A registry entry: name, parameter struct, and the two choices that define the method."""

    name: str
    params: type
    sparsifier: str  # "none" | "magnitude" | "band" | "random" | "della"
    consensus: bool
    summary: str
    paper: str = ""
    kind: str = "gta"  # "gta" (generalized task arithmetic, above) | "slerp" | "model_stock"

    def make_params(self, values: Mapping[str, Any] | None = None) -> Any:
        """The parameter struct from a mapping (recipe, CLI, policy); `lambda` is an alias of `scale`."""
        names = [f.name for f in dataclasses.fields(self.params)]
        kw: dict[str, Any] = {}
        for key, value in (values or {}).items():
            key = "scale" if key == "lambda" else key
            if key not in names:
                raise MergeError(f"merge method {self.name} has no parameter {key!r} (it takes: {', '.join(names)})")
            kw[key] = value
        return check_params(self.params(**kw), self.name)


def check_params(p: Any, method: str) -> Any:
    """Reject out-of-range parameters with a message naming the method."""
    density = getattr(p, "density", 1.0)
    if not (isinstance(density, (int, float)) and 0.0 < density <= 1.0):
        raise MergeError(f"{method}: density must be in (0, 1], got {density!r}")
    scale = getattr(p, "scale", 1.0)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise MergeError(f"{method}: lambda (scale) must be a finite number, got {scale!r}")
    gamma = getattr(p, "gamma", 0.0)
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma < 1.0):
        raise MergeError(f"{method}: gamma must be in [0, 1), got {gamma!r}")
    epsilon = getattr(p, "epsilon", None)
    eps_ok = isinstance(epsilon, (int, float)) and epsilon >= 0.0 and (
        density >= 1.0 or (density - epsilon > 0.0 and density + epsilon < 1.0))
    if epsilon is not None and not eps_ok:
        raise MergeError(f"{method}: epsilon must keep density +- epsilon inside (0, 1), got density {density!r} "
                         f"and epsilon {epsilon!r}")
    if not isinstance(getattr(p, "normalize", False), bool):
        raise MergeError(f"{method}: normalize must be true or false, got {p.normalize!r}")
    return p


def combine(xs: list[torch.Tensor], weights: Sequence[float], *, consensus: bool, normalize: bool,
            owned: bool = False) -> torch.Tensor:
    """Weighted sum (or mean) of sparsified task vectors, with TIES sign election when `consensus`.
    `owned`: the tensors in `xs` are scratch and may be overwritten (saves one copy per input)."""
    weighted = [(x.mul_(float(w)) if owned else x * float(w)) if w != 1.0 else x for x, w in zip(xs, weights)]
    if not consensus:
        mixed = weighted[0] if owned else weighted[0].clone()
        for t in weighted[1:]:
            mixed += t
        total = math.fsum(float(w) for w in weights)
        return mixed / (total if abs(total) >= 1e-8 else 1.0) if normalize else mixed
    mass = weighted[0].clone()
    for t in weighted[1:]:
        mass += t
    elected = torch.copysign(torch.ones((), dtype=mass.dtype), mass)  # +1 where mass >= 0 (a -0.0 mass means
    del mass  # every entry is zero, so no input agrees either way)
    mixed, divisor = torch.zeros_like(elected), torch.zeros_like(elected)
    for t, w in zip(weighted, weights):
        agree = t * elected  # > 0 exactly where t has the elected sign; zeros (trimmed) never agree
        agree.clamp_(min=0.0)
        divisor += torch.sign(agree) * float(w) if w != 1.0 else torch.sign(agree)
        agree *= elected  # back to t where it agrees, 0 elsewhere (multiplying by +-1 is exact)
        mixed += agree
    if not normalize:
        return mixed
    if all(w > 0 for w in weights):  # divisor is 0 only where mixed is 0: any positive divisor gives 0
        return mixed.div_(divisor.clamp_min_(torch.finfo(divisor.dtype).tiny))
    return mixed.div_(divisor.masked_fill_(divisor == 0, 1.0))


def densities_for(p: Any, n: int, densities: Sequence[float | None] | None) -> list[float]:
    """Each input's density: its own override, else the method's."""
    default = float(getattr(p, "density", 1.0))
    return [default if densities is None or densities[i] is None else float(densities[i]) for i in range(n)]


def merge_chunk(method: Method, p: Any, xs: list[torch.Tensor], weights: Sequence[float],
                densities: Sequence[float], limits: Sequence[tuple[float, ...]], keys: Sequence[int],
                offset: int = 0, owned: bool = False) -> torch.Tensor:
    """Merge (a row chunk of) one tensor's task vectors, given each input's whole-tensor thresholds.
    `owned`: `xs` is scratch (the list and its tensors may be consumed) so memory stays one copy per input."""
    ys, fresh = [], True
    for i in range(len(xs)):
        y = sparsify(method.sparsifier, xs[i], density=densities[i], limits=limits[i], key=keys[i], offset=offset)
        fresh = fresh and y is not xs[i]
        ys.append(y)
        if owned:
            xs[i] = None  # type: ignore[call-overload]
    merged = combine(ys, weights, consensus=method.consensus, normalize=p.normalize, owned=owned or fresh)
    return merged * float(p.scale) if p.scale != 1.0 else merged


def needs_limits(method: Method, p: Any, n: int, density: float) -> bool:
    """Whether one input's sparsifier needs whole-tensor statistics (thresholds, DELLA's rescale)."""
    if method.sparsifier == "della":
        return density < 1.0 and n > 0
    return bool(trim_ranks(method.sparsifier, n, density, float(getattr(p, "gamma", 0.0))))


def input_limits(method: Method, p: Any, x: Any, n: int, density: float, scratch: bool = False, *, key: int = 0,
                 shape: Sequence[int] | None = None) -> Any:
    """Whole-tensor statistics of one input (`x`: the tensor, or a function iterating its chunks;
    `scratch`: the tensor may be overwritten): thresholds, or DELLA's limits (`key`, `shape` for it)."""
    if method.sparsifier == "della":
        if not needs_limits(method, p, n, density):
            return ()
        return della_limits(x, tuple(shape) if shape is not None else (n,), density, float(p.epsilon), key,
                            bool(p.rescale))
    return thresholds(trim_ranks(method.sparsifier, n, density, float(getattr(p, "gamma", 0.0))), x, scratch)


def merge_tensors(method: Method, deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                  params: Any = None, *, densities: Sequence[float | None] | None = None, seed: int = 0,
                  name: str = "", keys: Sequence[str] | None = None) -> torch.Tensor:
    """The merged task vector of same-shape `deltas` (add it to the base): the pure whole-tensor form.
    `name`, `keys` and `seed` only key DARE's masks (same key, same mask)."""
    if not deltas:
        raise MergeError("nothing to merge: no deltas")
    shape = deltas[0].shape
    if any(d.shape != shape for d in deltas):
        raise MergeError(f"deltas of different shapes: {[list(d.shape) for d in deltas]}")
    p = check_params(params if params is not None else method.params(), method.name)
    xs = [d.detach().to(torch.float32) for d in deltas]
    w = [1.0] * len(xs) if weights is None else [float(v) for v in weights]
    ds = densities_for(p, len(xs), densities)
    ks = [rng_key(seed, name, keys[i] if keys else str(i)) for i in range(len(xs))]
    limits = [input_limits(method, p, x, x.numel(), d, key=k, shape=shape) for x, d, k in zip(xs, ds, ks)]
    return merge_chunk(method, p, xs, w, ds, limits, ks)
