"""Caps on what one DHT peer stores, so that no author, no key and no flood can fill it.

hivemind's validators see one value at a time and cannot count, so the caps live where values are stored:
`install` (run inside the DHT process right after start) puts a `CappedStorage` in place of the DHT
node's `protocol.storage` and `protocol.cache`, and each admits every (key, subkey) value through a
`Ledger` that counts the live values:

- per author (the owner of the subkey): at most `MAX_VALUES_PER_AUTHOR[kind]` values of each record kind
  and `MAX_BYTES_PER_AUTHOR` bytes. Over either, the author's oldest values (by the record's `created`)
  make room for a newer one and an older one is refused: a flood only ever displaces its own author's
  values, and an honest node that keeps republishing its history still gets its newest records stored;
- per key at most `MAX_SUBKEYS_PER_KEY` values, and over all keys at most `MAX_PEER_BYTES` bytes (storage
  and cache together): over either, the store is refused.

Replacing a (key, subkey) never counts twice, and a value stops counting at its expiration (hivemind
drops expired values lazily; the ledger forgets them on its own clock). A refused store returns False,
like any store hivemind rejects. Reads hand out copies: hivemind merges what other peers return into the
dictionary a local read gave it, which would otherwise slip values into storage past the caps.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils.timed_storage import TimedStorage, ValueWithExpiration, get_dht_time

from skillswarm.protocol.keys import subkey_owner
from skillswarm.protocol.transport.validation import SIGNATURE_BYTES

# ---- the caps (every peer applies the same) -------------------------------------------------------
MAX_VALUES_PER_AUTHOR: dict[str, int] = {
    "peer": 4,  # one PeerRecord per network a key is in (each heartbeat replaces its own)
    "skill_stats": 64,  # one per skill a worker trains; a network has at most 64 skills
    "delta": 32,  # one per skill and round; coordinators merge only the current round's, so the newest 32 do
    "checkpoint": 512,  # one per version a coordinator keeps alive, plus its `latest`: 511 versions of history
    "provider": 2048,  # a coordinator provides every file of every version it keeps, and the deltas it merged
}
MAX_BYTES_PER_AUTHOR = 4 << 20  # all of an honest coordinator's values (manifests of a few KB, providers)
MAX_SUBKEYS_PER_KEY = 1024  # the widest keys are the peers list and a round's deltas: 1024 nodes each
MAX_PEER_BYTES = 256 << 20  # storage and cache together: 64 authors at their cap, and a bounded process


# ---- what a stored value says about itself --------------------------------------------------------
class _Header(msgspec.Struct):
    """The fields of a record the ledger needs (the rest is skipped; the validator checked it all)."""

    kind: str = ""
    created: float = 0.0


_header = msgspec.msgpack.Decoder(_Header)


def record_header(data: bytes) -> tuple[str, float] | None:
    """(kind, created) of encoded record bytes, or None if they are not a record."""
    try:
        h = _header.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError):
        return None
    return (h.kind, h.created) if h.kind in MAX_VALUES_PER_AUTHOR else None


def stored_header(value: bytes) -> tuple[str, float] | None:
    """(kind, created) of a value as a peer stores it (msgpack record bytes plus the owner signature)."""
    if not isinstance(value, bytes) or len(value) <= SIGNATURE_BYTES:
        return None
    try:
        data = msgspec.msgpack.decode(value[:-SIGNATURE_BYTES], type=bytes)
    except (msgspec.MsgspecError, ValueError, TypeError):
        return None
    return record_header(data)


# ---- the ledger -----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Entry:
    key: DHTID
    subkey: str
    author: str
    kind: str
    created: float
    expiration: float
    size: int


@dataclass
class _Budget:
    """Bytes held by every storage of one peer (its storage and its cache share it)."""

    used: int = 0


@dataclass
class Plan:
    """An admitted store: the value's entry, the entry it replaces, the entries to evict for it."""

    entry: _Entry
    replaced: _Entry | None
    evict: list[_Entry] = field(default_factory=list)


class Ledger:
    """The live values of one storage, counted per author and kind, per author, per key and in all."""

    def __init__(self, budget: _Budget | None = None) -> None:
        self.budget = budget or _Budget()
        self._entries: dict[tuple[DHTID, str], _Entry] = {}
        self._by_author: dict[str, dict[tuple[DHTID, str], _Entry]] = {}
        self._count: Counter[tuple[str, str]] = Counter()
        self._author_bytes: Counter[str] = Counter()
        self._per_key: Counter[DHTID] = Counter()
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._seq = itertools.count()

    def plan(self, key: DHTID, subkey: Any, value: Any, expiration: float) -> Plan | None:
        """Whether a store fits the caps, and what it displaces; None: refuse it."""
        self.forget_expired()
        author = subkey_owner(subkey)
        header = stored_header(value)
        if author is None or header is None:
            return None  # not a skillswarm value: the validator lets none through, so this is no peer of ours
        kind, created = header
        old = self._entries.get((key, subkey))
        if old is not None and old.expiration >= expiration:
            return None  # hivemind keeps the value that lives longer
        new = _Entry(key, subkey, author, kind, created, expiration, len(value))
        plan = Plan(new, old)
        mine = self._by_author.get(author, {})  # the value being replaced is under the same subkey: also the author's
        if self._count[author, kind] - (old is not None) >= MAX_VALUES_PER_AUTHOR[kind]:
            oldest = min((e for e in mine.values() if e.kind == kind and e is not old), key=_age)
            if _age(oldest) >= _age(new):
                return None
            plan.evict.append(oldest)
        freed = (old.size if old else 0) + sum(e.size for e in plan.evict)
        over = self._author_bytes[author] - freed + new.size - MAX_BYTES_PER_AUTHOR
        if over > 0:
            for e in sorted(mine.values(), key=_age):
                if over <= 0:
                    break
                if e is old or e in plan.evict:
                    continue
                if _age(e) >= _age(new):
                    return None
                plan.evict.append(e)
                over, freed = over - e.size, freed + e.size
            if over > 0:
                return None
        if self._per_key[key] + (old is None) - sum(e.key == key for e in plan.evict) > MAX_SUBKEYS_PER_KEY:
            return None
        if self.budget.used - freed + new.size > MAX_PEER_BYTES:
            return None
        return plan

    def commit(self, plan: Plan) -> None:
        """Count a store that `plan` admitted and hivemind made."""
        for e in [plan.replaced, *plan.evict]:
            if e is not None:
                self._remove(e)
        e = plan.entry
        self._entries[e.key, e.subkey] = e
        self._by_author.setdefault(e.author, {})[e.key, e.subkey] = e
        self._count[e.author, e.kind] += 1
        self._author_bytes[e.author] += e.size
        self._per_key[e.key] += 1
        self.budget.used += e.size
        heapq.heappush(self._expiry, (e.expiration, next(self._seq), e))
        if len(self._expiry) > 2 * len(self._entries) + 1024:  # replaced entries linger in the heap: compact it
            self._expiry = [item for item in self._expiry if self._entries.get((item[2].key, item[2].subkey)) is item[2]]
            heapq.heapify(self._expiry)

    def forget_expired(self) -> None:
        """Stop counting values past their expiration (hivemind drops them on its next look)."""
        now = get_dht_time()
        while self._expiry and self._expiry[0][0] < now:
            _, _, e = heapq.heappop(self._expiry)
            if self._entries.get((e.key, e.subkey)) is e:
                self._remove(e)

    def _remove(self, e: _Entry) -> None:
        if self._entries.get((e.key, e.subkey)) is not e:
            return
        del self._entries[e.key, e.subkey]
        mine = self._by_author[e.author]
        del mine[e.key, e.subkey]
        if not mine:
            del self._by_author[e.author]
        _decrease(self._count, (e.author, e.kind), 1)
        _decrease(self._author_bytes, e.author, e.size)
        _decrease(self._per_key, e.key, 1)
        self.budget.used -= e.size

    def usage(self) -> dict[str, Any]:
        """What is counted now: values and bytes in all, per author (bytes, values per kind) and per key id."""
        self.forget_expired()
        authors: dict[str, dict[str, Any]] = {}
        for (author, kind), n in self._count.items():
            a = authors.setdefault(author, {"bytes": self._author_bytes[author], "values": {}})
            a["values"][kind] = n
        return {"values": len(self._entries), "bytes": sum(self._author_bytes.values()), "peer_bytes": self.budget.used,
                "authors": authors, "keys": {k.to_bytes().hex(): n for k, n in self._per_key.items()}}


def _decrease(counter: Counter, name: Any, by: int) -> None:
    counter[name] -= by
    if counter[name] <= 0:
        del counter[name]


def _age(e: _Entry) -> tuple[float, float]:
    """Which of an author's values is older: created first, then the one expiring sooner."""
    return e.created, e.expiration


# ---- the storage hivemind uses --------------------------------------------------------------------
class CappedStorage(DHTLocalStorage):
    """A DHT node's storage (or cache) that admits values through a `Ledger`; reads hand out copies."""

    def __init__(self, maxsize: Optional[int] = None, budget: _Budget | None = None) -> None:
        super().__init__(maxsize)
        self.ledger = Ledger(budget)

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Called for every value a peer asks us to store or cache: True if stored."""
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if isinstance(value, DictionaryDHTValue):  # a whole dictionary: what a search found, being cached
            with value.freeze():
                items = list(value.items())
            return any([self.store_subkey(key, s, v, e) for s, (v, e) in items])
        return False  # skillswarm stores every value under an owner subkey; a plain value is never valid

    def store_subkey(self, key: DHTID, subkey: Any, value: Any, expiration_time: float) -> bool:
        """Store one (subkey, value) of a key's dictionary if the caps admit it (see the module docstring)."""
        if expiration_time < get_dht_time():
            return False
        plan = self.ledger.plan(key, subkey, value, expiration_time)
        if plan is None:
            return False
        current = TimedStorage.get(self, key)
        if current is None or not isinstance(current.value, DictionaryDHTValue):
            values = DictionaryDHTValue()
            stored = values.store(subkey, value, expiration_time)
            TimedStorage.store(self, key, values, expiration_time)
        else:
            values = current.value
            if expiration_time > current.expiration_time:  # a key lives as long as its longest-lived value
                TimedStorage.store(self, key, values, expiration_time)
            stored = values.store(subkey, value, expiration_time)
        if stored:
            for e in plan.evict:
                self._drop(e.key, e.subkey)
            self.ledger.commit(plan)
        return stored

    def _drop(self, key: DHTID, subkey: Any) -> None:
        current = TimedStorage.get(self, key)
        if current is not None and isinstance(current.value, DictionaryDHTValue):
            del current.value[subkey]
            if not current.value:
                del self[key]

    def get(self, key: DHTID) -> Optional[ValueWithExpiration]:
        """A copy of what is stored under `key` (callers may merge into it without touching the storage)."""
        item = TimedStorage.get(self, key)
        if item is None or not isinstance(item.value, DictionaryDHTValue):
            return item
        copy = DictionaryDHTValue()
        for subkey, (value, expiration) in item.value.items():
            copy.store(subkey, value, expiration)
        return ValueWithExpiration(copy, item.expiration_time)


def install(node: Any) -> None:
    """Replace a running DHT node's storage and cache with capped ones that share one byte budget, keeping
    what they already hold within the caps (values may arrive while the node joins, before this runs)."""
    budget = _Budget()
    protocol = node.protocol
    for name in ("storage", "cache"):
        old = getattr(protocol, name)
        if isinstance(old, CappedStorage):
            continue
        new = CappedStorage(maxsize=old.maxsize if old.maxsize != float("inf") else None, budget=budget)
        for key, item in list(old.items()):
            new.store(key, item.value, item.expiration_time)
        setattr(protocol, name, new)


# ---- what a reader keeps --------------------------------------------------------------------------
def newest_within_caps(entries: dict[str, tuple[bytes, float]]) -> dict[str, tuple[bytes, float]]:
    """One key's values as a read returned them (subkey -> record bytes, expiration), less each author's
    oldest beyond its per-kind cap: values merged from several peers could add up past what one peer holds."""
    groups: dict[tuple[str, str], list[tuple[tuple[float, float], str]]] = defaultdict(list)
    for subkey, (data, expiration) in entries.items():
        header, author = record_header(data), subkey_owner(subkey)
        if header is not None and author is not None:
            groups[author, header[0]].append(((header[1], expiration), subkey))
    out = dict(entries)
    for (_author, kind), found in groups.items():
        for _, subkey in sorted(found, reverse=True)[MAX_VALUES_PER_AUTHOR[kind]:]:
            del out[subkey]
    return out
