"""What moves through a coordinator's round: candidates (one per delta manifest) and the round's context.

A step takes the context and the surviving candidates and returns the ones that pass; it rejects the
others through `RoundContext.reject`, which records the step, the reason and the figures it judged on
(they go into the checkpoint manifest, so `net deltas` can show why).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

from skillswarm.merge.screening import short_reason
from skillswarm.node.rounds.paired import Paired, Scores, scores
from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.records import (LAYERS_FIGURE, CheckpointManifest, DeltaManifest, MergePolicy, NetworkSpec,
                                         Rejection)

log = logging.getLogger(__name__)

_FIGURE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass
class Candidate:
    """One delta in a round: its manifest, and what the steps learned about it."""

    manifest: DeltaManifest
    path: Path | None = None  # the fetched blob
    norm: float | None = None  # measured on the file
    weight: float = 1.0  # in its skill's aggregation
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def skill(self) -> str:
        """The skill it claims to improve."""
        return self.manifest.skill

    @property
    def author(self) -> str:
        """Its author's public key."""
        return self.manifest.author


@dataclass
class RoundContext:
    """Everything a step may read: the network, the parent checkpoint, recent history, who is online, where
    blobs go; and what the round decided so far (rejections, omissions)."""

    spec: NetworkSpec
    parent: CheckpointManifest
    base_dir: Path
    blobs: BlobStore
    history: list[CheckpointManifest] = field(default_factory=list)  # trusted manifests before this one
    online: set[str] | None = None  # authors with a live peer record; None: unknown (no filter)
    dht: Any = None  # a SwarmDHT for fetching; None: candidates arrive with their paths
    eval_seed: int = 0
    progress: bool = False
    rejected: list[tuple[Candidate, Rejection]] = field(default_factory=list)
    omitted: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # per step
    # the usefulness test's measurements, for the merge guard: the parent's scores on its first look's tasks per
    # skill, and each candidate's (by blob) paired figures on every skill
    parent_scores: dict[str, Scores] = field(default_factory=dict)
    measured: dict[str, dict[str, Paired]] = field(default_factory=dict)
    # the last merge: the policy it used (the network's, at the lambda the search chose) and, when the search measured
    # it, its scores on the first look's tasks (the guard reuses them)
    merge_policy: MergePolicy | None = None
    merged_scores: dict[str, Scores] = field(default_factory=dict)
    # per saturated skill, its deltas the usefulness test rejected for saturation alone: the merge guard may bring
    # them back when the merge leaves that skill worse than the parent (guard.py)
    reserve: dict[str, list[Candidate]] = field(default_factory=dict)
    # when this coordinator first saw each delta manifest, by (author, blob), in its own clock's seconds: which of two
    # equal deltas came first (inspection.Copycat). Not the manifest's `created`, which its author writes as it likes;
    # a pair of keys because a re-signed copy has the same blob. Empty: nothing is known (every delta ties).
    first_seen: dict[tuple[str, str], float] = field(default_factory=dict)

    @functools.cached_property
    def max_delta_bytes(self) -> int:
        """The most bytes any delta of the parent model can take (downloads are capped at this)."""
        from skillswarm.merge.deltas import max_delta_bytes

        return max_delta_bytes(self.base_dir)

    def first_look(self, model_dir: Path) -> dict[str, Scores]:
        """A model's (reward, correct) on the usefulness test's first-look tasks, per skill (greedy)."""
        from skillswarm.node.rl.engines.hf import HFEngine

        engine = HFEngine.load(model_dir)
        return {s: scores(engine, s, self.spec.screen.eval_n, self.eval_seed) for s in self.spec.skills}

    def parent_first_look(self) -> dict[str, Scores]:
        """The parent's first-look scores: the usefulness test's, or measured now when no usefulness test ran."""
        if any(s not in self.parent_scores for s in self.spec.skills):
            self.parent_scores.update(self.first_look(self.base_dir))
        return self.parent_scores

    def reject(self, cand: Candidate, step: str, reason: str, figures: dict[str, float] | None = None, *,
               harmful: bool = True) -> None:
        """Record that `cand` is out of the round, at `step`, and why. `harmful` False: the delta did no harm
        (its blob did not arrive, its gain was not significant), so it does not count against its key."""
        figures = {"harmful": float(harmful), **(figures or cand.figures)}
        short = short_reason(reason)  # a reason may quote a hostile file: one line, UTF-8, capped
        log.info("round v%d: rejected %s (%s) at %s: %s", self.parent.version, cand.manifest.blob[:12], cand.skill,
                 step, short)
        self.rejected.append((cand, Rejection(blob=cand.manifest.blob, author=cand.author, skill=cand.skill,
                                              reason=short, step=step, figures=clean_figures(figures))))

    def seen_at(self, cand: Candidate) -> float:
        """When this coordinator first saw `cand`'s manifest (`first_seen`); infinity when it does not know."""
        return self.first_seen.get((cand.author, cand.manifest.blob), math.inf)

    def lot(self, *parts: str) -> str:
        """A draw no author can steer: the sha256 of the round's eval seed (picked after publication), its parent's
        weights and `parts` (e.g. a key), as hex. Orders what the round must break a tie on; anyone who reads the
        manifest's `eval_seed` draws the same."""
        text = "\x00".join([str(self.eval_seed), self.parent.weights_hash, *parts])
        return hashlib.sha256(text.encode()).hexdigest()

    def unreject(self, cand: Candidate) -> None:
        """Take back `cand`'s rejections: a later step brought it into the round after all."""
        self.rejected = [(c, r) for c, r in self.rejected if c is not cand]


def first_layers(deltas: Iterable[tuple[str, Mapping[str, float]]]) -> dict[str, int]:
    """skill -> N for the skills whose deltas (skill, figures) are merged in their first N layers only. A manifest
    whose `layers` figure is not a layer count, or differs among one skill's deltas, names no merge: RecordError."""
    seen: dict[str, float | None] = {}
    for skill, figures in deltas:
        n = figures.get(LAYERS_FIGURE)
        if n is not None and not (math.isfinite(n) and n == int(n) and 1 <= n <= 1024):
            raise RecordError(f"a {skill} delta's `{LAYERS_FIGURE}` figure is {n}, not a layer count (1-1024); the "
                              "manifest does not say how it was merged")
        if seen.setdefault(skill, n) != n:
            raise RecordError(f"the {skill} deltas disagree on `{LAYERS_FIGURE}` ({seen[skill]} and {n}); a skill's "
                              "deltas are merged in the same layers")
    return {skill: int(n) for skill, n in seen.items() if n is not None}


# A rejection's figure saying its blob never arrived (the fetch step's): the key's next deltas go to the back of the
# round's slots (reputation.py), without counting against its reputation.
NO_SHOW_FIGURE = "no_show"

# Figures others act on, kept before the rest when a manifest's 8 must leave some out: the merge reads `layers`
# (`--verify` recomputes it), reputation reads `on_credit` (a delta merged on credit earns its key nothing),
# `harmful` (a rejection that counts against its key) and `no_show` (a blob that never arrived).
KEPT_FIRST = (LAYERS_FIGURE, "on_credit", "harmful", NO_SHOW_FIGURE)


def clean_figures(figures: dict[str, float]) -> dict[str, float]:
    """The first 8 finite figures (those of KEPT_FIRST first), rounded to 6 significant digits (what a manifest can
    carry)."""
    out: dict[str, float] = {}
    rank = {k: i for i, k in enumerate(KEPT_FIRST)}
    for k, v in sorted(figures.items(), key=lambda kv: rank.get(kv[0], len(rank))):
        if len(out) < 8 and _FIGURE_NAME.match(k) and math.isfinite(v) and abs(v) <= 1e12:
            out[k] = float(f"{v:.6g}")
    return out


class Step(Protocol):
    """One step of a round: returns the candidates that pass; rejects the rest with `ctx.reject`."""

    name: str

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]: ...
