"""Blob transfer over binary streams on the node's own p2pd: a provider and a fetcher.

Wire protocol (one stream per request, protocol id `skillswarm/v{protocol}/blob`):
    client -> provider   u32 length + msgpack BlobRequest{sha, offset}
    provider -> client   u32 length + msgpack BlobHeader{size, error}; then, if no error, the raw bytes
                         [offset, size) of the blob, and the provider closes the stream.

The provider serves only blobs of its store (an unknown or malformed sha is refused), at most
`max_concurrent` uploads at once (more are told "busy"), optionally rate-limited. The fetcher appends to
a partial file while hashing, resumes from the bytes it has when a stream breaks (from the next provider,
or the same one on a later call), and renames the file to its final name only when the sha256 matches.
A provider whose bytes do not match is rejected; so is one announcing another size, or over `max_size`.
Both halves run inside the DHT's background process (`SwarmDHT.serve_blobs` / `SwarmDHT.fetch`), and the
bytes move in worker threads over plain sockets (`streams`), so neither the caller's training loop nor
the DHT's event loop waits on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hivemind
import msgspec
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from skillswarm.protocol.atomic import WriteBehind
from skillswarm.protocol.blobs import BlobStore, check_sha256
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.streams import open_stream, recv_exact, send_all, send_file_range
from skillswarm.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

HANDLER = f"skillswarm/v{PROTOCOL_VERSION}/blob"
CHUNK = 1 << 20  # the most bytes one read or write moves
SYNC_EVERY = 16 << 20  # bytes a download appends between write-back steps
_MAX_FRAME = 4096


class BlobRequest(msgspec.Struct, forbid_unknown_fields=True):
    sha: str
    offset: int = 0


class BlobHeader(msgspec.Struct):
    size: int = 0
    error: str = ""


class Source(msgspec.Struct, frozen=True):
    """A provider to fetch from: its peer id, the addresses it announced, the size it announced (or None)."""

    peer_id: str
    addrs: tuple[str, ...] = ()
    size: int | None = None


class FetchReport(msgspec.Struct):
    """What a fetch did: where the blob is, how many bytes travelled, from whom, and who was rejected."""

    path: str
    sha: str
    size: int
    received: int = 0
    resumed_from: int = 0
    segments: list[tuple[str, int, int]] = []  # (peer id, start, end) per stream that delivered bytes
    rejected: dict[str, str] = {}  # peer id -> why it was dropped
    already_present: bool = False


def _frame(obj: msgspec.Struct) -> bytes:
    data = msgspec.msgpack.encode(obj)
    return len(data).to_bytes(4, "big") + data


def _frame_length(prefix: bytes) -> int:
    n = int.from_bytes(prefix, "big")
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over the {_MAX_FRAME}-byte limit")
    return n


# ---- provider --------------------------------------------------------------------------------------
class BlobProvider:
    """Serves byte ranges of the blobs in one store; registered on p2pd by `start`."""

    def __init__(self, root: Path | str, max_concurrent: int = 4, max_upload_bytes_s: float | None = None,
                 stall_s: float = 30.0) -> None:
        self.store = BlobStore(root)
        self.max_concurrent = max_concurrent
        self.rate = max_upload_bytes_s
        self.stall_s = stall_s
        self.active = 0
        self.served_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="blob-upload")

    async def start(self, p2p: hivemind.P2P) -> None:
        await p2p.add_binary_stream_handler(HANDLER, self.handle)

    async def handle(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request: validate it, then send the header and the range from a worker thread."""
        counted = False
        try:
            try:
                n = _frame_length(await asyncio.wait_for(reader.readexactly(4), self.stall_s))
                req = msgspec.msgpack.decode(await asyncio.wait_for(reader.readexactly(n), self.stall_s), type=BlobRequest)
                path = self.store.path(check_sha256(req.sha))
                size = path.stat().st_size
            except (FileNotFoundError, BlobError, ValueError, msgspec.MsgspecError) as e:
                reason = "unknown blob" if isinstance(e, FileNotFoundError) else f"bad request: {e}"
                writer.write(_frame(BlobHeader(error=reason)))
                await writer.drain()
                return
            if not 0 <= req.offset <= size:
                writer.write(_frame(BlobHeader(size=size, error=f"offset {req.offset} is outside the blob")))
            elif self.active >= self.max_concurrent:
                writer.write(_frame(BlobHeader(size=size, error="busy")))
            else:
                self.active += 1
                counted = True
                writer.transport.pause_reading()  # from here on the worker thread owns the socket
                fd = os.dup(writer.get_extra_info("socket").fileno())
                try:
                    sent = await asyncio.get_running_loop().run_in_executor(
                        self._pool, self._send, fd, path, req.offset, size)
                finally:
                    os.close(fd)
                self.served_bytes += sent
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as e:
            logger.debug("blob upload ended early: %s", e)
        finally:
            if counted:
                self.active -= 1
            with contextlib.suppress(Exception):
                writer.close()

    def _send(self, fd: int, path: Path, offset: int, size: int) -> int:
        send_all(fd, _frame(BlobHeader(size=size)), self.stall_s)
        with open(path, "rb") as f:
            return send_file_range(fd, f.fileno(), offset, size - offset, self.stall_s, self.rate, CHUNK)


async def start_provider(
    dht: hivemind.DHT, node: hivemind.DHTNode, root: str, max_concurrent: int, max_upload_bytes_s: float | None
) -> bool:
    """(In the DHT process) serve the store at `root`; a second call replaces the settings. True if new."""
    provider = getattr(dht, "_skillswarm_provider", None)
    if provider is not None:
        provider.store = BlobStore(root)
        provider.max_concurrent, provider.rate = max_concurrent, max_upload_bytes_s
        return False
    provider = BlobProvider(root, max_concurrent, max_upload_bytes_s)
    await provider.start(node.p2p)
    dht._skillswarm_provider = provider
    return True


async def provider_stats(dht: hivemind.DHT, _node: hivemind.DHTNode) -> dict[str, int]:
    """(In the DHT process) uploads in flight and bytes served so far."""
    provider = getattr(dht, "_skillswarm_provider", None)
    return {"active": provider.active if provider else 0, "served_bytes": provider.served_bytes if provider else 0}


# ---- fetcher ---------------------------------------------------------------------------------------
class _Transient(Exception):
    """This attempt failed (stream broke, provider busy or unreachable); the provider may be tried again."""


class _Rejected(Exception):
    """This provider must not be asked again during this fetch (unknown blob, wrong size, lying)."""


class _Partial:
    """The download in progress: appended and hashed as bytes arrive, resumable, and locked (flock)
    against a second fetcher of the same blob in any process."""

    def __init__(self, path: Path, file: Any) -> None:
        self.path, self.file = path, file
        self.hasher, self.offset = hashlib.sha256(), 0
        self._writeback = WriteBehind(file.fileno(), SYNC_EVERY)

    @classmethod
    def open(cls, path: Path, final: Path, wait_s: float) -> _Partial | None:
        """Lock and open the partial file, hashing what it already holds; None if the blob appeared meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while not final.is_file():
            f = open(path, "a+b", buffering=0)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                if time.monotonic() > deadline:
                    raise BlobError(f"another fetch of blob {final.name[:12]} holds {path}; try again later") from None
                time.sleep(0.2)
                continue
            if final.is_file():  # finished by the fetcher that held the lock
                f.close()
                return None
            part = cls(path, f)
            f.seek(0)
            while block := f.read(CHUNK):
                part.hasher.update(block)
                part.offset += len(block)
            part._writeback.reset(part.offset)
            return part
        return None

    def append(self, data: memoryview) -> None:
        self.hasher.update(data)
        while data:
            data = data[self.file.write(data):]
        self.offset = self.file.tell()
        self._writeback.advance(self.offset)  # write back as we go: the final fsync has little left

    def reset(self) -> None:
        """Throw every byte away (they failed verification)."""
        self.file.truncate(0)
        self.hasher, self.offset = hashlib.sha256(), 0
        self._writeback.reset()

    def publish(self, final: Path) -> None:
        """Make the verified file durable and give it its final name."""
        os.fsync(self.file.fileno())
        os.chmod(self.path, 0o644)
        os.replace(self.path, final)

    def close(self, *, remove: bool = False) -> None:
        self.file.close()
        if remove:
            self.path.unlink(missing_ok=True)


class _Sink:
    """Hashes and appends received chunks on a second thread, so receiving the next chunk overlaps them."""

    DEPTH = 8

    def __init__(self, part: _Partial) -> None:
        self.part = part
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        for _ in range(self.DEPTH):
            self._free.put(bytearray(CHUNK))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="blob-sink", daemon=True)

    def __enter__(self) -> _Sink:
        self._thread.start()
        return self

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n = item
            try:
                if self._error is None:
                    self.part.append(memoryview(buf)[:n])
            except OSError as e:  # disk full, ...: ends the whole fetch, not just this stream
                self._error = BlobError(f"cannot write {self.part.path}: {e}")
            except Exception as e:  # never leave the receiving thread waiting on a dead sink
                self._error = e
            self._free.put(buf)

    def buffer(self) -> bytearray:
        if self._error is not None:
            raise self._error
        return self._free.get()

    def put(self, buf: bytearray, n: int) -> None:
        self._full.put((buf, n)) if n else self._free.put(buf)

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error


def _receive(control_path: str, src: Source, sha: str, part: _Partial, size: int | None, max_size: int,
             stall_s: float, report: FetchReport) -> int:
    """(Worker thread) one request to one provider, appending what it sends to `part`; returns the blob size."""
    try:
        sock = open_stream(control_path, src.peer_id, HANDLER, stall_s)
    except OSError as e:
        raise _Transient(f"cannot open a stream ({e})") from None
    start = part.offset
    try:
        sock.sendall(_frame(BlobRequest(sha=sha, offset=part.offset)))
        header = msgspec.msgpack.decode(recv_exact(sock, _frame_length(recv_exact(sock, 4))), type=BlobHeader)
        if header.error == "busy":
            raise _Transient("busy")
        if header.error:
            raise _Rejected(header.error)
        expected = size if size is not None else src.size
        if expected is not None and header.size != expected:
            raise _Rejected(f"serves {header.size} bytes where {expected} were announced")
        if header.size > max_size:
            raise _Rejected(f"serves {header.size} bytes, over the {max_size}-byte limit")
        if part.offset > header.size:
            part.reset()
            raise _Transient("the partial download was longer than the blob; restarting it")
        with _Sink(part) as sink:
            received = part.offset
            while received < header.size:
                buf = sink.buffer()
                want, got = min(CHUNK, header.size - received), 0
                try:
                    while got < want:
                        k = sock.recv_into(memoryview(buf)[got:want])
                        if not k:
                            raise _Transient(f"stream ended at byte {received + got} of {header.size}")
                        got += k
                finally:
                    sink.put(buf, got)  # what arrived before a break is kept: the next stream resumes after it
                received += got
        return header.size
    except (ValueError, msgspec.MsgspecError) as e:
        raise _Rejected(f"sent a malformed header ({e})") from None
    except OSError as e:  # includes timeouts: a stalled provider
        raise _Transient(f"stream broke at byte {part.offset} ({type(e).__name__}: {e})") from None
    finally:
        sock.close()
        if part.offset > start:
            report.segments.append((src.peer_id, start, part.offset))
            report.received += part.offset - start


async def fetch_blob(
    _dht: hivemind.DHT, node: hivemind.DHTNode, sha: str, sources: list[Source], root: str, size: int | None,
    max_size: int, stall_s: float = 30.0, max_attempts: int | None = None,
) -> FetchReport:
    """(In the DHT process) download blob `sha` from `sources` into the store at `root`; see the module doc."""
    loop = asyncio.get_running_loop()
    store = BlobStore(root)
    final = store.path(check_sha256(sha))
    if size is not None and size > max_size:
        raise BlobError(f"blob {sha[:12]} is {size} bytes, over the {max_size}-byte limit")
    part = await loop.run_in_executor(None, _Partial.open, store.partial_path(sha), final, max(60.0, stall_s * 4))
    if part is None:
        return FetchReport(path=str(final), sha=sha, size=final.stat().st_size, already_present=True)
    report = FetchReport(path=str(final), sha=sha, size=size if size is not None else -1, resumed_from=part.offset)
    control_path = node.p2p.daemon_listen_maddr["unix"]
    me = node.peer_id.to_base58()
    usable = [s for s in sources if s.peer_id != me]
    contributors: set[str] = {"(an earlier fetch)"} if part.offset else set()
    failures: dict[str, int] = {}
    attempts, budget, mismatches, ok = 0, max_attempts or 3 * len(usable) + 2, 0, False
    try:
        while usable and attempts < budget:
            src = usable[0]  # in the caller's order; a provider that breaks goes to the back of the line
            attempts += 1
            before = part.offset
            if src.addrs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(src.peer_id),
                                                                    [Multiaddr(a) for a in src.addrs]), stall_s)
            try:
                total = await loop.run_in_executor(
                    None, _receive, control_path, src, sha, part, size, max_size, stall_s, report)
            except _Rejected as e:
                report.rejected[src.peer_id] = str(e)
                usable.remove(src)
                continue
            except _Transient as e:
                logger.debug("blob %s from %s: %s", sha[:12], src.peer_id[:16], e)
                usable.append(usable.pop(0))
                if part.offset > before:  # it delivered something: resume at once, from the next provider
                    contributors.add(src.peer_id)
                    continue
                failures[src.peer_id] = failures.get(src.peer_id, 0) + 1
                if failures[src.peer_id] >= 3:
                    report.rejected[src.peer_id] = str(e)
                    usable.remove(src)
                await asyncio.sleep(0.1 * failures[src.peer_id])
                continue
            contributors.add(src.peer_id)
            report.size = total
            if part.hasher.hexdigest() == sha:
                await loop.run_in_executor(None, part.publish, final)
                ok = True
                return report
            # The bytes do not match. A single source is a liar; with several (a resumed download), retry
            # from zero and only blame them all once every provider had its chance.
            mismatches += 1
            blamed = contributors - {"(an earlier fetch)"}
            if len(contributors) == 1 or mismatches > len(sources):
                for peer in blamed:
                    report.rejected[peer] = "sent bytes that do not match the sha256"
                usable = [s for s in usable if s.peer_id not in blamed]
            part.reset()
            contributors.clear()
        reasons = "; ".join(f"{peer[:20]}...: {why}" for peer, why in report.rejected.items())
        if not usable and not report.rejected:
            reasons = "no provider is known" if not sources else "no provider besides this node"
        raise BlobError(f"could not fetch blob {sha[:12]} ({reasons or 'every provider failed; try again later'})")
    finally:
        part.close(remove=not ok and part.offset == 0)
