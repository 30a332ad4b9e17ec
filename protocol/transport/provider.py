"""The serving half of blob transfer: a p2pd stream handler that sends byte ranges of a store's blobs.

It serves byte ranges, piece lists (`pieces`, cached by the store) and piece maps of the blobs of its store
only (an unknown or malformed sha is refused), and the verified pieces of downloads in flight into that
store (`assembly.partials`), at most `max_concurrent` uploads at once (more are told "busy"), optionally
rate-limited. A complete blob is served only once its file passes `BlobStore.has` (size on every request,
sha256 once per process); one that fails is deleted and answered as unknown, and a large one still being
hashed is answered "busy" meanwhile. It runs inside the DHT's background
process (`SwarmDHT.serve_blobs`), and the bytes move in worker threads over plain sockets (`streams`), so
neither the caller's training loop nor the DHT's event loop waits on them. The wire format is in `wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hivemind
import msgspec

from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.transport.assembly import Assembly, partials
from skillswarm.protocol.transport.blobs import BlobStore, check_sha256
from skillswarm.protocol.transport.pieces import pack_bits, piece_count
from skillswarm.protocol.transport.streams import send_all, send_file_range
from skillswarm.protocol.transport.wire import CHUNK, HANDLER, BlobHeader, BlobRequest, frame, frame_length

logger = logging.getLogger(__name__)

# How long a request waits for the first check of a blob's file before it is told "busy" (the check goes on).
CHECK_WAIT_S = 2.0


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
        self.partials: dict[tuple[str, str], Assembly] = {}  # downloads in flight whose pieces are served too
        self._checks: dict[str, asyncio.Future] = {}  # checks of blob files in progress, by sha
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="blob-upload")

    async def start(self, p2p: hivemind.P2P) -> None:
        await p2p.add_binary_stream_handler(HANDLER, self.handle)

    async def handle(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request: validate it, then send the header and the range, piece list or piece map from a worker
        thread."""
        counted = False
        try:
            try:
                n = frame_length(await asyncio.wait_for(reader.readexactly(4), self.stall_s))
                req = msgspec.msgpack.decode(await asyncio.wait_for(reader.readexactly(n), self.stall_s), type=BlobRequest)
                path = self.store.path(check_sha256(req.sha))
                partial, intact = None, True
                try:
                    size = path.stat().st_size
                    intact = await self._intact(req.sha)
                    if intact is False:  # it failed its check and is deleted: as if it had never been here
                        raise FileNotFoundError(path)
                except FileNotFoundError:  # perhaps a download in flight here holds some of its pieces
                    partial = self.partials.get((str(self.store.root), req.sha))
                    if partial is None:
                        raise
                    path, size = partial.part.path, partial.size
            except (FileNotFoundError, BlobError, ValueError, msgspec.MsgspecError) as e:
                reason = "unknown blob" if isinstance(e, FileNotFoundError) else f"bad request: {e}"
                writer.write(frame(BlobHeader(error=reason)))
                await writer.drain()
                return
            end = size if req.end is None else req.end
            if intact is None:
                writer.write(frame(BlobHeader(size=size, error="busy")))
            elif not 0 <= req.offset <= end <= size:
                writer.write(frame(BlobHeader(size=size, error=f"range {req.offset}-{end} is outside the blob")))
            elif partial is not None and req.kind == "bytes" and not partial.holds(req.offset, end):
                writer.write(frame(BlobHeader(size=size, error="missing")))
            elif self.active >= self.max_concurrent:
                writer.write(frame(BlobHeader(size=size, error="busy")))
            else:
                self.active += 1
                counted = True
                writer.transport.pause_reading()  # from here on the worker thread owns the socket
                fd = os.dup(writer.get_extra_info("socket").fileno())
                try:
                    if req.kind == "bytes":
                        sent = await asyncio.get_running_loop().run_in_executor(
                            self._pool, self._send, fd, path, req.offset, end, size)
                    else:
                        sent = await asyncio.get_running_loop().run_in_executor(
                            self._pool, self._send_about, fd, req.sha, req.kind, size, partial)
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

    async def _intact(self, sha: str) -> bool | None:
        """Whether the complete blob `sha` here passes its check (`BlobStore.has`, which deletes a bad one); None
        while the first check of a large blob is still hashing after CHECK_WAIT_S (the check goes on)."""
        check = self._checks.get(sha)
        if check is None:
            check = asyncio.get_running_loop().run_in_executor(self._pool, self.store.has, sha)
            self._checks[sha] = check
            check.add_done_callback(lambda _done: self._checks.pop(sha, None))
        try:
            return await asyncio.wait_for(asyncio.shield(check), CHECK_WAIT_S)
        except asyncio.TimeoutError:
            return None

    def _send(self, fd: int, path: Path, offset: int, end: int, size: int) -> int:
        with open(path, "rb") as f:  # before the header: a partial file renamed meanwhile ends the stream
            send_all(fd, frame(BlobHeader(size=size)), self.stall_s)
            return send_file_range(fd, f.fileno(), offset, end - offset, self.stall_s, self.rate, CHUNK)

    def _send_about(self, fd: int, sha: str, kind: str, size: int, partial: Assembly | None) -> int:
        """Send a blob's piece list ("pieces") or which pieces are held here ("have")."""
        try:
            if kind == "have":
                body = partial.bitmap() if partial is not None else pack_bits([True] * piece_count(size))
            else:  # computed once per blob, then read from the store's cache
                body = partial.piece_list if partial is not None else self.store.pieces(sha)
        except (OSError, BlobError) as e:  # removed meanwhile
            send_all(fd, frame(BlobHeader(error=f"unknown blob ({e})")), self.stall_s)
            return 0
        send_all(fd, frame(BlobHeader(size=size)) + body, self.stall_s)
        return 0


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
    provider.partials = partials(dht)
    await provider.start(node.p2p)
    dht._skillswarm_provider = provider
    return True


async def provider_stats(dht: hivemind.DHT, _node: hivemind.DHTNode) -> dict[str, int]:
    """(In the DHT process) uploads in flight and bytes served so far."""
    provider = getattr(dht, "_skillswarm_provider", None)
    return {"active": provider.active if provider else 0, "served_bytes": provider.served_bytes if provider else 0}

