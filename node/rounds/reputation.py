"""Reputation: what a key's record in recent checkpoints says about its next delta.

A key's score is the Laplace estimate (included + 1) / (included + rejected + 2) over the last N trusted
checkpoint manifests: a new key starts at 0.5, each inclusion moves it up, each harmful rejection down (a
delta whose blob did not arrive or whose gain was not significant is not held against its key: the
rejection's `harmful` figure is 0; nor does a delta merged on credit, whose gain was not significant, count
for it: its `on_credit` figure is 1). It gates
(keys below the network's `min_reputation` are not considered), orders (when a round has more deltas
than its cap, the best-reputed go first), weights a delta within its skill's aggregation, and decides
who has a say in a skill's consensus direction (only keys with a record above a fresh key's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from skillswarm.node.rounds.context import Candidate, RoundContext
from skillswarm.protocol.records import CheckpointManifest


@dataclass(frozen=True)
class Reputation:
    """One key's record over the window."""

    included: int = 0
    rejected: int = 0

    @property
    def score(self) -> float:
        """(included + 1) / (included + rejected + 2): 0.5 for a key never seen."""
        return (self.included + 1) / (self.included + self.rejected + 2)

    @property
    def say(self) -> float:
        """Its weight in a consensus: how far its score is above a fresh key's (0 for new or worse keys)."""
        return max(0.0, 2 * self.score - 1)


def reputations(history: Iterable[CheckpointManifest], rounds: int) -> dict[str, Reputation]:
    """Every key's record in the newest `rounds` manifests of `history`."""
    recent = sorted(history, key=lambda m: m.version)[-rounds:] if rounds > 0 else []
    inc: dict[str, int] = {}
    rej: dict[str, int] = {}
    for m in recent:
        for d in m.included:
            if d.figures.get("on_credit", 0.0) == 0:  # merged on credit (usefulness.py): it showed nothing
                inc[d.author] = inc.get(d.author, 0) + 1
        for r in m.rejected:
            if r.figures.get("harmful", 1.0) > 0:
                rej[r.author] = rej.get(r.author, 0) + 1
    return {k: Reputation(inc.get(k, 0), rej.get(k, 0)) for k in inc.keys() | rej.keys()}


def reputation_of(table: dict[str, Reputation], author: str) -> Reputation:
    """A key's reputation (a fresh one's if it has no record)."""
    return table.get(author, Reputation())


@dataclass
class Weigh:
    """Each accepted delta's weight in its skill's aggregation: its key's reputation (0.5 for a new key), so
    proven contributors count for more than fresh ones."""

    name: str = "weigh"

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        table = reputations(ctx.history, ctx.spec.trust.reputation_rounds)
        for c in candidates:
            c.weight = round(reputation_of(table, c.author).score, 6)
        return candidates
