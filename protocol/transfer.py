"""Blob transfer over binary streams on the node's own p2pd: the wire protocol, its limits, and the provider.

Wire protocol (one stream per request, protocol id `skillswarm/v{protocol}/blob`):
    client -> provider   u32 length + msgpack BlobRequest{sha, offset}
    provider -> client   u32 length + msgpack BlobHeader{size, error}; then, if no error, the raw bytes
                         [offset, size) of the blob, and the provider closes the stream.

The provider serves only blobs of its store (an unknown or malformed sha is refused), at most
`max_concurrent` uploads at once (more are told "busy"), optionally rate-limited. The downloading half is
`fetcher`: it verifies, resumes, and holds every download to a deadline of GRACE_S + size / MIN_RATE
(`deadline_for`), so a provider that trickles bytes cannot hold a fetch for longer. Both halves run inside
the DHT's background process (`SwarmDHT.serve_blobs` / `SwarmDHT.fetch`), and the bytes move in worker
threads over plain sockets (`streams`), so neither the caller's training loop nor the DHT's event loop
waits on them.
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

from skillswarm.protocol.blobs import BlobStore, check_sha256
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.streams import send_all, send_file_range
from skillswarm.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

HANDLER = f"skillswarm/v{PROTOCOL_VERSION}/blob"
CHUNK = 1 << 20  # the most bytes one read or write moves
_MAX_FRAME = 4096

# Every download must average MIN_RATE bytes/s once GRACE_S has passed: a whole fetch ends by
# GRACE_S + size / MIN_RATE (its deadline), and one stream under that rate after GRACE_S is dropped.
GRACE_S = 30.0
MIN_RATE = 100_000.0


def deadline_for(size: int, min_rate: float = MIN_RATE, grace_s: float = GRACE_S) -> float:
    """Seconds a download of `size` bytes may take: the grace period plus the size at the minimum rate."""
    return grace_s + size / min_rate


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


def __getattr__(name: str) -> Any:
    """The downloading half moved to `fetcher` (its partial file to `blobs`); its names stay importable from here."""
    if name in {"fetch_blob", "cancel_fetches", "_Sink", "_receive"}:
        from skillswarm.protocol import fetcher

        return getattr(fetcher, name)
    if name in {"_Partial", "SYNC_EVERY"}:  # the partial file itself belongs to the store
        from skillswarm.protocol import blobs

        return getattr(blobs, "PartialDownload" if name == "_Partial" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
