"""A round's merge, written once: the coordinator that makes it, `coordinator run --verify` that recomputes it, and
anyone who re-merges a round another way (the demo's comparison of methods, bench/remerge.py) call `round_merge`.

What a round merges is a list of deltas, each with its skill, weight and the decoder layers it is merged in
(`RoundDelta`). The recipe: each skill's deltas in blob order (the order the aggregator sums them, so the bits are the
same for everyone), a skill's deltas merged in the same first N layers or in all of them, the merged delta stored dense
in the parent's own float dtype (applying it is then bit-exact). A published manifest says all of it: its included
deltas (`included_deltas`, which reads the `layers` of manifests of every protocol: `records.delta_layers`), and its
method, params and seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from skillswarm.merge.deltas import dense_codec_for
from skillswarm.merge.pipeline import MergeResult
from skillswarm.merge.streaming import MergeSpec, merge_checkpoint
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import CheckpointManifest, DeltaRef, MergePolicy, delta_layers


@dataclass(frozen=True)
class RoundDelta:
    """One delta a round merges: its blob (which orders it within its skill), skill, file, weight in its skill's
    aggregate, and the decoder layers it is merged in (N: the first N only, a saturated skill's repair; None: all)."""

    blob: str
    skill: str
    path: Path
    weight: float = 1.0
    layers: int | None = None


def first_layers(deltas: Sequence[RoundDelta]) -> dict[str, int]:
    """skill -> N for the skills whose deltas are merged in their first N decoder layers only. A skill's deltas are
    merged in the same layers: deltas that disagree name no merge (MergeError)."""
    seen: dict[str, int | None] = {}
    for d in deltas:
        if seen.setdefault(d.skill, d.layers) != d.layers:
            raise MergeError(f"the {d.skill} deltas disagree on `layers` ({seen[d.skill]} and {d.layers}); a skill's "
                             "deltas are merged in the same layers")
    return {skill: n for skill, n in seen.items() if n is not None}


def round_merge(parent_dir: Path | str, deltas: Sequence[RoundDelta], policy: MergePolicy | MergeSpec,
                out_dir: Path | str, *, seed: int, delta_out: Path | str | None = None, base_hash: str | None = None,
                progress: bool = False, workers: int | None = None, chunk_elems: int | None = None) -> MergeResult:
    """The merge of a round's `deltas` onto its parent by `policy`, written to `out_dir` (and, with `delta_out`, the
    merged delta recorded against `base_hash`): every skill's deltas in blob order, each skill in its layers. Its bits
    depend on the deltas, policy and seed only; `workers` and `chunk_elems` (None: the engine's) change how fast."""
    if not deltas:
        raise MergeError("a round's merge needs at least one delta")
    layers = first_layers(deltas)
    groups: dict[str, list[tuple[Path | str, float]]] = {}
    for d in sorted(deltas, key=lambda d: d.blob):
        groups.setdefault(d.skill, []).append((d.path, d.weight))
    speed = {k: v for k, v in (("workers", workers), ("chunk_elems", chunk_elems)) if v}
    # the merged delta in the parent's own dtype, written or not: each chunk is rounded to it before it is added
    return merge_checkpoint(parent_dir, groups, policy, out_dir, seed=seed, delta_out=delta_out,
                            delta_codec=dense_codec_for(parent_dir), base_hash=base_hash, progress=progress,
                            first_layers=layers, **speed)


def included_deltas(manifest: CheckpointManifest, path_of: Callable[[DeltaRef], Path]) -> list[RoundDelta]:
    """What `manifest` merged, as `round_merge` takes it: each included delta with its weight and layers (every entry's
    layers read before any `path_of`, which finds or fetches its file)."""
    layers = [delta_layers(manifest, ref) for ref in manifest.included]
    return [RoundDelta(blob=ref.blob, skill=ref.skill, path=path_of(ref), weight=ref.weight, layers=n)
            for ref, n in zip(manifest.included, layers)]
