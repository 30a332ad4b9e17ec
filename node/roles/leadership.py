"""Who runs a round when a network has several coordinators: one leader per round, the others check its merge.

The round on checkpoint v is led by the first of the network's coordinators, in the list rotated by v, that is
online (its heartbeat alive): every coordinator computes the same order, and the lead passes round by round. A
leader that goes offline is passed over once its heartbeat expires; one still online but silent past
`RoundPolicy.overdue_s` after the round began is passed over too, and so on down the order. Whoever leads, a
checkpoint counts only once the network's quorum of coordinators signed it (protocol/quorum.py), so a race
between two would-be leaders yields at most one accepted checkpoint when the quorum is a majority.
"""

from __future__ import annotations

from typing import Sequence


def round_order(coordinators: Sequence[str], version: int) -> list[str]:
    """The order in which the coordinators lead the round on checkpoint `version`: the list rotated by `version`."""
    if not coordinators:
        return []
    i = version % len(coordinators)
    return list(coordinators[i:]) + list(coordinators[:i])


def round_leader(coordinators: Sequence[str], version: int, online: set[str], elapsed_s: float,
                 overdue_s: float) -> str | None:
    """The coordinator that leads the round on `version` now: the first online one in `round_order`, passed over
    (for the next online one) each time another `overdue_s` of the round goes by; None when none is online."""
    live = [c for c in round_order(coordinators, version) if c in online]
    if not live:
        return None
    skips = int(max(0.0, elapsed_s) // overdue_s) if overdue_s > 0 else 0
    return live[min(skips, len(live) - 1)]
