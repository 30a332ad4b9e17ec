"""What moves through a coordinator's round, all of it values: what the round starts from (`RoundInputs`), its
candidates (one per delta manifest), each step's verdict, and the round's state so far.

A step takes the round's inputs and its state and returns a verdict: the candidates that pass (as the step leaves
them: a step that learns a delta's norm or gain returns a new `Candidate`), those it rejects with the step, the reason
and the figures it judged on (they go into the checkpoint manifest, so `net deltas` can show why), and what it measured
for later steps. None of the values a step is given can be written to (its services, the blob store and the DHT, are
how it fetches): the driver (`RoundStrategy`) makes the next state from each verdict (`RoundState.after`,
`after_merge`, `after_guard`), so what a later step reads is what an earlier one returned.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from msgspec import UNSET

from skillswarm.merge.rounds import RoundDelta
from skillswarm.merge.screening import short_reason
from skillswarm.node.roles.rounds.paired import Paired, Scores, scores
from skillswarm.protocol.records import (CheckpointManifest, DeltaManifest, DeltaRef, MergePolicy, NetworkSpec,
                                         Rejection)
from skillswarm.protocol.transport.blobs import BlobStore

log = logging.getLogger(__name__)

_FIGURE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def _frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """A read-only copy of `mapping`."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Candidate:
    """One delta in a round: its manifest, and what the steps found out about it so far (its file, measured norm,
    weight, figures, and the layers it is merged in). `key` names it across steps."""

    manifest: DeltaManifest
    path: Path | None = None  # the fetched blob
    norm: float | None = None  # measured on the file
    weight: float = 1.0  # in its skill's aggregation
    figures: Mapping[str, float] = field(default_factory=dict)
    layers: int | None = None  # merged in the model's first N decoder layers only (a saturated skill's repair)

    def __post_init__(self) -> None:
        object.__setattr__(self, "figures", _frozen(self.figures))

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def key(self) -> tuple[str, str, str]:
        """(author, skill, blob): one candidate of a round (a key holds one delta manifest per skill and version)."""
        return (self.manifest.author, self.manifest.skill, self.manifest.blob)

    @property
    def skill(self) -> str:
        """The skill it claims to improve."""
        return self.manifest.skill

    @property
    def author(self) -> str:
        """Its author's public key."""
        return self.manifest.author

    def but(self, **changes: Any) -> "Candidate":
        """This candidate with `changes` (a step's findings)."""
        return dataclasses.replace(self, **changes)

    def with_figures(self, **figures: float) -> "Candidate":
        """This candidate with `figures` added (a figure it had keeps its place, with the new value)."""
        return self.but(figures={**self.figures, **figures})

    def to_merge(self) -> RoundDelta:
        """What the round's merge takes of it (its file must be here)."""
        assert self.path is not None, "a candidate is merged only once its file is here"
        return RoundDelta(blob=self.manifest.blob, skill=self.skill, path=self.path, weight=self.weight,
                          layers=self.layers)

    def to_ref(self) -> DeltaRef:
        """Its entry in the checkpoint manifest, as an included delta."""
        return DeltaRef(blob=self.manifest.blob, author=self.author, skill=self.skill, weight=self.weight,
                        norm=self.norm or 0.0, figures=clean_figures(self.figures),
                        layers=UNSET if self.layers is None else self.layers)


@dataclass(frozen=True, eq=False)
class RoundInputs:
    """What a round starts from, which no step changes: the network, the parent checkpoint, recent history, who is
    online, where blobs go, the eval seed, and when this coordinator first saw each delta."""

    spec: NetworkSpec
    parent: CheckpointManifest
    base_dir: Path
    blobs: BlobStore
    history: Sequence[CheckpointManifest] = ()  # trusted manifests up to the parent
    online: frozenset[str] | None = None  # authors with a live peer record; None: unknown (no filter)
    dht: Any = None  # a SwarmDHT for fetching; None: candidates arrive with their paths
    eval_seed: int = 0
    progress: bool = False
    # when this coordinator first saw each delta manifest, by (author, blob), in its own clock's seconds: which of two
    # equal deltas came first (inspection.Copycat). Not the manifest's `created`, which its author writes as it likes;
    # a pair of keys because a re-signed copy has the same blob. Empty: nothing is known (every delta ties).
    first_seen: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "history", tuple(self.history))
        if self.online is not None:
            object.__setattr__(self, "online", frozenset(self.online))
        object.__setattr__(self, "first_seen", _frozen(self.first_seen))

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

    def seen_at(self, cand: Candidate) -> float:
        """When this coordinator first saw `cand`'s manifest (`first_seen`); infinity when it does not know."""
        return self.first_seen.get((cand.author, cand.manifest.blob), math.inf)

    def lot(self, *parts: str) -> str:
        """A draw no author can steer: the sha256 of the round's eval seed (picked after publication), its parent's
        weights and `parts` (e.g. a key), as hex. Orders what the round must break a tie on; anyone who reads the
        manifest's `eval_seed` draws the same."""
        text = "\x00".join([str(self.eval_seed), self.parent.weights_hash, *parts])
        return hashlib.sha256(text.encode()).hexdigest()


class Rejected(NamedTuple):
    """A candidate a step took out of the round, and the manifest's record of why."""

    candidate: Candidate
    rejection: Rejection


def reject(inputs: RoundInputs, cand: Candidate, step: str, reason: str, figures: Mapping[str, float] | None = None,
           *, harmful: bool = True) -> Rejected:
    """`cand` out of the round at `step`, and why, with `figures` (default: the candidate's). `harmful` False: the
    delta did no harm (its blob did not arrive, its gain was not significant), so it does not count against its key."""
    figures = {"harmful": float(harmful), **(figures or cand.figures)}
    short = short_reason(reason)  # a reason may quote a hostile file: one line, UTF-8, capped
    log.info("round v%d: rejected %s (%s) at %s: %s", inputs.parent.version, cand.manifest.blob[:12], cand.skill,
             step, short)
    return Rejected(cand, Rejection(blob=cand.manifest.blob, author=cand.author, skill=cand.skill, reason=short,
                                    step=step, figures=clean_figures(figures)))


# A rejection's figure saying its blob never arrived (the fetch step's): the key's next deltas go to the back of the
# round's slots (reputation.py), without counting against its reputation.
NO_SHOW_FIGURE = "no_show"

# The figures reputation reads (reputation.py), kept before the rest when a manifest's 8 must leave some out:
# `on_credit` (a delta merged on credit earns its key nothing), `harmful` (a rejection that counts against its key) and
# `no_show` (a blob that never arrived).
REPUTATION_FIGURES = ("on_credit", "harmful", NO_SHOW_FIGURE)


def clean_figures(figures: Mapping[str, float]) -> dict[str, float]:
    """The first 8 finite figures (those of REPUTATION_FIGURES first), rounded to 6 significant digits (what a
    manifest can carry)."""
    out: dict[str, float] = {}
    rank = {k: i for i, k in enumerate(REPUTATION_FIGURES)}
    for k, v in sorted(figures.items(), key=lambda kv: rank.get(kv[0], len(rank))):
        if len(out) < 8 and _FIGURE_NAME.match(k) and math.isfinite(v) and abs(v) <= 1e12:
            out[k] = float(f"{v:.6g}")
    return out


@dataclass(frozen=True)
class Evidence:
    """What the usefulness test measured, for the merge guard: the parent's scores on its first look's tasks per skill,
    each candidate's paired figures on every skill (by blob), and per saturated skill its deltas rejected for
    saturation alone, held in reserve (guard.py may bring them back)."""

    parent_scores: Mapping[str, Scores] = field(default_factory=dict)
    measured: Mapping[str, Mapping[str, Paired]] = field(default_factory=dict)
    reserve: Mapping[str, tuple[Candidate, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parent_scores", _frozen(self.parent_scores))
        object.__setattr__(self, "measured", _frozen({b: _frozen(m) for b, m in self.measured.items()}))
        object.__setattr__(self, "reserve", _frozen({s: tuple(cs) for s, cs in self.reserve.items()}))


@dataclass(frozen=True)
class Verdict:
    """One screening step's decision on the candidates it was given: those that pass (as the step leaves them, in the
    order the next step takes them), those it rejects, how many it left out without a record (the caps), and what it
    measured."""

    passed: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...] = ()
    omitted: int = 0
    evidence: Evidence = field(default_factory=Evidence)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", tuple(self.passed))
        object.__setattr__(self, "rejected", tuple(self.rejected))


@dataclass(frozen=True)
class Merged:
    """A merge the round made (the lambda search's verdict): its `merge.MergeResult`, the policy it used (the
    network's, at the lambda the search chose), its first-look scores when they were measured (the guard reuses them),
    and the search's seconds (None: no search ran)."""

    result: Any
    policy: MergePolicy
    scores: Mapping[str, Scores] = field(default_factory=dict)
    seconds: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scores", _frozen(self.scores))


@dataclass(frozen=True)
class GuardVerdict:
    """The merge guard's decision on a merge: what the next merge holds (the same candidates: the merge stands), the
    delta it took out, the deltas it brought in from the reserve (their saturation rejections are taken back), the
    skill whose reserve it judged (which leaves the reserve, passed or not), what it measured, and its seconds (None:
    it did not test the merge)."""

    kept: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...] = ()
    restored: tuple[Candidate, ...] = ()
    released: str | None = None
    evidence: Evidence = field(default_factory=Evidence)
    seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("kept", "rejected", "restored"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class RoundState:
    """What a round has decided so far: the candidates still in it (what the last step let through; after a merge,
    what it holds), every rejection in order, how many the caps left out, seconds per step, what the usefulness test
    measured, the reserve, and the last merge's policy and first-look scores."""

    candidates: tuple[Candidate, ...] = ()
    rejected: tuple[Rejected, ...] = ()
    omitted: int = 0
    seconds: Mapping[str, float] = field(default_factory=dict)
    parent_scores: Mapping[str, Scores] = field(default_factory=dict)
    measured: Mapping[str, Mapping[str, Paired]] = field(default_factory=dict)
    reserve: Mapping[str, tuple[Candidate, ...]] = field(default_factory=dict)
    merge_policy: MergePolicy | None = None
    merged_scores: Mapping[str, Scores] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "rejected", tuple(self.rejected))
        for name in ("seconds", "parent_scores", "measured", "reserve", "merged_scores"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def but(self, **changes: Any) -> "RoundState":
        """This state with `changes` (e.g. other candidates to screen)."""
        return dataclasses.replace(self, **changes)

    def _timed(self, name: str, seconds: float | None) -> Mapping[str, float]:
        if seconds is None:
            return self.seconds
        return {**self.seconds, name: self.seconds.get(name, 0.0) + seconds}

    def _with(self, evidence: Evidence) -> dict[str, Any]:
        reserve = dict(self.reserve)
        for skill, cands in evidence.reserve.items():
            reserve[skill] = (*reserve.get(skill, ()), *cands)
        return {"parent_scores": {**self.parent_scores, **evidence.parent_scores},
                "measured": {**self.measured, **evidence.measured}, "reserve": reserve}

    def after(self, step: str, verdict: Verdict, seconds: float | None = None) -> "RoundState":
        """The state once step `step` gave `verdict` (in `seconds`)."""
        return self.but(candidates=verdict.passed, rejected=(*self.rejected, *verdict.rejected),
                        omitted=self.omitted + verdict.omitted, seconds=self._timed(step, seconds),
                        **self._with(verdict.evidence))

    def after_merge(self, merged: Merged, name: str = "lambda") -> "RoundState":
        """The state once the round merged its candidates (`name`: the search's step name, for its seconds)."""
        return self.but(merge_policy=merged.policy, merged_scores=merged.scores,
                        seconds=self._timed(name, merged.seconds))

    def after_guard(self, verdict: GuardVerdict, name: str = "guard") -> "RoundState":
        """The state once the merge guard gave `verdict` (`name`: its step name, for its seconds)."""
        back = {c.key for c in verdict.restored}
        kept = [r for r in self.rejected if r.candidate.key not in back]
        changes = self._with(verdict.evidence)
        changes["reserve"] = {s: cs for s, cs in changes["reserve"].items() if s != verdict.released}
        return self.but(candidates=verdict.kept, rejected=(*kept, *verdict.rejected),
                        seconds=self._timed(name, verdict.seconds), **changes)


class Step(Protocol):
    """One step of a round: judges `state.candidates` and returns its verdict; writes nothing."""

    name: str

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict: ...
