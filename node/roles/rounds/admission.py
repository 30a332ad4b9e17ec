"""Pre-screening: what a coordinator checks on a delta's manifest alone, before spending a download on it.

`Admission` rejects (with the reason in the manifest) a delta for a skill the network does not have, for
another base, by a key the network does not admit or whose reputation is below the floor, by a worker
that stopped heartbeating, announcing a file larger than any encoding of this model can be, or claiming
a norm outside the skill's history. `Caps` then bounds what one key and one round may cost: at most
`max_deltas_per_author` per key and `max_deltas_per_round` in all; the rest are counted as omitted (a flood of
sybil deltas must not grow the manifest).

Who gets the round's slots, in order (`slot_order`):
1. keys with a record above a fresh key's (reputation.TIER_PROVEN), best reputation first: their work was merged;
2. every other key (fresh ones, and those at or below a fresh key's score, best score first);
3. absent keys, whose deltas never arrived more often than they were merged (reputation.py, "No-shows"): a key
   that announces and never serves would otherwise hold slots every round at no cost.
Within a tier, keys of equal score queue in the order of a draw on the round's eval seed (`RoundInputs.lot`), which
is picked after publication, so no author can buy a place: not by the `created` time it writes into its own manifest
(32 sybil deltas claiming `created = 0` used to take every slot), not by grinding keys or blobs. A key's own deltas
keep the order it gave them (`created`), which moves no other key. Fresh keys stay cheap: against k fresh sybil keys
an honest fresh key gets one of the s slots the proven keys leave in about s / (k + 1) of rounds (and each sybil
key that never serves its blob drops to the back after its first no-show); only a record, or an allowlist, buys a
sure place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from skillswarm.merge.screening import norm_outlier
from skillswarm.node.roles.rounds.reputation import Reputation, reputation_of, reputations
from skillswarm.node.roles.rounds.state import Candidate, Rejected, RoundInputs, RoundState, Verdict, reject
from skillswarm.protocol.records import CheckpointManifest


def skill_norm_history(history: Sequence[CheckpointManifest], skill: str, rounds: int) -> list[float]:
    """The norms of the deltas of `skill` that the newest `rounds` checkpoints included."""
    recent = sorted(history, key=lambda m: m.version)[-rounds:]
    return [d.norm for m in recent for d in m.included if d.skill == skill and d.norm > 0]


@dataclass
class Admission:
    """Manifest-only checks (see the module docstring)."""

    name: str = "admission"

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        spec, parent = inputs.spec, inputs.parent
        trust, screen = spec.trust, spec.screen
        table = reputations(inputs.history, trust.reputation_rounds)
        limit = inputs.max_delta_bytes
        out: list[Candidate] = []
        rejected: list[Rejected] = []
        for c in state.candidates:
            harmful = True
            m = c.manifest
            rep = reputation_of(table, c.author)
            c = c.with_figures(reputation=rep.score)
            history = skill_norm_history(inputs.history, c.skill, screen.history_rounds)
            if m.skill not in spec.skills:
                why = f"skill {m.skill!r} is not one of the network's"
            elif m.base_version != parent.version or m.base_hash != parent.weights_hash:
                why = f"trained on v{m.base_version} ({m.base_hash[:12]}), not on the round's v{parent.version}"
            elif trust.admission == "allowlist" and c.author not in trust.workers:
                why = "its key is not on the network's allowlist"
            elif rep.score < trust.min_reputation:
                why = (f"its key's reputation {rep.score:.2f} ({rep.included} included, {rep.rejected} rejected) "
                       f"is below the network's floor {trust.min_reputation:g}")
            elif inputs.online is not None and c.author not in inputs.online:
                why, harmful = "its worker is not online (no live peer record): its blob may never arrive", False
            elif m.size > limit:
                why = f"it announces {m.size} bytes; no encoding of this model needs more than {limit}"
            else:
                why = norm_outlier(m.norm, history, spec.screen.min_norm_ratio, spec.merge.max_norm_ratio)
                why = None if why is None else f"its manifest's {why}"
            if why is None:
                out.append(c)
            else:
                rejected.append(reject(inputs, c, self.name, why, {**c.figures, "claimed_norm": m.norm},
                                       harmful=harmful))
        return Verdict(tuple(out), tuple(rejected))


def slot_order(inputs: RoundInputs, candidates: Sequence[Candidate],
               table: dict[str, Reputation]) -> list[Candidate]:
    """`candidates` in the order they take the round's slots (the module docstring): tier, score, the round's draw
    per key, then each key's own order."""
    def rank(c: Candidate) -> tuple:
        rep = reputation_of(table, c.author)
        return (rep.slot_tier, -rep.score, inputs.lot(c.author), c.manifest.created, c.manifest.blob)

    return sorted(candidates, key=rank)


@dataclass
class Caps:
    """At most `max_deltas_per_author` per key (its earliest) and `max_deltas_per_round` in all (in `slot_order`);
    what is left out is counted in the manifest's `omitted`."""

    name: str = "caps"

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        trust = inputs.spec.trust
        table = reputations(inputs.history, trust.reputation_rounds)
        per_author: dict[str, int] = {}
        kept = []
        for c in sorted(state.candidates, key=lambda c: (c.manifest.created, c.manifest.blob)):
            per_author[c.author] = per_author.get(c.author, 0) + 1
            if per_author[c.author] <= trust.max_deltas_per_author:
                kept.append(c)
        out = slot_order(inputs, kept, table)[:trust.max_deltas_per_round]
        return Verdict(tuple(sorted(out, key=lambda c: c.manifest.blob)), omitted=len(state.candidates) - len(out))
