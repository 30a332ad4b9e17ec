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

from skillswarm.node.rounds.context import NO_SHOW_FIGURE, Candidate, RoundContext

MAX_PARALLEL = 4  # downloads at once: enough to hide one slow provider, few enough for a home uplink


@dataclass
class Fetch:
    """Download every candidate's blob (see the module docstring)."""

    name: str = "fetch"
    max_parallel: int = MAX_PARALLEL

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        todo = [c for c in candidates if c.path is None]
        if todo:
            if ctx.dht is None:
                raise RuntimeError("the fetch step needs a DHT (or candidates that arrive with their files)")
            limit = ctx.max_delta_bytes
            sizes: dict[str, set[int]] = {}
            for c in todo:
                sizes.setdefault(c.manifest.blob, set()).add(c.manifest.size)
            # one download per blob; where its manifests disagree on its size (a copy re-signed with another), the
            # download takes the hash's word, not either manifest's, so a lying copy cannot fail the original's fetch
            results = ctx.dht.fetch_many([(blob, next(iter(s)) if len(s) == 1 else None, min(max(s), limit))
                                          for blob, s in sizes.items()],
                                         budget_s=ctx.spec.round.fetch_budget_s, store=ctx.blobs,
                                         max_parallel=self.max_parallel, progress=ctx.progress)
            for c in todo:
                got = results.get(c.manifest.blob)
                if not isinstance(got, Path):
                    ctx.reject(c, self.name, f"blob unavailable: {got}", {**c.figures, NO_SHOW_FIGURE: 1.0},
                               harmful=False)
                elif len(sizes[c.manifest.blob]) > 1 and got.stat().st_size != c.manifest.size:
                    ctx.reject(c, self.name, f"its manifest announces {c.manifest.size} bytes; the blob has "
                                             f"{got.stat().st_size}")
                else:
                    c.path = got
        return [c for c in candidates if c.path is not None]
