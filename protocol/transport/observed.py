"""Which providers a node asks first, from what it saw them do (`Observed`), never from what their records claim:
those that delivered when last asked (fastest first), then those that delivered before, then unknown ones this node
sees running, then other unknown ones (each group shuffled), those that failed last; at most `MAX_PROVIDERS`, so a
flood of records for keys nobody runs fills only the places after the ones seen. Runs in the DHT process."""

from __future__ import annotations

import contextlib
import random
from collections import OrderedDict

import hivemind

MAX_PROVIDERS = 32  # providers one blob's download considers (what `SwarmDHT.get_providers` returns at most)
MAX_OBSERVED = 4096  # providers this node remembers


class _Seen:
    """What this node saw of one provider: attempts that delivered bytes (how many, in how long), and failures."""

    __slots__ = ("delivered", "failed", "bytes", "seconds", "last_ok")

    def __init__(self) -> None:
        self.delivered, self.failed, self.bytes, self.seconds, self.last_ok = 0, 0, 0, 0.0, False

    @property
    def rate(self) -> float:
        return self.bytes / max(self.seconds, 1e-3)


class Observed:
    """(In the DHT process) what this node saw of the providers it fetched from, by peer id (the MAX_OBSERVED
    seen last), and the order in which it asks them: never by anything a record claims about itself.

    `order`: providers that delivered when last asked, fastest first; then those that delivered before but failed
    when last asked; then those never asked that this node sees running (in its DHT routing table, or connected:
    a key with no running node behind it is never there), in random order; then the others never asked, in
    random order; then those that only failed, fewest failures first (one that sent bad bytes last). At most
    `limit` of them: a flood of records for keys nobody runs fills only the places after the ones seen."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, _Seen] = OrderedDict()
        self._random = random.SystemRandom()

    def _entry(self, peer: str) -> _Seen:
        entry = self._peers.pop(peer, None) or _Seen()
        self._peers[peer] = entry
        while len(self._peers) > MAX_OBSERVED:
            self._peers.popitem(last=False)
        return entry

    def delivered(self, peer: str, n: int, seconds: float) -> None:
        """`peer` sent `n` bytes in `seconds` (an attempt that delivered something)."""
        entry = self._entry(peer)
        entry.delivered += 1
        entry.bytes += n
        entry.seconds += seconds
        entry.last_ok = True

    def failed(self, peer: str, lied: bool = False) -> None:
        """`peer` did not answer, refused, trickled or broke before sending anything; or (`lied`) sent bad bytes."""
        entry = self._entry(peer)
        entry.failed += 1
        entry.last_ok = False
        if lied:  # whatever it delivered before counts for nothing
            entry.delivered, entry.failed = 0, entry.failed + 1000

    def order(self, peer_ids: list[str], live: set[str], limit: int | None = None) -> list[str]:
        """`peer_ids` (each once) in the order to ask them, at most `limit`; `live`: peers this node sees running."""
        good, mixed, live_new, new, bad = [], [], [], [], []
        for peer in dict.fromkeys(peer_ids):
            entry = self._peers.get(peer)
            if entry is None:
                (live_new if peer in live else new).append(peer)
            elif entry.delivered and entry.last_ok:
                good.append(peer)
            elif entry.delivered:
                mixed.append(peer)
            else:
                bad.append(peer)
        good.sort(key=lambda p: -self._peers[p].rate)
        mixed.sort(key=lambda p: self._peers[p].failed - self._peers[p].delivered)
        self._random.shuffle(live_new)
        self._random.shuffle(new)
        bad.sort(key=lambda p: self._peers[p].failed)
        ordered = good + mixed + live_new + new + bad
        return ordered if limit is None else ordered[:limit]


def observed(dht: hivemind.DHT) -> Observed:
    """(In the DHT process) this node's `Observed` providers."""
    return dht.__dict__.setdefault("_skillswarm_observed", Observed())


async def _live(node: hivemind.DHTNode) -> set[str]:
    """Peer ids this node sees running: itself, its DHT routing table, the peers p2pd holds connections to."""
    live = {node.peer_id.to_base58()}
    live.update(peer.to_base58() for peer in list(node.protocol.routing_table.uid_to_peer_id.values()))
    with contextlib.suppress(Exception):
        live.update(info.peer_id.to_base58() for info in await node.p2p.list_peers())
    return live


async def live_peers(_dht: hivemind.DHT, node: hivemind.DHTNode) -> list[str]:
    """(In the DHT process) the peer ids this node sees running (`_live`)."""
    return sorted(await _live(node))


async def provider_order(dht: hivemind.DHT, node: hivemind.DHTNode, peer_ids: list[str],
                         limit: int | None = MAX_PROVIDERS) -> list[str]:
    """(In the DHT process) the providers `peer_ids` in the order this node asks them, at most `limit` (`Observed`)."""
    return observed(dht).order(peer_ids, await _live(node), limit)
