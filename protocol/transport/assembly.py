"""The local side of a swarming download (`swarm`): its partial file, which pieces are held and who fetches
which (`Assembly`: claims, the endgame, the hash cursor that folds verified pieces in order into the whole
blob's sha256), and the per-stream `Checker` that verifies each piece before a byte of it is written."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import random
import threading
import time
from pathlib import Path

from skillswarm.protocol.atomic import WriteBehind
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.transport.blobs import SYNC_EVERY, BlobStore, partial_pieces_path, remember
from skillswarm.protocol.transport.receiving import Clock, Rejected, Stopped
from skillswarm.protocol.transport.pieces import PIECE_SIZE, digest_of, pack_bits, piece_span
from skillswarm.protocol.transport.wire import FetchReport

MAX_RUN = 64  # the most pieces one request asks for
ENDGAME_AFTER_S = 2.0  # a piece claimed this long ago may be fetched again by an idle provider


class PieceFile:
    """The partial file of a piece-by-piece download: locked (flock) against any other fetch of the blob,
    written in place; its verified piece list lies beside it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd
        self.listed = partial_pieces_path(path)

    @classmethod
    def open(cls, path: Path, final: Path, wait_s: float) -> PieceFile | None:
        """Lock the partial file (waiting up to `wait_s` for another fetch); None if the blob is complete."""
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while not final.is_file():
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    raise BlobError(f"another fetch of blob {final.name[:12]} holds {path}; try again later") from None
                time.sleep(0.2)
                continue
            if final.is_file():
                os.close(fd)
                return None
            return cls(path, fd)
        return None

    def saved_list(self) -> bytes | None:
        try:
            return self.listed.read_bytes()
        except FileNotFoundError:
            return None

    def reset(self) -> None:
        """Throw every byte and the piece list away."""
        os.ftruncate(self.fd, 0)
        self.listed.unlink(missing_ok=True)

    def close(self, *, remove: bool) -> None:
        if remove:
            self.path.unlink(missing_ok=True)
            self.listed.unlink(missing_ok=True)
        os.close(self.fd)


class Assembly:
    """The shared state of one download: which pieces are held, who is fetching which, the report, and the
    hash cursor. Every method that changes it holds `cond`."""

    def __init__(self, sha: str, size: int, piece_list: bytes, have: list[bool], part: PieceFile,
                 report: FetchReport, clock: Clock) -> None:
        self.sha, self.size, self.piece_list, self.part = sha, size, piece_list, part
        self.report, self.clock = report, clock
        self.n = len(have)
        self.done = have
        self.owners: list[set[str]] = [set() for _ in range(self.n)]
        self.claimed_at = [0.0] * self.n
        self.stopped = False  # every provider thread has ended
        self.missing = have.count(False)
        self.cond = threading.Condition()
        self.fatal: BaseException | None = None
        self.rejected: set[str] = set()
        self.slow: dict[str, int] = {}
        self.tried: list[str] = []
        self.whole = hashlib.sha256()
        self.cursor = 0  # pieces [0, cursor) are folded into `whole`
        self.offers: dict[str, set[int]] = {}  # what providers still downloading it hold (others: everything)
        self.unanswered: dict[str, int] = {}  # providers that did not say what they hold, times in a row
        self.delivered: dict[str, int] = {}  # verified bytes each provider delivered
        self.offered_at: dict[int, float] = {}  # when a partial provider first offered each piece
        self.known: set[str] = set()  # providers this download has heard of (`add_sources`)
        self.incoming: list = []  # providers announced since it started, not yet fetched from (`wire.Source`)
        self._rank = random.sample(range(self.n), self.n)  # this download's tie-break between equally rare pieces
        self._writeback = WriteBehind(part.fd, SYNC_EVERY)

    # ---- claims -------------------------------------------------------------------------------------
    def claim(self, peer: str, workers: int) -> list[int] | None:
        """The next run of pieces for `peer` to fetch: missing pieces nobody fetches, rarest first; when
        none is left, the last piece another provider claimed over ENDGAME_AFTER_S ago (endgame). None: nothing
        to claim now."""
        with self.cond:
            now = time.monotonic()
            offer = self.offers.get(peer)
            wanted = [i for i in range(self.n) if not self.done[i] and (offer is None or i in offer)]
            if offer is None and self.offers:
                # A provider holding the whole blob (a seed: the publisher, a node done pulling) is left the pieces
                # no partial provider offers, or that one has left unclaimed for ENDGAME_AFTER_S: pieces spread
                # between pullers instead of coming from the seed again and again.
                spread = {i for p, o in self.offers.items() if p not in self.rejected for i in o}
                wanted = [i for i in wanted if i not in spread or (not self.owners[i] and now - max(
                    self.offered_at.get(i, now), self.claimed_at[i]) > ENDGAME_AFTER_S)]
            free = [i for i in wanted if not self.owners[i]]
            if free:
                # Rarest first (fewest partial providers hold it), ties in this download's random order: pullers
                # that start together ask a seeder for different pieces, which they can then trade.
                first = min(range(len(free)), key=lambda k: (sum(free[k] in o for o in self.offers.values()),
                                                             self._rank[free[k]]))
                run_len = max(1, min(MAX_RUN, len(free) // (2 * max(1, workers))))
                run = [free[first]]
                for i in free[first + 1:first + run_len]:
                    if i != run[-1] + 1:
                        break
                    run.append(i)
            else:
                spare = [i for i in wanted if peer not in self.owners[i]
                         and len(self.owners[i]) < 2 and now - self.claimed_at[i] > ENDGAME_AFTER_S]
                if not spare:
                    return None
                run = [spare[-1]]  # the owner fetches its run in order: the last piece is the furthest off
            for i in run:
                if not self.owners[i]:
                    self.claimed_at[i] = now
                self.owners[i].add(peer)
            return run

    def release(self, peer: str, run: list[int]) -> None:
        """`peer` no longer fetches these pieces (the ones it did not deliver go back to the pool)."""
        with self.cond:
            for i in run:
                self.owners[i].discard(peer)
            self.cond.notify_all()

    def offer(self, peer: str, held: list[bool]) -> None:
        """`peer` holds the pieces flagged (all of them: it is no longer a partial provider)."""
        with self.cond:
            if all(held):
                self.offers.pop(peer, None)
            else:
                self.offers[peer] = {i for i, h in enumerate(held) if h}
                now = time.monotonic()
                for i in self.offers[peer]:
                    self.offered_at.setdefault(i, now)

    def add_sources(self, sources: list) -> list:
        """Note providers announced since the download started; returns those new to it (to be fetched from)."""
        with self.cond:
            new = [s for s in sources
                   if s.peer_id not in self.known and s.peer_id not in self.rejected and s.peer_id not in self.report.rejected]
            self.known.update(s.peer_id for s in new)
            self.incoming += new
            self.cond.notify_all()
            return new

    def take_sources(self) -> list:
        """The providers added since the last call."""
        with self.cond:
            out, self.incoming = self.incoming, []
            return out

    # ---- serving what is held (the provider's side) -------------------------------------------------
    def bitmap(self) -> bytes:
        """The pieces held, one bit each (`pieces.pack_bits`)."""
        with self.cond:
            return pack_bits(self.done)

    def holds(self, start: int, end: int) -> bool:
        """Whether bytes [start, end) are whole verified pieces held here."""
        if start % PIECE_SIZE or not 0 <= start < end <= self.size or (end % PIECE_SIZE and end != self.size):
            return False
        with self.cond:
            return all(self.done[start // PIECE_SIZE:-(-end // PIECE_SIZE)])

    def wait(self, timeout: float) -> None:
        with self.cond:
            if not self.finished():
                self.cond.wait(timeout)

    def finished(self) -> bool:
        return (self.missing == 0 or self.stopped or self.fatal is not None or bool(self.clock.cancelled)
                or self.clock.left() <= 0)

    def is_done(self, i: int) -> bool:
        return self.done[i]

    # ---- deliveries ---------------------------------------------------------------------------------
    def deliver(self, peer: str, i: int, data: memoryview, segment: list[int]) -> None:
        """Write verified piece `i` in place (unless another provider's copy came first) and count it."""
        start, end = piece_span(i, self.size)
        if self.done[i]:
            with self.cond:
                self.report.discarded += len(data)
            return
        view = data
        offset = start
        while view:
            k = os.pwrite(self.part.fd, view, offset)
            view, offset = view[k:], offset + k
        with self.cond:
            if self.done[i]:  # a duplicate finished meanwhile: same verified bytes
                self.report.discarded += len(data)
                return
            self.done[i] = True
            self.missing -= 1
            if not self.missing:
                self.clock.hang_up()  # endgame duplicates still in flight are not needed any more
            self.report.received += end - start
            self.delivered[peer] = self.delivered.get(peer, 0) + end - start
            segs = self.report.segments
            if segment and segment[0] < len(segs) and segs[segment[0]][0] == peer and segs[segment[0]][2] == start:
                segs[segment[0]] = (peer, segs[segment[0]][1], end)
            else:
                segment[:] = [len(segs)]
                segs.append((peer, start, end))
            self.cond.notify_all()

    def discard(self, n: int) -> None:
        with self.cond:
            self.report.discarded += n

    def reject(self, peer: str, why: str) -> None:
        with self.cond:
            self.report.rejected[peer] = why
            self.rejected.add(peer)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.fatal is None:
                self.fatal = error
            self.cond.notify_all()

    # ---- the hash cursor ----------------------------------------------------------------------------
    def fold(self) -> None:
        """(Its own thread) fold held pieces, in order, into the whole blob's sha256, reading them back from
        the file, until every piece is folded or the download stops."""
        buf = bytearray(PIECE_SIZE)
        while self.cursor < self.n:
            with self.cond:
                while not self.done[self.cursor] and not self.finished():
                    self.cond.wait(0.5)
                if not self.done[self.cursor]:
                    return
            start, end = piece_span(self.cursor, self.size)
            view = memoryview(buf)[:end - start]
            if os.preadv(self.part.fd, [view], start) != end - start:
                self.fail(BlobError(f"the partial file {self.part.path} shrank while it was written"))
                return
            self.whole.update(view)
            self.cursor += 1
            self._writeback.advance(end)


def partials(dht: object) -> dict[tuple[str, str], Assembly]:
    """(In the DHT process) the piece-by-piece downloads in flight, by (store root, sha): the provider serves
    the pieces they hold."""
    return dht.__dict__.setdefault("_skillswarm_partials", {})


class Checker:
    """Hashes and writes the pieces one stream receives on a second thread, so receiving the next piece
    overlaps them; after the first piece that does not match, it drops the rest and says which."""

    DEPTH = 2

    def __init__(self, swarm: Assembly, peer: str) -> None:
        self.swarm, self.peer = swarm, peer
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._full: queue.Queue[tuple[int, bytearray, int] | None] = queue.Queue()
        for _ in range(self.DEPTH):
            self._free.put(bytearray(PIECE_SIZE))
        self.bad = ""  # why the stream's bytes are refused, once one piece failed
        self.error: BaseException | None = None
        self.segment: list[int] = []
        self._thread = threading.Thread(target=self._run, name="blob-pieces", daemon=True)

    def __enter__(self) -> Checker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            i, buf, n = item
            try:
                view = memoryview(buf)[:n]
                if self.bad or self.error is not None:
                    self.swarm.discard(n)
                elif hashlib.sha256(view).digest() != digest_of(self.swarm.piece_list, i):
                    start, end = piece_span(i, self.swarm.size)
                    self.bad = f"sent piece {i} (bytes {start:,}-{end:,}) that does not match the piece list"
                    self.swarm.discard(n)
                else:
                    self.swarm.deliver(self.peer, i, view, self.segment)
            except OSError as e:  # disk full, ...: ends the whole download
                self.error = BlobError(f"cannot write {self.swarm.part.path}: {e}")
                self.swarm.fail(self.error)
            except Exception as e:  # never leave the receiving thread waiting
                self.error = e
                self.swarm.fail(e)
            self._free.put(buf)

    def buffer(self) -> bytearray:
        if self.bad:
            raise Rejected(self.bad)
        if self.error is not None:
            raise Stopped
        return self._free.get()

    def put(self, i: int, buf: bytearray, n: int) -> None:
        self._full.put((i, buf, n))

    def give_back(self, buf: bytearray, n: int) -> None:
        """A piece cut short by a broken stream: its bytes cannot be verified, so they are dropped."""
        if n:
            self.swarm.discard(n)
        self._free.put(buf)

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._thread.join()
        if self.bad and exc[0] is not Rejected:  # a bad piece outweighs a stream that broke after it
            raise Rejected(self.bad)


def publish(part: PieceFile, final: Path, store: BlobStore, sha: str, size: int, piece_list: bytes) -> None:
    """Make the verified file durable, give it its final name, and keep its piece list for serving it."""
    os.ftruncate(part.fd, size)  # bytes past the blob's end (an older partial file's) were never verified
    os.fsync(part.fd)
    os.chmod(part.path, 0o644)
    os.replace(part.path, final)
    remember(final, sha)  # its sha256 was just checked: the provider here need not hash it again
    with contextlib.suppress(OSError):
        store.save_pieces(sha, piece_list)
    part.listed.unlink(missing_ok=True)
