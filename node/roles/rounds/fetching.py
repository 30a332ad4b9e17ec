"""Fetching a round's deltas: every surviving candidate's blob, concurrently, within the round's budget.

Each download also has its own deadline from its size and a minimum rate (the transfer layer's), so a
provider that trickles bytes costs at most that; whatever is not in when `fetch_budget_s` runs out is
rejected as unavailable, with the figure `no_show` (not harmful: an honest uplink can fail; but a key whose
no-shows outnumber its inclusions takes a round's slots last, reputation.py). The size a download may reach is the
smaller of what the manifest announced and what any encoding of this model can need, so a lying provider cannot
fill the disk. A blob two manifests name (a re-signed copy) is downloaded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from msgspec import UNSET

from skillswarm.node.roles.rounds.state import NO_SHOW_FIGURE, Candidate, Rejected, RoundInputs, RoundState, Verdict, reject

MAX_PARALLEL = 4  # downloads at once: enough to hide one slow provider, few enough for a home uplink


@dataclass
class Fetch:
    """Download every candidate's blob (see the module docstring)."""

    name: str = "fetch"
    max_parallel: int = MAX_PARALLEL

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        candidates = state.candidates
        todo = [c for c in candidates if c.path is None]
        if not todo:
            return Verdict(candidates)
        if inputs.dht is None:
            raise RuntimeError("the fetch step needs a DHT (or candidates that arrive with their files)")
        limit = inputs.max_delta_bytes
        sizes: dict[str, set[int]] = {}
        trees: dict[str, set[str | None]] = {}
        for c in todo:
            sizes.setdefault(c.manifest.blob, set()).add(c.manifest.size)
            trees.setdefault(c.manifest.blob, set()).add(None if c.manifest.tree is UNSET else c.manifest.tree)
        # one download per blob; where its manifests disagree on its size (a copy re-signed with another), the
        # download takes the hash's word, not either manifest's, so a lying copy cannot fail the original's fetch
        # with its tree hash, from every holder at once; where manifests disagree on it, from one provider at a time
        results = inputs.dht.fetch_many([(blob, next(iter(s)) if len(s) == 1 else None, min(max(s), limit),
                                          next(iter(trees[blob])) if len(trees[blob]) == 1 else None)
                                         for blob, s in sizes.items()],
                                        budget_s=inputs.spec.round.fetch_budget_s, store=inputs.blobs,
                                        max_parallel=self.max_parallel, progress=inputs.progress)
        out: list[Candidate] = []
        rejected: list[Rejected] = []
        for c in candidates:
            if c.path is not None:
                out.append(c)
                continue
            got = results.get(c.manifest.blob)
            if not isinstance(got, Path):
                rejected.append(reject(inputs, c, self.name, f"blob unavailable: {got}",
                                       {**c.figures, NO_SHOW_FIGURE: 1.0}, harmful=False))
            elif len(sizes[c.manifest.blob]) > 1 and got.stat().st_size != c.manifest.size:
                rejected.append(reject(inputs, c, self.name, f"its manifest announces {c.manifest.size} bytes; "
                                                             f"the blob has {got.stat().st_size}"))
            else:
                out.append(c.but(path=got))
        return Verdict(tuple(out), tuple(rejected))
