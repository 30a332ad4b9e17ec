"""Keeping records alive: the DHT forgets everything at its expiration, so a node re-stores what it
wants kept (its heartbeat, provider records, manifests) from one background thread."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.records import Record


class Storer(Protocol):
    """What the republisher needs of a DHT handle (SwarmDHT): storing one record with a time to live."""

    def put(self, record: Record, ttl: float, **kwargs: Any) -> Any: ...

logger = logging.getLogger(__name__)


class Republisher(threading.Thread):
    """Re-stores kept records and heartbeats in the background, each item on its own interval; one
    failed round is logged and retried on the next."""

    def __init__(self, dht: Storer) -> None:
        super().__init__(name="skillswarm-republish", daemon=True)
        self._dht = dht
        self._items: dict[tuple, tuple[Callable[[], list[Record]], float, float, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self.start()

    def keep(self, name: tuple, produce: Callable[[], list[Record]], interval: float, ttl: float) -> None:
        """(Re)register item `name`: every `interval` s, store what `produce()` returns with `ttl`."""
        with self._lock:
            self._items[name] = (produce, interval, ttl, time.monotonic() + interval)
        self._wake.set()

    def refresh(self) -> None:
        """Re-store every item now (a peer that held them came back empty), then on their usual intervals."""
        with self._lock:
            now = time.monotonic()
            self._items = {n: (produce, interval, ttl, now) for n, (produce, interval, ttl, _) in self._items.items()}
        self._wake.set()

    def drop(self, name: tuple) -> None:
        """Stop re-storing item `name` (what was stored expires on its own)."""
        with self._lock:
            self._items.pop(name, None)

    def stop(self) -> None:
        """End the thread (waits for a store in flight)."""
        self._stopped = True
        self._wake.set()
        self.join(10)

    def run(self) -> None:
        while not self._stopped:
            with self._lock:
                due = [(n, item) for n, item in self._items.items() if item[3] <= time.monotonic()]
                next_due = min((item[3] for item in self._items.values()), default=time.monotonic() + 3600)
            for name, (produce, interval, ttl, _) in due:
                with self._lock:
                    if name in self._items:
                        self._items[name] = (produce, interval, ttl, time.monotonic() + interval)
                try:
                    for record in produce():
                        self._dht.put(record, ttl)
                except SkillswarmError as e:
                    logger.warning("could not re-announce %s: %s", name[0], e)
                except Exception:  # a heartbeat must never die silently
                    logger.exception("re-announcing %s failed", name[0])
            if not due:
                self._wake.wait(max(0.0, min(next_due - time.monotonic(), 5.0)))
                self._wake.clear()
