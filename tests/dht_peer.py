"""A worker-like DHT peer for the integration tests: it joins, heartbeats its PeerRecord and prints, as
JSON lines, what it sees; SIGTERM stops it cleanly.

    python -m tests.dht_peer NETWORK MADDR [--skill arith] [--interval 1] [--ttl 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import psutil

from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.identity import Identity


def emit(**event: object) -> None:
    print(json.dumps({"t": time.time(), **event}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("network")
    ap.add_argument("peers", nargs="+")
    ap.add_argument("--skill", default="arith")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--ttl", type=float, default=3.0)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = SwarmDHT(args.network, Identity.generate(), initial_peers=args.peers).start()
    dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=[args.skill], engine="hf"),
                        interval=args.interval, ttl=args.ttl)
    emit(event="up", peer_id=dht.peer_id, pid=os.getpid(),
         processes=[p.pid for p in psutil.Process().children(recursive=True)])
    while not stop.wait(0.3):
        emit(event="view", peers=sorted(p.peer_id for p in dht.get_peers()))
    dht.shutdown()
    emit(event="stopped", processes=[p.pid for p in psutil.Process().children(recursive=True)
                                     if p.name() != "torch_shm_manager"])


if __name__ == "__main__":
    main()
