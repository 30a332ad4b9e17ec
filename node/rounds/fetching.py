"""Fetching a round's deltas: every surviving candidate's blob, concurrently, within the round's budget.

Each download also has its own deadline from its size and a minimum rate (the transfer layer's), so a
provider that trickles bytes costs at most that; whatever is not in when `fetch_budget_s` runs out is
rejected as unavailable. The size a download may reach is the smaller of what the manifest announced and
what any encoding of this model can need, so a lying provider cannot fill the disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skillswarm.node.rounds.context import Candidate, RoundContext

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
            results = ctx.dht.fetch_many([(c.manifest.blob, c.manifest.size, min(c.manifest.size, limit)) for c in todo],
                                         budget_s=ctx.spec.round.fetch_budget_s, store=ctx.blobs,
                                         max_parallel=self.max_parallel, progress=ctx.progress)
            for c in todo:
                got = results.get(c.manifest.blob)
                if isinstance(got, Path):
                    c.path = got
                else:
                    ctx.reject(c, self.name, f"blob unavailable: {got}", harmful=False)
        return [c for c in candidates if c.path is not None]
