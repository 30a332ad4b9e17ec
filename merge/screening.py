"""Screening: which of a round's deltas may enter the merge, and why each of the others may not.

A delta is rejected when its file is not a valid delta, it was made against another base (the recorded
or the claimed base hash is not the round's), it names tensors the base lacks or leaves out ones it must
carry (every codec but lora carries every floating-point weight), a shape or dtype differs from the
base's, a value is NaN or infinite (or top-k indices are out of order or range), or its norm is above
`max_norm_ratio` times the median norm of the round's otherwise-valid deltas. Reasons fit a
`Rejection` record (256 characters).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.deltas import DeltaFile
from skillswarm.merge.exact import ProductSum, SquareSum
from skillswarm.merge.pipeline import CHUNK_ELEMS, is_float
from skillswarm.merge.progress import progress_bar
from skillswarm.merge.tensorfile import dtype_name, numel, row_chunks, shown
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import SHORT_TEXT_CHARS

log = logging.getLogger(__name__)

REASON_CHARS = SHORT_TEXT_CHARS  # what a Rejection record holds of a reason


@dataclass(frozen=True)
class DeltaCandidate:
    """A delta to screen: its file, the caller's id for it (e.g. the blob sha256), and what its manifest
    claims (skill, base hash); claims are checked against the file when given."""

    path: Path | str
    key: str = ""
    skill: str | None = None
    base_hash: str | None = None


@dataclass(frozen=True)
class Accepted:
    """A delta that passed, with its norm (of the decoded delta) and codec."""

    candidate: DeltaCandidate
    norm: float
    codec: str


@dataclass(frozen=True)
class Rejected:
    """A delta that did not pass, and why."""

    candidate: DeltaCandidate
    reason: str


@dataclass(frozen=True)
class ScreenResult:
    """Accepted and rejected deltas, in the order given, and the median norm the outlier test used."""

    accepted: list[Accepted]
    rejected: list[Rejected]
    median_norm: float | None


class _Reject(Exception):
    pass


def short_reason(text: str) -> str:
    """A reason as a Rejection record holds it: one line of at most REASON_CHARS characters that encodes as
    UTF-8 (a name from a hostile file may hold newlines or lone surrogates)."""
    return shown(text, REASON_CHARS)


def _unreadable(e: Exception, c: DeltaCandidate) -> str:
    """Why a delta's file could not be read, without this machine's path for it (the record names the blob)."""
    text = str(e).replace(str(c.path), "the file")
    return short_reason(f"unreadable delta: {text}" if isinstance(e, MergeError) else
                  f"unreadable delta ({type(e).__name__}: {text})")


def _names(items: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in items[:2]) + (f" and {len(items) - 2} more" if len(items) > 2 else "")


def _check_hashes(f: DeltaFile, c: DeltaCandidate, base_hash: str | None) -> None:
    if f.base_hash and c.base_hash and f.base_hash != c.base_hash:
        raise _Reject(f"the file records base {f.base_hash[:12]} but its manifest claims {c.base_hash[:12]}")
    if c.skill and f.skill and c.skill != f.skill:
        raise _Reject(f"the file is for skill {f.skill!r} but its manifest says {c.skill!r}")
    if base_hash:
        h = f.base_hash or c.base_hash
        if not h:
            raise _Reject("it records no base hash; re-encode it with base_hash= the checkpoint it was trained from")
        if h != base_hash:
            raise _Reject(f"base hash {h[:12]} is not this round's base {base_hash[:12]}")


def _check_layout(f: DeltaFile, base: Checkpoint) -> None:
    unknown = [n for n in f.names() if n not in base]
    if unknown:
        raise _Reject(f"unknown tensor names {_names(unknown)} (not in the base)")
    fixed = [n for n in f.names() if not is_float(base.entry(n).dtype)]
    if fixed:
        raise _Reject(f"it changes non-floating-point tensors {_names(fixed)}")
    if f.codec != "lora":
        missing = [n for n in base.names() if is_float(base.entry(n).dtype) and n not in f]
        if missing:
            raise _Reject(f"missing tensors {_names(missing)} (a {f.codec} delta carries every weight)")
    for n in f.names():
        e = base.entry(n)
        if f.shape(n) != e.shape:
            raise _Reject(f"wrong shape for `{n}`: {list(f.shape(n))}, the base's is {list(e.shape)}")
        declared = f.tensors[n].dtype
        if declared and declared != dtype_name(e.dtype):
            raise _Reject(f"wrong dtype for `{n}`: made for {declared} weights, the base holds {dtype_name(e.dtype)}")


def _check_topk_index(f: DeltaFile, name: str, piece: int) -> None:
    part, n = name + "::idx", numel(f.shape(name))
    total, prev = numel(f.file.entry(part).shape), -1
    for i in range(0, total, piece):
        idx = f.file.read_flat(part, i, i + piece).to(torch.int64)
        if int(idx[0]) <= prev or bool((idx[1:] <= idx[:-1]).any()) or int(idx[0]) < 0 or int(idx[-1]) >= n:
            raise _Reject(f"top-k indices of `{name}` are not strictly increasing within [0, {n})")
        prev = int(idx[-1])


def _norm_and_finite(f: DeltaFile, chunk_elems: int) -> float:
    total = SquareSum()
    for name in f.names():
        if f.tensors[name].kind == "topk":
            _check_topk_index(f, name, chunk_elems)
        for r0, r1 in row_chunks(f.shape(name), chunk_elems):
            x = f.rows(name, r0, r1)
            if not bool(torch.isfinite(x).all()):
                raise _Reject(f"non-finite values (NaN or inf) in `{name}`")
            total.add(x)
    norm = total.norm()  # exact: the same figure, and so the same verdict, on every machine
    if not math.isfinite(norm):
        raise _Reject("its norm overflows")
    return norm


def screen_deltas(base_dir: Path | str, candidates: Sequence[DeltaCandidate | Path | str], *,
                  base_hash: str | None = None, max_norm_ratio: float | None = 5.0,
                  chunk_elems: int = CHUNK_ELEMS, progress: bool = False) -> ScreenResult:
    """Screen `candidates` against the round's base (`base_dir`, whose weights hash is `base_hash`).
    `max_norm_ratio` None turns the outlier test off. One row chunk of one delta in memory at a time."""
    if max_norm_ratio is not None and max_norm_ratio < 1.0:
        raise MergeError(f"max_norm_ratio must be at least 1, got {max_norm_ratio}")
    cands = [c if isinstance(c, DeltaCandidate) else DeltaCandidate(c) for c in candidates]
    base = Checkpoint(base_dir)
    passed: list[tuple[int, float, str]] = []
    rejected: dict[int, Rejected] = {}
    try:
        with progress_bar(len(cands), "screening deltas", enabled=progress) as advance:
            for i, c in enumerate(cands):
                try:
                    with DeltaFile(c.path) as f:
                        _check_hashes(f, c, base_hash)
                        _check_layout(f, base)
                        passed.append((i, _norm_and_finite(f, chunk_elems), f.codec))
                except _Reject as e:
                    rejected[i] = Rejected(c, short_reason(str(e)))
                except MergeError as e:
                    rejected[i] = Rejected(c, _unreadable(e, c))
                except (ArithmeticError, LookupError, TypeError, ValueError, RuntimeError) as e:
                    # a check this code lacks: the delta's bytes broke a step (RecursionError, OverflowError, a
                    # torch error, ...), so the delta is out; environment errors (OSError, MemoryError) still raise
                    log.warning("screening %s raised %s, a file check missing here; rejected it", c.path,
                                type(e).__name__, exc_info=True)
                    rejected[i] = Rejected(c, _unreadable(e, c))
                advance()
    finally:
        base.close()
    median = statistics.median([n for _, n, _ in passed]) if passed else None
    accepted: dict[int, Accepted] = {}
    for i, norm, codec in passed:
        if max_norm_ratio is not None and median and norm > max_norm_ratio * median:
            rejected[i] = Rejected(cands[i], short_reason(f"norm {norm:.4g} is {norm / median:.1f}x the round's median "
                                                    f"{median:.4g} (limit {max_norm_ratio:g}x)"))
        else:
            accepted[i] = Accepted(cands[i], norm, codec)
    return ScreenResult([accepted[i] for i in sorted(accepted)], [rejected[i] for i in sorted(rejected)], median)


def norm_outlier(norm: float, reference: Sequence[float], min_ratio: float, max_ratio: float | None) -> str | None:
    """Why `norm` is outside [min_ratio, max_ratio] x median(reference) (the accepted norms of the skill's
    recent rounds), or None when it is inside or there is no reference yet."""
    if not reference:
        return None
    median = statistics.median(reference)
    if median <= 0:
        return None
    ratio = norm / median
    if max_ratio is not None and ratio > max_ratio:
        return f"norm {norm:.4g} is {ratio:.2f}x the median {median:.4g} of its skill's history (limit {max_ratio:g}x)"
    if ratio < min_ratio:
        return f"norm {norm:.4g} is {ratio:.3f}x the median {median:.4g} of its skill's history (floor {min_ratio:g}x)"
    return None


def consensus_cosines(base_dir: Path | str, paths: Sequence[Path | str], say: Sequence[float], *,
                      chunk_elems: int = CHUNK_ELEMS) -> list[float | None]:
    """For each delta, the cosine between it and the consensus of the *others*: sum_j say_j * d_j over j != i.
    `say` is each delta's weight in the consensus (0: it has no say, e.g. a key with no record yet). None
    where the others have no say or a vector is zero. Dot products are exact (the same figure on every
    machine); one row chunk of every delta in memory at a time."""
    if len(say) != len(paths):
        raise MergeError("consensus_cosines needs one say per delta")
    n = len(paths)
    base = Checkpoint(base_dir)
    files = [DeltaFile(p) for p in paths]
    try:
        own = [SquareSum() for _ in range(n)]  # |d_i|^2
        cross = [ProductSum() for _ in range(n)]  # d_i . S, S = sum_j say_j d_j (rounded elementwise, fixed order)
        total = SquareSum()  # |S|^2
        for name in base.names():
            if not is_float(base.entry(name).dtype) or not any(name in f for f in files):
                continue
            shape = base.entry(name).shape
            for r0, r1 in row_chunks(shape, chunk_elems):
                rows = [f.rows(name, r0, r1) if name in f else None for f in files]
                s = None
                for x, w in zip(rows, say):
                    if x is not None and w:
                        s = x * float(w) if s is None else s.add_(x * float(w))
                if s is None:
                    continue
                total.add(s)
                for i, x in enumerate(rows):
                    if x is not None:
                        own[i].add(x)
                        cross[i].add(x, s)
        out: list[float | None] = []
        ss = total.value()
        for i in range(n):
            nn, ds = own[i].value(), cross[i].value()
            w = float(say[i])
            # the others' consensus C = S - w d_i: d.C = d.S - w|d|^2 and |C|^2 = |S|^2 - 2w d.S + w^2 |d|^2
            dc, cc = ds - w * nn, ss - 2 * w * ds + w * w * nn
            others = any(say[j] for j in range(n) if j != i)
            out.append(dc / math.sqrt(nn * cc) if others and nn > 0 and cc > 1e-12 * ss else None)
        return out
    finally:
        for f in files:
            f.close()
        base.close()
