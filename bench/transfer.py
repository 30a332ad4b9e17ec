"""Blob transfer throughput on 127.0.0.1, same bytes, several ways:

1. project:      `SwarmDHT.fetch` from one provider (request framing, sha256, writing to the store, verify
                 + rename); `pieces`: the same with the tree hash given, i.e. piece by piece (every piece
                 verified, then the whole sha256), the way pulls of checkpoint files fetch;
2. bare:         a hivemind binary stream on the same two daemons whose receiver discards the bytes
                 (the transport's ceiling); `hashing bare`: the same stream whose receiver sha256-hashes
                 and writes what it gets (then fsyncs): the ceiling of any fetch that verifies and stores;
3. tcp:          a plain TCP socket (no encryption, no multiplexing);
4. swarm:        the piece-by-piece fetch from three providers at once (three processes serving the same
                 store), against the same fetch from one of them; once as fast as they go, once with every
                 upload capped at --provider-mb-s, as at home, where a provider's uplink is the bottleneck.

    .venv/bin/python bench/transfer.py [--size-mb 200 | --gb] [--repeat 3] [--provider-mb-s 20] [--json]

The ways run interleaved, `--repeat` times; the best run of each counts (the machine may be shared). CPU
time per MB (median, every process of both sides: the DHT processes, the p2pds) is printed too: it depends
far less on other load than MB/s does. So does the fetcher's own work alone (sha256, append, write-back,
fsync; no network), its ceiling on this disk and CPU. Goals: project >= 0.8x bare, >= 0.9x hashing bare;
three providers faster than one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import hivemind
import psutil
from hivemind.p2p import PeerID

from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.transport.streams import open_stream, send_all

BARE_HANDLER = "skillswarm-bench/bare"
CHUNK = 1 << 20


# ---- the bare stream (both halves run inside the DHT processes) -------------------------------------
# The same daemons, the same plain-socket access the project's fetch uses (`streams`), but the sender
# sends a block of zeros from memory and the receiver drops what it gets: no framing, file, or hash.
def _send_zeros(fd: int, n: int) -> None:
    block, sent = bytes(CHUNK), 0
    while sent < n:
        k = min(CHUNK, n - sent)
        send_all(fd, block[:k] if k < CHUNK else block, 30.0)
        sent += k


async def _bare_send(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    n = int.from_bytes(await reader.readexactly(8), "big")
    writer.transport.pause_reading()
    fd = os.dup(writer.get_extra_info("socket").fileno())
    try:
        await asyncio.get_running_loop().run_in_executor(None, _send_zeros, fd, n)
    finally:
        os.close(fd)
        writer.close()


async def start_bare_sender(_dht: hivemind.DHT, node: hivemind.DHTNode) -> None:
    await node.p2p.add_binary_stream_handler(BARE_HANDLER, _bare_send)


def _drop(control_path: str, peer: str, n: int) -> None:
    with open_stream(control_path, peer, BARE_HANDLER, 30.0) as sock:
        sock.sendall(n.to_bytes(8, "big"))
        view, got = memoryview(bytearray(CHUNK)), 0
        while got < n:
            k = sock.recv_into(view)
            if not k:
                raise RuntimeError(f"bare stream ended after {got} of {n} bytes")
            got += k


async def bare_receive(_dht: hivemind.DHT, node: hivemind.DHTNode, peer: str, n: int) -> float:
    """Receive n bytes and drop them; return the seconds it took (stream opened included)."""
    start = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, _drop, node.p2p.daemon_listen_maddr["unix"], peer, n)
    return time.perf_counter() - start


async def asyncio_receive(_dht: hivemind.DHT, node: hivemind.DHTNode, peer: str, n: int) -> float:
    """The same bare stream read the way hivemind hands it over (asyncio StreamReader), for reference."""
    start = time.perf_counter()
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), BARE_HANDLER)
    writer.write(n.to_bytes(8, "big"))
    await writer.drain()
    got = 0
    while got < n:
        data = await reader.read(CHUNK)
        if not data:
            raise RuntimeError(f"stream ended after {got} of {n} bytes")
        got += len(data)
    writer.close()
    return time.perf_counter() - start


# ---- the fetcher's own work, alone --------------------------------------------------------------------
def sink_rate(n: int, root: str) -> float:
    """MB/s of what a fetch does to each byte besides receiving it (sha256, append, write-back, final
    fsync), in this process with nothing else running: the fetcher's ceiling on this disk and CPU."""
    from skillswarm.protocol.transport.blobs import PartialDownload

    block = memoryview(os.urandom(CHUNK))
    part = PartialDownload.open(Path(root) / "sink.part", Path(root) / "sink", 5.0)
    start = time.perf_counter()
    for i in range(0, n, CHUNK):
        part.append(block[: min(CHUNK, n - i)])
    part.publish(Path(root) / "sink")
    took = time.perf_counter() - start
    part.close()
    os.unlink(Path(root) / "sink")
    return n / 1e6 / took


def _hash_write(control_path: str, peer: str, n: int, path: str) -> None:
    h = hashlib.sha256()
    with open_stream(control_path, peer, BARE_HANDLER, 30.0) as sock, open(path, "wb", buffering=0) as f:
        sock.sendall(n.to_bytes(8, "big"))
        buf = bytearray(CHUNK)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view)
            if not k:
                raise RuntimeError(f"bare stream ended after {got} of {n} bytes")
            h.update(view[:k])
            f.write(view[:k])
            got += k
        os.fsync(f.fileno())
    os.unlink(path)


async def hashing_receive(_dht: hivemind.DHT, node: hivemind.DHTNode, peer: str, n: int, path: str) -> float:
    """Receive n bytes, sha256 them and write them to `path` (fsynced); return the seconds it took."""
    start = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, _hash_write, node.p2p.daemon_listen_maddr["unix"], peer,
                                                     n, path)
    return time.perf_counter() - start


# ---- plain TCP ------------------------------------------------------------------------------------
def _tcp_server(sock: socket.socket, n: int) -> None:
    block = bytes(CHUNK)
    while True:
        conn, _ = sock.accept()
        with conn:
            left = n
            while left:
                left -= conn.send(memoryview(block)[: min(CHUNK, left)])


def tcp_receive(port: int, n: int) -> float:
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < n:
            k = s.recv_into(buf)
            if not k:
                raise RuntimeError(f"tcp stream ended after {got} of {n} bytes")
            got += k
    return time.perf_counter() - start


# ---- the provider processes ------------------------------------------------------------------------
def make_blob(root: Path, n: int) -> tuple[str, str]:
    """A random blob of n bytes in the store at `root` and its piece list cached: (sha256, tree hash)."""
    store = BlobStore(root)
    with tempfile.NamedTemporaryFile(dir=root, delete=False) as f:
        for _ in range(0, n, CHUNK):
            f.write(os.urandom(min(CHUNK, n - f.tell())))
    sha = store.add_file(f.name, move=True)
    return sha, store.tree(sha)


def serve(root: Path, n: int, initial: list[str]) -> None:
    """A provider: serve the store at `root` (bare stream and TCP too), print where, then obey stdin lines
    ("rate X": cap each upload at X MB/s, 0 for none) until stdin closes."""
    store = BlobStore(root)
    sock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_tcp_server, args=(sock, n), daemon=True).start()
    with SwarmDHT("bench", Identity.generate(), initial_peers=initial) as dht:
        dht.serve_blobs(store, max_concurrent=4)
        dht.run_coroutine(start_bare_sender)
        print(json.dumps({"maddrs": dht.visible_maddrs(), "peer_id": dht.peer_id,
                          "tcp_port": sock.getsockname()[1]}), flush=True)
        for line in sys.stdin:
            if line.startswith("rate "):
                dht.serve_blobs(store, max_concurrent=4, max_upload_mb_s=float(line.split()[1]) or None)
                print("ok", flush=True)


class Providers:
    """Three provider processes serving one store."""

    def __init__(self, root: Path, n: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.info: list[dict] = []
        for _ in range(3):
            initial = self.info[0]["maddrs"] if self.info else []
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(root), "--size-mb", str(n >> 20),
                                     *[a for m in initial for a in ("--peer", m)]],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            self.info.append(json.loads(proc.stdout.readline()))

    def rate(self, mb_s: float) -> None:
        for proc in self.procs:
            proc.stdin.write(f"rate {mb_s}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=200, help="bytes to send, in MB (2**20)")
    ap.add_argument("--gb", action="store_true", help="send 1 GB (1024 MB) instead")
    ap.add_argument("--repeat", type=int, default=3, help="runs per way; the best counts")
    ap.add_argument("--provider-mb-s", type=float, default=20.0,
                    help="each provider's upload cap for the capped swarm figures, in MB/s (20 = 160 Mbit/s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--peer", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = (1024 if args.gb else args.size_mb) << 20
    if args.serve:
        return serve(args.serve, n, args.peer)

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="skillswarm-bench-") as tmp:
        sha, tree = make_blob(Path(f"{tmp}/provider"), n)
        providers = Providers(Path(f"{tmp}/provider"), n)
        try:
            info = providers.info[0]
            ids = [p["peer_id"] for p in providers.info]
            store = BlobStore(f"{tmp}/fetcher")
            with SwarmDHT("bench", Identity.generate(), initial_peers=info["maddrs"]) as dht:
                for peer in ids:  # warm the connections up
                    dht.run_coroutine(bare_receive, peer=peer, n=1 << 20)
                both_sides = _processes([p.pid for p in providers.procs])

                def fetch(peers: list[str], with_tree: bool):  # noqa: ANN202
                    def way() -> None:
                        store.remove(sha)
                        dht.fetch(sha, size=n, max_size=n, store=store, providers=peers, progress=not args.json,
                                  tree=tree if with_tree else None)
                    return way

                ways = {
                    "project": fetch(ids[:1], False),
                    "pieces": fetch(ids[:1], True),
                    "swarm3": fetch(ids, True),
                    "bare": lambda: dht.run_coroutine(bare_receive, peer=ids[0], n=n),
                    "hashing_bare": lambda: dht.run_coroutine(hashing_receive, peer=ids[0], n=n,
                                                              path=f"{tmp}/hashing-bare"),
                    "tcp": lambda: tcp_receive(info["tcp_port"], n),
                    "asyncio": lambda: dht.run_coroutine(asyncio_receive, peer=ids[0], n=n),
                }
                runs: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
                for _ in range(args.repeat):  # interleaved, so a burst of load elsewhere hits every way alike
                    for name, way in ways.items():
                        runs[name].append(_measure(way, both_sides))
                assert store.verify(sha), "the fetched blob does not match its sha256"
                providers.rate(args.provider_mb_s)
                capped = {"capped1": fetch(ids[:1], True), "capped3": fetch(ids, True)}
                for _ in range(args.repeat):
                    for name, way in capped.items():
                        runs.setdefault(name, []).append(_measure(way, both_sides))
                assert store.verify(sha), "the fetched blob does not match its sha256"
            sink = max(sink_rate(n, tmp) for _ in range(args.repeat))
        finally:
            providers.close()
    mb = n / 1e6
    rate = {k: mb / min(t for t, _ in v) for k, v in runs.items()}
    cpu = {k: 1000 * statistics.median(c for _, c in v) / mb for k, v in runs.items()}
    result = {
        "size_mb": n >> 20, "repeat": args.repeat, "load_avg_1m": round(load, 2), "cpus": os.cpu_count(),
        "project_mb_s": round(rate["project"], 1), "bare_stream_mb_s": round(rate["bare"], 1),
        "tcp_mb_s": round(rate["tcp"], 1),
        "ratio_vs_bare": round(rate["project"] / rate["bare"], 3), "ratio_vs_tcp": round(rate["project"] / rate["tcp"], 3),
        "hivemind_streamreader_mb_s": round(rate["asyncio"], 1), "fetcher_sink_mb_s": round(sink, 1),
        "project_cpu_ms_per_mb": round(cpu["project"], 2), "bare_cpu_ms_per_mb": round(cpu["bare"], 2),
        "hashing_bare_mb_s": round(rate["hashing_bare"], 1),
        "ratio_vs_hashing_bare": round(rate["project"] / rate["hashing_bare"], 3),
        "pieces_mb_s": round(rate["pieces"], 1),
        "pieces_ratio_vs_hashing_bare": round(rate["pieces"] / rate["hashing_bare"], 3),
        "pieces_cpu_ms_per_mb": round(cpu["pieces"], 2), "hashing_bare_cpu_ms_per_mb": round(cpu["hashing_bare"], 2),
        "provider_upload_mb_s": args.provider_mb_s,
        "capped_1_provider_mb_s": round(rate["capped1"], 1), "capped_3_providers_mb_s": round(rate["capped3"], 1),
        "multi_source_speedup": round(rate["capped3"] / rate["capped1"], 3),
        "uncapped_3_providers_mb_s": round(rate["swarm3"], 1),
        "multi_source_speedup_uncapped": round(rate["swarm3"] / rate["pieces"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    r = result
    print(f"{n >> 20} MiB on 127.0.0.1, best of {args.repeat} (MB = 10^6 bytes; load average {load:.2f} "
          f"on {os.cpu_count()} CPUs at the start):")
    print(f"  project fetch   {r['project_mb_s']:8.1f} MB/s   {r['project_cpu_ms_per_mb']:.2f} CPU ms/MB (both sides)")
    print(f"  piece by piece  {r['pieces_mb_s']:8.1f} MB/s   {r['pieces_cpu_ms_per_mb']:.2f} CPU ms/MB")
    print(f"  bare stream     {r['bare_stream_mb_s']:8.1f} MB/s   {r['bare_cpu_ms_per_mb']:.2f} CPU ms/MB")
    print(f"  hashing bare    {r['hashing_bare_mb_s']:8.1f} MB/s   {r['hashing_bare_cpu_ms_per_mb']:.2f} CPU ms/MB")
    print(f"  plain TCP       {r['tcp_mb_s']:8.1f} MB/s")
    print(f"  (bare stream read through hivemind's asyncio StreamReader: {r['hivemind_streamreader_mb_s']:.1f} MB/s)")
    print(f"  (sha256 + append + write-back + fsync alone, no network: {r['fetcher_sink_mb_s']:.1f} MB/s)")
    print(f"  project / bare          {r['ratio_vs_bare']:.3f}   (goal >= 0.8)")
    print(f"  project / hashing bare  {r['ratio_vs_hashing_bare']:.3f}   (goal >= 0.9; piece by piece: "
          f"{r['pieces_ratio_vs_hashing_bare']:.3f})")
    print(f"  project / tcp           {r['ratio_vs_tcp']:.3f}")
    print(f"  3 providers / 1, uploads capped at {args.provider_mb_s:g} MB/s: {r['multi_source_speedup']:.3f} "
          f"({r['capped_3_providers_mb_s']:.1f} vs {r['capped_1_provider_mb_s']:.1f} MB/s; goal > 1)")
    print(f"  3 providers / 1, uncapped: {r['multi_source_speedup_uncapped']:.3f} "
          f"({r['uncapped_3_providers_mb_s']:.1f} vs {r['pieces_mb_s']:.1f} MB/s)")


def _processes(provider_pids: list[int]) -> list[psutil.Process]:
    """Every side: this process and the providers, with their DHT processes and p2pds."""
    roots = [psutil.Process(), *(psutil.Process(pid) for pid in provider_pids)]
    procs = {p.pid: p for r in roots for p in [r, *r.children(recursive=True)]}
    return [p for p in procs.values() if p.name() != "torch_shm_manager"]


def _measure(way, procs: list[psutil.Process]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of `procs`) of one run."""
    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    c0, t0 = cpu(), time.perf_counter()
    way()
    return time.perf_counter() - t0, cpu() - c0


if __name__ == "__main__":
    main()
