"""The flood drill: does a round still complete, with the honest workers' deltas, while an attacker floods the DHT?

On 127.0.0.1, each a real `skillswarm` process as the demo starts them: a bootstrap peer (`net serve`), a
coordinator and two honest workers of the nano model (skills reverse and sort, one short round each). In the
flood run an attacker process joins first and, from fresh keys (one per record):
- publishes `--peers` PeerRecords (role worker), so its keys count as workers online;
- publishes `--manifests` backdated DeltaManifests per skill (created half an hour back, their fields copied from
  the first honest manifest it sees, each naming a blob nobody serves) from keys among those "online";
- for every honest delta's blob, as soon as its manifest appears, and for each of its own manifests' blobs,
  `--providers` ProviderRecords (dated a few seconds ahead, half an hour back, years back or in year 5138) whose
  addresses swallow every dial (TCP listeners that never speak) or refuse it (closed ports).
It stores every record at each peer it knows, as any program speaking hivemind's protocol can.

Figures, per run (baseline: the same round without the attacker, `--no-baseline` skips it): whether the round
completed (checkpoint v1 published within `--timeout`), whether it included both honest workers' deltas, the
seconds from the workers' start to v1, what v1 included and rejected, and the flood's size (records stored, blobs
flooded, how soon after the honest manifest appeared); then the flood run's seconds over the baseline's.

    .venv/bin/python bench/flood.py [--steps 3] [--providers 30] [--peers 200] [--manifests 4] [--no-baseline] [--json]

Everything goes to a temp directory (kept with --work), deleted at the end; every process the drill starts it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NET = "flood-drill"
SKILLS = ["reverse", "sort"]
SKILLSWARM = Path(sys.executable).with_name("skillswarm")
YEAR_5138 = 1e11


# ---- the attacker (its own process: `flood.py --attack CONFIG`) -----------------------------------------------
async def _store_everywhere(_dht: Any, node: Any, items: list[tuple[bytes, bytes, bytes, float]]) -> int:
    """(In the attacker's DHT process) ask every peer in its routing table to store the pre-signed values; how
    many (peer, value) stores were accepted."""
    import msgspec
    from hivemind.dht.routing import DHTID

    accepted = 0
    peers = list(node.protocol.routing_table.uid_to_peer_id.values())
    for peer in peers:
        for i in range(0, len(items), 25):
            part = items[i:i + 25]
            try:
                ok = await node.protocol.call_store(
                    peer, keys=[DHTID.from_bytes(k) for k, _, _, _ in part], values=[v for _, _, v, _ in part],
                    expiration_time=[e for _, _, _, e in part], subkeys=[msgspec.msgpack.decode(s) for _, s, _, _ in part])
            except Exception:  # a peer that went away: the others still count
                ok = None
            accepted += sum(bool(x) for x in ok or [])
    return accepted


def _signed(who: Any, record: Any, ttl: float) -> tuple[bytes, bytes, bytes, float]:
    """(key id, msgpack subkey, owner-signed value, expiration): a record as hivemind sends it, signed by `who`."""
    import msgspec
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from skillswarm.protocol import keys
    from skillswarm.protocol.codec import encode_record
    from skillswarm.protocol.transport.validation import OwnerSignatureValidator

    key, subkey = keys.locations(record)[0]
    unsigned = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(subkey),
                         msgspec.msgpack.encode(encode_record(record)), time.time() + ttl)
    return unsigned.key, unsigned.subkey, OwnerSignatureValidator(who).sign_value(unsigned), unsigned.expiration_time


def _emit(**event: Any) -> None:
    print(json.dumps({"t": time.time(), **event}), flush=True)


def attack(cfg: dict) -> None:
    """Flood the network `cfg` describes until SIGTERM (see the module docstring); prints JSON events."""
    import msgspec

    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import PeerRecord, ProviderRecord
    from skillswarm.protocol.transport.dht import SwarmDHT

    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    holes = []
    for _ in range(8):  # addresses that swallow dials: they accept TCP and never speak
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4096)
        holes.append(s)
    closed = []
    for _ in range(2):  # and ports where nothing listens
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed.append(s.getsockname()[1])
    addrs = [f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}" for s in holes] + [f"/ip4/127.0.0.1/tcp/{p}" for p in closed]
    dht = SwarmDHT(NET, Identity.generate(), initial_peers=[cfg["maddr"]]).start()
    stored = {"peer": 0, "provider": 0, "delta": 0}
    tried = {"peer": 0, "provider": 0, "delta": 0}

    def store(kind: str, items: list) -> None:
        tried[kind] += len(items)
        stored[kind] += dht.run_coroutine(_store_everywhere, items=items, timeout=300)

    def providers_for(blob: str, size: int) -> None:
        now = time.time()
        dates = [now + 3, now + 1, now - 1800, now - 3 * 365 * 86400, YEAR_5138]
        items = []
        for i in range(cfg["providers"]):
            who = Identity.generate()
            record = who.sign_record(ProviderRecord(network=NET, peer_id=who.peer_id, blob=blob, size=size,
                                                    addrs=[random.choice(addrs)]), created=dates[i % len(dates)],
                                     validate=False)
            items.append(_signed(who, record, 600))
        store("provider", items)

    try:
        time.sleep(2)  # the routing table fills
        fakes = [Identity.generate() for _ in range(cfg["peers"])]
        store("peer", [_signed(who, who.sign_record(PeerRecord(network=NET, peer_id=who.peer_id, role="worker",
                                                                addrs=[random.choice(addrs)], skills=cfg["skills"])), 590)
                       for who in fakes])
        _emit(event="up", stored=stored, tried=tried)
        authors = {who.public_key_hex for who in fakes}
        seen: set[str] = set()
        manifests_out = False
        while not stop:
            try:
                found = dht.get_deltas(0)
            except Exception as e:  # a DHT hiccup: try again
                _emit(event="error", error=str(e))
                found = []
            for d in found:
                if d.author in authors or d.blob in seen:
                    continue
                seen.add(d.blob)
                providers_for(d.blob, d.size)
                _emit(event="flooded", blob=d.blob, skill=d.skill, manifest_created=d.created, stored=stored, tried=tried)
                if not manifests_out:
                    manifests_out = True
                    items, blobs = [], []
                    for i in range(cfg["manifests"] * len(cfg["skills"])):
                        who = fakes[i % len(fakes)]
                        blob = os.urandom(32).hex()
                        fake = msgspec.structs.replace(d, skill=cfg["skills"][i % len(cfg["skills"])], blob=blob,
                                                       author="", signature=b"")
                        items.append(_signed(who, who.sign_record(fake, created=time.time() - 1800, validate=False),
                                             3600))
                        blobs.append(blob)
                    store("delta", items)
                    for blob in blobs:
                        providers_for(blob, d.size)
                    _emit(event="manifests", n=len(items), stored=stored, tried=tried)
            time.sleep(0.2)
    finally:
        _emit(event="stopped", stored=stored, tried=tried)
        dht.shutdown()
        for s in holes:
            s.close()


# ---- the drill -------------------------------------------------------------------------------------------------
def _start(args: list[str], home: Path, log: Path) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SKILLSWARM_HOME": str(home), "COLUMNS": "200"}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            start_new_session=True)


def _cli(*args: str) -> list[str]:
    return [str(SKILLSWARM), *args] if SKILLSWARM.exists() else [sys.executable, "-m", "skillswarm.node.cli.app", *args]


def _wait_for_line(log: Path, key: str, timeout: float, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and key in line:
                return json.loads(line)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{log.name}: no {key!r} line within {timeout:g} s:\n{log.read_text()[-3000:]}")


def _events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            with_group(p, signal.SIGTERM)
    deadline = time.monotonic() + 60
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with_group(p, signal.SIGKILL)
            p.wait(10)


def with_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the process and what it started (its DHT process and p2pd follow their owner)
    except (ProcessLookupError, PermissionError):
        pass


def run_round(work: Path, spec_file: Path, coord_key: Path, flood: bool, args: argparse.Namespace) -> dict:
    """One network, one round: the figures of the module docstring."""
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.protocol.transport.dht import SwarmDHT
    from skillswarm.protocol.transport.validation import StorePolicy

    spec = load_spec(spec_file)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    observer = None
    out: dict[str, Any] = {"attacked": flood}
    try:
        procs["boot"] = _start(_cli("net", "serve", "--host", "127.0.0.1", "--network", str(spec_file), "--json"),
                               work / "h-boot", logs / "boot.log")
        maddr = _wait_for_line(logs / "boot.log", "maddrs", 90, procs["boot"])["maddrs"][0]
        join = ["--network", str(spec_file), "--peers", maddr, "--host", "127.0.0.1"]
        procs["coordinator"] = _start(_cli("coordinator", "run", *join, "--key", str(coord_key), "--eval-n",
                                           str(args.eval_n)), work / "h-coord", logs / "coordinator.log")
        if flood:
            cfg = {"maddr": maddr, "providers": args.providers, "peers": args.peers, "manifests": args.manifests,
                   "skills": SKILLS}
            procs["attacker"] = _start([sys.executable, str(Path(__file__).resolve()), "--attack", json.dumps(cfg)],
                                       work / "h-attacker", logs / "attacker.log")
            up = _wait_for_line(logs / "attacker.log", '"up"', 300, procs["attacker"])
            out["peer_records_stored"] = up["stored"]["peer"]
        started = time.monotonic()
        for skill in SKILLS:
            procs[skill] = _start(_cli("node", "run", *join, "--skill", skill, "--rounds", "1", "--group-size", "4",
                                       "--batch", "2", "--threads", "1", "--eval-n", str(args.eval_n), "--no-progress"),
                                  work / f"h-{skill}", logs / f"{skill}.log")
        observer = SwarmDHT(NET, Identity.generate(), initial_peers=[maddr], client_mode=True,
                            policy=StorePolicy.from_spec(spec)).start()  # (it reads the coordinators' checkpoints)
        final = None
        while time.monotonic() - started < args.timeout:
            for name, p in procs.items():
                if p.poll() is not None and name in ("boot", "coordinator"):
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{(logs / f'{name}.log').read_text()[-3000:]}")
            try:
                final = observer.latest_checkpoint(trusted=spec.coordinators)
            except Exception:
                final = None
            if final is not None and final.version >= 1:
                break
            time.sleep(1.0)
        took = time.monotonic() - started
        honest = {}
        for skill in SKILLS:
            key = work / f"h-{skill}" / "config" / "identity.key"
            if key.exists():
                honest[Identity.load(key).public_key_hex] = skill
        completed = final is not None and final.version >= 1
        included = list(final.included) if completed else []
        out.update(
            completed=completed, seconds=round(took, 1),
            honest_included=sorted(honest[d.author] for d in included if d.author in honest),
            included=len(included), others_included=sum(d.author not in honest for d in included),
            rejected=len(final.rejected) + final.omitted if completed else None,
            rejected_by_step=dict(Counter(r.step or "?" for r in final.rejected)) if completed else {},
        )
        out["with_honest_deltas"] = completed and sorted(out["honest_included"]) == sorted(SKILLS)
        if flood:
            events = _events(logs / "attacker.log")
            manifests = [e for e in events if e.get("event") == "flooded"]
            last = events[-1] if events else {}
            out["flood"] = {
                "stored": last.get("stored"), "sent": last.get("tried"),
                "honest_blobs_flooded": len(manifests),
                "flood_after_manifest_s": [round(e["t"] - e["manifest_created"], 2) for e in manifests],
                "fake_manifests": next((e["n"] for e in events if e.get("event") == "manifests"), 0),
            }
    finally:
        if observer is not None:
            observer.shutdown()
        _stop(procs)
        if "flood" in out:
            last = _events(logs / "attacker.log")
            if last:
                out["flood"]["stored"], out["flood"]["sent"] = last[-1].get("stored"), last[-1].get("tried")
    return out


def _spec(work: Path, base: Path, steps: int) -> tuple[Path, Path]:
    coord_key, spec_file = work / "coordinator.key", work / "net.toml"
    subprocess.run(_cli("net", "init", "--name", NET, "--model", str(base), *[a for s in SKILLS for a in ("--skill", s)],
                        "--min-deltas", "2", "--steps-per-round", str(steps), "--screen-eval-n", "0",
                        "--replicas", "0",  # the round is measured, not the coordinator's leaving
                        "--key", str(coord_key), "--out", str(spec_file)),
                   check=True, capture_output=True, text=True, cwd=ROOT,
                   env={**os.environ, "SKILLSWARM_HOME": str(work / "h-init")})
    return spec_file, coord_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attack", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help="Base model (default: the nano model, built if needed).")
    ap.add_argument("--steps", type=int, default=3, help="Training steps of each honest worker's round.")
    ap.add_argument("--eval-n", type=int, default=16, help="Held-out episodes of the workers' and coordinator's evals.")
    ap.add_argument("--providers", type=int, default=30, help="Provider records the attacker publishes per blob.")
    ap.add_argument("--peers", type=int, default=200, help="Peer records the attacker publishes.")
    ap.add_argument("--manifests", type=int, default=4, help="Backdated delta manifests per skill.")
    ap.add_argument("--timeout", type=float, default=1200.0, help="Seconds a round may take before the run gives up.")
    ap.add_argument("--no-baseline", action="store_true", help="Skip the round without the flood.")
    ap.add_argument("--work", type=Path, default=None, help="Work directory, kept.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = ap.parse_args()
    if args.attack:
        attack(json.loads(args.attack))
        return

    from skillswarm.skills.nano.build import build_base

    base = args.model or build_base()
    work = args.work or Path(tempfile.mkdtemp(prefix="skillswarm-flood-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    try:
        for name in ([] if args.no_baseline else ["baseline"]) + ["flood"]:
            run_dir = work / name
            run_dir.mkdir(parents=True, exist_ok=True)
            spec_file, coord_key = _spec(run_dir, base, args.steps)
            if not args.json:
                print(f"{name}: starting a bootstrap, a coordinator{' , an attacker' if name == 'flood' else ''} "
                      f"and {len(SKILLS)} workers ...", flush=True)
            runs[name] = run_round(run_dir, spec_file, coord_key, name == "flood", args)
            if not args.json:
                r = runs[name]
                print(f"  completed: {r['completed']}, with both honest deltas: {r['with_honest_deltas']}, "
                      f"{r['seconds']:.1f} s; included {r['included']} ({r['honest_included']} honest), "
                      f"rejected {r['rejected']}", flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"runs": runs}
    if "baseline" in runs and runs["baseline"].get("completed") and runs["flood"].get("completed"):
        result["seconds_ratio"] = round(runs["flood"]["seconds"] / runs["baseline"]["seconds"], 2)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        flood = runs["flood"].get("flood") or {}
        print(f"flood: {flood.get('stored')} records stored (peer, provider, delta; counted per peer that took them) "
              f"of {flood.get('sent')} sent; {flood.get('honest_blobs_flooded')} honest blobs flooded "
              f"{flood.get('flood_after_manifest_s')} s after their manifests; {flood.get('fake_manifests')} backdated "
              "manifests")
        if "seconds_ratio" in result:
            print(f"flood round / baseline round: {result['seconds_ratio']}x")


if __name__ == "__main__":
    main()
