"""Reputation: what a key's record in recent checkpoints says about its next delta.

A key's score is the Laplace estimate (included + 1) / (included + rejected + 2) over the last N trusted
checkpoint manifests: a new key starts at 0.5, each inclusion moves it up, each harmful rejection down (a
delta whose blob did not arrive or whose gain was not significant is not held against its key: the
rejection's `harmful` figure is 0; nor does a delta merged on credit, whose gain was not significant, count
for it: its `on_credit` figure is 1). It gates
(keys below the network's `min_reputation` are not considered), orders (when a round has more deltas
than its cap, the best-reputed go first: `slot_tier`), weights a delta within its skill's aggregation, and decides
who has a say in a skill's consensus direction (only keys with a record above a fresh key's).

No-shows. A delta whose blob never arrived (the fetch step's rejection: its `no_show` figure, or, in manifests
written before that figure, its step `fetch`) is not harmful, since an honest worker's uplink can fail; but a key
that announces deltas and never serves them takes round slots from others at no cost, every round. So no-shows
count apart: they never lower a key's score (nor its weight, say or floor), but a key whose no-shows in the window
outnumber its inclusions is `absent`, and its deltas take a round's slots after every other key's, fresh keys
included. A worker with a record absorbs a blip (one no-show per inclusion); a fresh key whose first delta never
arrived waits behind the other fresh keys until one of its deltas is merged or the no-show leaves the window, which
only matters in a round with more deltas than slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from skillswarm.node.roles.rounds.state import NO_SHOW_FIGURE, RoundInputs, RoundState, Verdict
from skillswarm.protocol.records import CheckpointManifest, Rejection

# Slot tiers (`slot_tier`): a round's slots go to keys with a record first, then to the others, absent keys last.
TIER_PROVEN, TIER_OTHER, TIER_ABSENT = 0, 1, 2


@dataclass(frozen=True)
class Reputation:
    """One key's record over the window."""

    included: int = 0
    rejected: int = 0
    no_shows: int = 0  # deltas whose blob never arrived: not held against the score (module docstring)

    @property
    def score(self) -> float:
        """(included + 1) / (included + rejected + 2): 0.5 for a key never seen."""
        return (self.included + 1) / (self.included + self.rejected + 2)

    @property
    def say(self) -> float:
        """Its weight in a consensus: how far its score is above a fresh key's (0 for new or worse keys)."""
        return max(0.0, 2 * self.score - 1)

    @property
    def absent(self) -> bool:
        """Whether its no-shows outnumber its inclusions: its deltas take the round's slots last."""
        return self.no_shows > self.included

    @property
    def slot_tier(self) -> int:
        """Where its deltas queue for a round's slots: TIER_PROVEN (a record above a fresh key's), TIER_OTHER (fresh
        keys, and keys at or below a fresh key's score), TIER_ABSENT (no-shows outnumber inclusions)."""
        if self.absent:
            return TIER_ABSENT
        return TIER_PROVEN if self.say > 0 else TIER_OTHER


def is_no_show(r: Rejection) -> bool:
    """Whether a rejection says the delta's blob never arrived: its `no_show` figure, or in older manifests a harmless
    rejection at the fetch step (which then rejected unavailable blobs only)."""
    return r.figures.get(NO_SHOW_FIGURE, 0.0) > 0 or (r.step == "fetch" and r.figures.get("harmful", 1.0) == 0)


def reputations(history: Iterable[CheckpointManifest], rounds: int) -> dict[str, Reputation]:
    """Every key's record in the newest `rounds` manifests of `history`."""
    recent = sorted(history, key=lambda m: m.version)[-rounds:] if rounds > 0 else []
    inc: dict[str, int] = {}
    rej: dict[str, int] = {}
    gone: dict[str, int] = {}
    for m in recent:
        for d in m.included:
            if d.figures.get("on_credit", 0.0) == 0:  # merged on credit (usefulness.py): it showed nothing
                inc[d.author] = inc.get(d.author, 0) + 1
        for r in m.rejected:
            if r.figures.get("harmful", 1.0) > 0:
                rej[r.author] = rej.get(r.author, 0) + 1
            elif is_no_show(r):
                gone[r.author] = gone.get(r.author, 0) + 1
    return {k: Reputation(inc.get(k, 0), rej.get(k, 0), gone.get(k, 0)) for k in inc.keys() | rej.keys() | gone.keys()}


def reputation_of(table: dict[str, Reputation], author: str) -> Reputation:
    """A key's reputation (a fresh one's if it has no record)."""
    return table.get(author, Reputation())


@dataclass
class Weigh:
    """Each accepted delta's weight in its skill's aggregation: its key's reputation (0.5 for a new key), so
    proven contributors count for more than fresh ones."""

    name: str = "weigh"

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        table = reputations(inputs.history, inputs.spec.trust.reputation_rounds)
        return Verdict(tuple(c.but(weight=round(reputation_of(table, c.author).score, 6)) for c in state.candidates))
