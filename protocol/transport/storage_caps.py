"""Caps on what one DHT peer stores, so that no author, no key and no flood can fill it.

hivemind's validators see one value at a time and cannot count, so the caps live where values are stored:
`install` (run inside the DHT process right after start) puts a `CappedStorage` in place of the DHT
node's `protocol.storage` and `protocol.cache`, and each admits every (key, subkey) value through a
`Ledger` that counts the live values:

- per author (the owner of the subkey): at most `MAX_VALUES_PER_AUTHOR[kind]` values of each record kind
  and `MAX_BYTES_PER_AUTHOR` bytes. Over either, the author's oldest values make room for a newer one and an
  older one is refused: a flood by one key only ever displaces that key's own values, and an honest node that
  keeps republishing its history still gets its newest records stored. Between one author's own values,
  "oldest" is by their `created` (then first-seen): the author's own word decides only between its own
  values, every peer keeps the same ones (a reader merging several peers' gets no more than the cap), and
  nobody can push an author's new values out by replaying its old ones. The validator holds `created` within
  the kind's lifetime and a minute of the clock, so no value stays "newest" forever;
- per key at most `MAX_SUBKEYS_PER_KEY` values and `MAX_BYTES_PER_KEY` bytes, so that a read of the fullest
  key (hivemind sends a key's whole dictionary in one message) stays far below hivemind's message limit.
  Over either, the flooder's values go first: the author holding the most values under that key loses its
  oldest (between authors holding as many, the oldest value of them all goes), until the new value fits.
  An honest node's heartbeat, a new value every few seconds, is the newest there is; a flood from fresh
  keys displaces the values stored before it, oldest first, and a new node's heartbeat gets in;
- over all keys at most `MAX_PEER_BYTES` bytes (storage and cache together): over it, the store is refused.

Between authors, "oldest" is by when THIS peer first stored the value (a counter of the ledger, kept when the
same record arrives again), never by the record's `created`, which its author writes as it likes. Replacing a (key,
subkey) never counts twice, and a value stops counting at its expiration (hivemind drops expired values
lazily; the ledger forgets them on its own clock). A refused store returns False, like any store hivemind
rejects. Reads hand out copies: hivemind merges what other peers return into the dictionary a local read
gave it, which would otherwise slip values into storage past the caps.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
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
    "archived": 512,  # an archive node's copies: one per version, plus its `latest`
}
MAX_BYTES_PER_AUTHOR = 4 << 20  # all of an honest coordinator's values (manifests of a few KB, providers)
MAX_SUBKEYS_PER_KEY = 1024  # the widest keys are the peers list and a round's deltas: 1024 nodes each
# A read of one key is one message carrying the key's whole dictionary (`rpc_find`), and p2pd refuses a message
# over DEFAULT_MAX_MSG_SIZE (4 MiB; the asker then gets nothing at all from that peer). A quarter of it: 1024
# honest heartbeats (~0.5-1 KB each) fit, a full key's read is ~1 MiB, and a message asking a few keys at once
# (hivemind packs up to sqrt(keys) in one) still fits. 1024 PeerRecords at their 8 KiB cap would be 8 MiB.
MAX_BYTES_PER_KEY = DEFAULT_MAX_MSG_SIZE // 4
# What one value adds to a key's message beyond its bytes: its msgpack subkey (an owner subkey, up to 130
# bytes), its expiration and the framing of the (subkey, value, expiration) entry.
ENTRY_OVERHEAD = 160
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
    created: float  # the author's word: orders only the author's own values
    expiration: float
    size: int  # the value's bytes, as stored (counted per author and per peer)
    seen: int  # when this peer first stored this record: the ledger's counter, older is lower
    digest: bytes  # of the record bytes (without the owner signature, which changes with each re-store)

    @property
    def cost(self) -> int:
        """What the value adds to a read of its key (counted per key)."""
        return self.size + ENTRY_OVERHEAD


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
        self._by_key: dict[DHTID, dict[str, _Entry]] = {}
        self._count: Counter[tuple[str, str]] = Counter()
        self._author_bytes: Counter[str] = Counter()
        self._key_bytes: Counter[DHTID] = Counter()
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._seq = itertools.count()
        self._seen = itertools.count()

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
        digest = hashlib.blake2b(value[:-SIGNATURE_BYTES], digest_size=16).digest()
        seen = old.seen if old is not None and old.digest == digest else next(self._seen)  # the same record, re-stored
        new = _Entry(key, subkey, author, kind, created, expiration, len(value), seen, digest)
        plan = Plan(new, old)
        gone = {id(old)} if old is not None else set()
        mine = self._by_author.get(author, {}).values()  # the replaced value is the author's too
        if self._count[author, kind] - (old is not None) >= MAX_VALUES_PER_AUTHOR[kind]:
            oldest = min((e for e in mine if e.kind == kind and id(e) not in gone), key=_own_age)
            if _own_age(oldest) >= _own_age(new):
                return None
            plan.evict.append(oldest)
            gone.add(id(oldest))
        over = self._author_bytes[author] - sum(e.size for e in _of(plan)) + new.size - MAX_BYTES_PER_AUTHOR
        if over > 0:
            for e in sorted(mine, key=_own_age):
                if over <= 0:
                    break
                if id(e) not in gone:
                    if _own_age(e) >= _own_age(new):
                        return None
                    plan.evict.append(e)
                    gone.add(id(e))
                    over -= e.size
            if over > 0:
                return None
        victims = self._key_victims(new, _of(plan))
        if victims is None:
            return None
        plan.evict += victims
        if self.budget.used - sum(e.size for e in _of(plan)) + new.size > MAX_PEER_BYTES:
            return None
        return plan

    def _key_victims(self, new: _Entry, leaving: list[_Entry]) -> list[_Entry] | None:
        """The values of `new`'s key that make room for it besides those `leaving` anyway: while the key is over
        its count or byte cap, the oldest value of the authors holding the most values under it (the new one
        counted). None: nothing can make room."""
        here = self._by_key.get(new.key, {})
        leaving = [e for e in leaving if here.get(e.subkey) is e]
        count = len(here) - len(leaving) + 1
        size = self._key_bytes[new.key] - sum(e.cost for e in leaving) + new.cost
        if count <= MAX_SUBKEYS_PER_KEY and size <= MAX_BYTES_PER_KEY:
            return []
        gone = {id(e) for e in leaving}
        live = [e for e in here.values() if id(e) not in gone]
        count, size = len(live) + 1, sum(e.cost for e in live) + new.cost
        held = Counter(e.author for e in live)
        held[new.author] += 1
        queue: dict[str, list[_Entry]] = defaultdict(list)  # each author's values under the key, oldest last
        for e in sorted(live, key=_age, reverse=True):
            queue[e.author].append(e)
        victims = []
        while count > MAX_SUBKEYS_PER_KEY or size > MAX_BYTES_PER_KEY:
            if not queue:
                return None  # the new value alone is over the key's caps (no record is that big)
            most = max(held[a] for a in queue)
            author = min((a for a in queue if held[a] == most), key=lambda a: _age(queue[a][-1]))
            e = queue[author].pop()
            if not queue[author]:
                del queue[author]
            held[author] -= 1
            victims.append(e)
            count, size = count - 1, size - e.cost
        return victims

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
        self._by_key.setdefault(e.key, {})[e.subkey] = e
        self._key_bytes[e.key] += e.cost
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
        here = self._by_key[e.key]
        del here[e.subkey]
        if not here:
            del self._by_key[e.key]
        _decrease(self._key_bytes, e.key, e.cost)
        self.budget.used -= e.size

    def usage(self) -> dict[str, Any]:
        """What is counted now: values and bytes in all, per author (bytes, values per kind), values per key id
        (`keys`) and what a read of each key carries (`key_bytes`: its values and their framing)."""
        self.forget_expired()
        authors: dict[str, dict[str, Any]] = {}
        for (author, kind), n in self._count.items():
            a = authors.setdefault(author, {"bytes": self._author_bytes[author], "values": {}})
            a["values"][kind] = n
        return {"values": len(self._entries), "bytes": sum(self._author_bytes.values()), "peer_bytes": self.budget.used,
                "authors": authors, "keys": {k.to_bytes().hex(): len(v) for k, v in self._by_key.items()},
                "key_bytes": {k.to_bytes().hex(): n for k, n in self._key_bytes.items()}}


def _decrease(counter: Counter, name: Any, by: int) -> None:
    counter[name] -= by
    if counter[name] <= 0:
        del counter[name]


def _of(plan: Plan) -> list[_Entry]:
    """The entries a plan frees: the one it replaces and those it evicts."""
    return [e for e in (plan.replaced, *plan.evict) if e is not None]


def _age(e: _Entry) -> int:
    """Which of two authors' values is older: the one this peer stored first (never the author's `created`)."""
    return e.seen


def _own_age(e: _Entry) -> tuple[float, int]:
    """Which of one author's values is older: by the author's `created`, then the one this peer stored first."""
    return e.created, e.seen


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
    oldest beyond its per-kind cap: values merged from several peers could add up past what one peer holds.
    A reader has no first-seen order of its own, so "oldest" is by the records' `created` here: it only ever
    decides between one author's own values, and every peer's validator holds `created` within the kind's
    lifetime and `CLOCK_SKEW` of its clock."""
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
