"""Swarm scale: one merge round with N workers, and what it costs the coordinator as N grows.

For each N in --workers, the bench starts a coordinator and N workers, each its own process with its own
hivemind DHT peer and p2pd on 127.0.0.1 (SwarmDHT, BlobStore, real signed records), and runs one round:

1. every worker publishes a synthetic delta of a `--params`-parameter bf16 model (random values, no
   training: dense bf16, one checkpoint delta's size) and serves it;
2. the coordinator runs its real round (`Coordinator.merge_round`: admission, caps, fetch, file checks,
   merge, commit, publish with tree hashes; no held-out evaluation and no usefulness/consensus screening,
   which need a real model), which fetches every delta from its author;
3. every worker pulls the new checkpoint the way a worker does (`node.pull.pull`: the merged delta, piece
   by piece from every node that holds or is downloading it, then applied), then serves it (`share`).

Per N it prints the round's seconds (the coordinator's start to the last worker's pull), the bytes the
coordinator uploaded and downloaded (the providers' own counters, `provider_stats`), its peak RSS (VmHWM
of its process, its DHT process and p2pd), the bytes each worker uploaded (mean / max), and the
coordinator's upload divided by one checkpoint delta's size. Goal: that ratio <= 2 whatever N,
and the coordinator's RSS flat in N.

Every peer's uploads are capped at --rate-mbit (one upload slot at that rate: the transfer layer's
`max_upload_bytes_s` with `max_concurrent=1`, a home uplink); 0 leaves them uncapped. The issue's model is
0.5B parameters (a 1 GB bf16 delta); this machine (2 cores) runs a smaller one by default (--params 25M)
and prints the 0.5B round time at 10 and 100 Mbit/s as a PROJECTION: the round's transfer seconds scaled
by bytes and by rate (fixed latencies too, so it leans high, and means little for a run whose transfers are
not bound by the cap), its compute seconds (merge, apply) by parameters. Files go to a temp directory,
deleted at the end; every process the bench starts it ends.

    .venv/bin/python bench/swarm_scale.py [--workers 2,4,8,16] [--params 25M] [--rate-mbit 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

NET = "swarmscale"
SKILLS = ["arith", "reverse"]
TARGET_PARAMS = 500_000_000  # the model
HOME_MBIT = (10.0, 100.0)  # home uplinks the projection is made for
COLS = 1024  # synthetic tensors are (rows, COLS), at most ROWS rows
ROWS = 4096
STEP_TIMEOUT_S = 900.0  # the longest any one phase may take before the bench gives up
log = logging.getLogger("swarm_scale")


# ---- flags ---------------------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """A parameter count: 25000000, 25M, 0.5B."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 25000000, 25M, 0.5B)") from None
    if not COLS <= value <= 2 * 10**9:
        raise argparse.ArgumentTypeError(f"{text!r}: give between {COLS} and 2B parameters")
    return int(value)


def parse_workers(text: str) -> list[int]:
    """A comma-separated list of worker counts, each 1-64."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of worker counts (e.g. 2,4,8)") from None
    if not counts or not all(1 <= n <= 64 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts between 1 and 64 (e.g. 2,4,8)")
    return counts


def parse_rate(text: str) -> float:
    """Mbit/s, 0 for uncapped."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rate in Mbit/s between 0 (uncapped) and 1e6 (e.g. 100)")
    return value


# ---- processes and memory ------------------------------------------------------------------------------
def peak_rss(pid: int) -> int:
    """A process's peak resident set (VmHWM) in bytes; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return 0


def tree_rss(dht_pid: int | None) -> dict[str, int]:
    """Peak RSS of this process, its DHT process and that one's children (p2pd)."""
    import psutil

    out = {"main": peak_rss(os.getpid()), "dht": 0, "p2pd": 0}
    if dht_pid:
        out["dht"] = peak_rss(dht_pid)
        out["p2pd"] = sum(peak_rss(c.pid) for c in psutil.Process(dht_pid).children())
    return out


# ---- the synthetic model -------------------------------------------------------------------------------
def shapes_for(params: int) -> dict[str, tuple[int, int]]:
    """Tensor names and shapes adding up to `params` (rounded down to whole rows of COLS)."""
    rows, shapes, i = params // COLS, {}, 0
    while rows > 0:
        shapes[f"layers.{i:03d}.weight"] = (min(ROWS, rows), COLS)
        rows -= min(ROWS, rows)
        i += 1
    return shapes


def build_base(root: Path, params: int) -> Path:
    """A bf16 model directory (config.json + model.safetensors) of random weights, one tensor in memory at a time."""
    import torch

    from skillswarm.merge.tensorfile import TensorFileWriter

    base = root / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": "synthetic", "torch_dtype": "bfloat16"}) + "\n")
    shapes = shapes_for(params)
    g = torch.Generator().manual_seed(0)
    with open(base / "model.safetensors", "wb") as fh:
        w = TensorFileWriter(fh, [(n, torch.bfloat16, s) for n, s in shapes.items()], {"format": "pt"})
        for n, s in shapes.items():
            w.write(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16))
        w.close()
    return base


# ---- the coordinator's process -------------------------------------------------------------------------
def _peer(network: str, identity: Any, spec: Any, peers: list[str], blob_dir: Path, rate: float) -> tuple[Any, Any]:
    """A started SwarmDHT serving `blob_dir` (uploads capped at `rate` bytes/s, one at a time, when rate > 0)."""
    from skillswarm.protocol.transport.blobs import BlobStore
    from skillswarm.protocol.transport.dht import SwarmDHT
    from skillswarm.protocol.transport.validation import StorePolicy

    dht = SwarmDHT(network, identity, initial_peers=peers, policy=StorePolicy.from_spec(spec)).start()
    blobs = BlobStore(blob_dir)
    if rate > 0:
        dht.serve_blobs(blobs, max_concurrent=1, max_upload_mb_s=rate / 1e6)
    else:
        dht.serve_blobs(blobs)
    return dht, blobs


def _served(dht: Any) -> int:
    from skillswarm.protocol.transport.provider import provider_stats

    return int(dht.run_coroutine(provider_stats)["served_bytes"])


def coordinator_main(conn: Connection, root: str, run_dir: str, rate: float) -> None:
    """(Child process) the coordinator: publish v0, then on "round" merge the deltas and publish v1."""
    from skillswarm.node.roles.coordinator import Coordinator
    from skillswarm.node.roles.rounds import RoundStrategy
    from skillswarm.node.roles.rounds.admission import Admission, Caps
    from skillswarm.node.roles.rounds.fetching import Fetch
    from skillswarm.node.roles.rounds.inspection import Inspect
    from skillswarm.node.roles.rounds.strategy import Weigh
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.netspec import load_spec

    spec, identity = load_spec(Path(root) / "net.toml"), Identity.load(Path(root) / "coordinator.key")
    home = Path(run_dir) / "coordinator"
    dht, blobs = _peer(NET, identity, spec, [], home / "blobs", rate)
    try:
        strategy = RoundStrategy(steps=[Admission(), Caps(), Fetch(), Inspect(), Weigh()], evaluate=lambda *_: {})
        coord = Coordinator(spec, identity, dht, CheckpointStore(NET, home), blobs, strategy=strategy)
        current = coord.recover()  # genesis: v0 = the base, published with its tree hashes
        conn.send(("ready", {"maddr": dht.visible_maddrs()[0], "dht_pid": dht.pid}))
        while (msg := conn.recv())[0] != "stop":
            workers = msg[1]
            t0 = time.time()
            deltas = coord.collect(current)
            while len(deltas) < workers and time.time() - t0 < STEP_TIMEOUT_S:
                time.sleep(0.2)
                deltas = coord.collect(current)
            served_before = _served(dht)
            report = coord.merge_round(current, deltas)
            current = report.manifest
            assert current.merged_delta is not None
            conn.send(("published", {"t0": t0, "published_at": time.time(), "seconds": report.seconds,
                                     "steps": report.step_seconds, "included": len(current.included),
                                     "rejected": [r.reason for r in report.rejected],
                                     "delta_bytes": current.merged_delta.size, "served_before": served_before}))
        conn.send(("stats", {"served": _served(dht), "rss": tree_rss(dht.pid)}))
    except BaseException as e:  # report it to the bench instead of dying silently
        conn.send(("error", f"coordinator: {type(e).__name__}: {e}"))
    finally:
        dht.shutdown()


# ---- a worker's process --------------------------------------------------------------------------------
def worker_main(conn: Connection, root: str, run_dir: str, index: int, coord_maddr: str, rate: float, params: int) -> None:
    """(Child process) one worker: hold v0, publish a random delta, pull v1 when it appears, serve it."""
    import torch

    from skillswarm.merge.deltas import encode_delta
    from skillswarm.node.checkpoints.pull import find_checkpoint, pull, share, wait_for_checkpoint
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.protocol.records import DeltaManifest

    spec, identity = load_spec(Path(root) / "net.toml"), Identity.generate()
    home = Path(run_dir) / f"worker{index:02d}"
    dht, blobs = _peer(NET, identity, spec, [coord_maddr], home / "blobs", rate)
    try:
        store = CheckpointStore(NET, home)
        v0 = find_checkpoint(dht, spec, 0)
        deadline = time.time() + 60
        while v0 is None and time.time() < deadline:
            time.sleep(0.5)
            v0 = find_checkpoint(dht, spec, 0)
        if v0 is None:
            raise RuntimeError("no v0 checkpoint on the network after 60 s")
        pull(dht, spec, v0, store, blobs, progress=False)  # from the local base directory, hashes checked
        skill = SKILLS[index % len(SKILLS)]
        g = torch.Generator().manual_seed(1000 + index)
        values = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes_for(params).items()}
        info = encode_delta(values, home / "delta.safetensors", spec.codec, base_hash=spec.base_hash, skill=skill,
                            dtypes={n: torch.bfloat16 for n in values})
        del values
        sha = blobs.add_file(info.path, move=True)
        dht.provide(sha, store=blobs)
        dht.put(DeltaManifest(network=NET, skill=skill, base_version=0, base_hash=spec.base_hash, blob=sha,
                              size=info.size, codec=spec.codec, norm=info.norm, num_tensors=info.num_tensors,
                              tree=blobs.tree(sha)),
                ttl=3600, keep=True)
        conn.send(("published", {"dht_pid": dht.pid, "delta_bytes": info.size}))
        v1 = wait_for_checkpoint(dht, spec, newer_than=0, timeout=STEP_TIMEOUT_S, poll=1.0)
        if v1 is None or v1.merged_delta is None:
            raise RuntimeError(f"no v1 checkpoint with a merged delta after {STEP_TIMEOUT_S:g} s")
        served_before, t_fetch = _served(dht), time.time()
        d = v1.merged_delta  # the merged delta alone, as pull() fetches it for a node holding v0 ...
        report = dht.fetch_report(d.sha256, size=d.size, max_size=d.size, store=blobs, progress=False, tree=d.tree)
        t_apply = time.time()
        pull(dht, spec, v1, store, blobs, progress=False)  # ... which then finds it here and applies it
        t_done = time.time()
        share(dht, store, blobs, v1)
        conn.send(("pulled", {"served_before": served_before, "fetch_s": t_apply - t_fetch, "apply_s": t_done - t_apply,
                              "done_at": t_done, "sources": len({s[0] for s in report.segments}),
                              "discarded": report.discarded}))
        if conn.recv()[0] == "stop":
            conn.send(("stats", {"served": _served(dht), "rss": tree_rss(dht.pid)}))
    except BaseException as e:
        conn.send(("error", f"worker {index}: {type(e).__name__}: {e}"))
    finally:
        dht.shutdown()


# ---- the bench's side: one round with N workers ---------------------------------------------------------
class BenchError(Exception):
    """A round could not be run (a child failed or timed out); the message says which and why."""


class Fleet:
    """The child processes of one round: started, messaged, and always ended, with their DHT processes and
    p2pds (recorded as psutil handles, so a leftover is killed by identity, never by name)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")  # fresh interpreters: no inherited threads or torch state
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        self.others: list[Any] = []  # psutil handles of DHT processes and p2pds

    def start(self, name: str, target: Any, *args: Any) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(child, *args), name=name)
        proc.start()
        child.close()
        self.procs[name], self.conns[name] = proc, parent

    def adopt(self, dht_pid: int) -> None:
        """Remember a child's DHT process and its p2pd, to end them should the child not."""
        import psutil

        try:
            dht = psutil.Process(dht_pid)
            self.others += [dht, *dht.children(recursive=True)]
        except psutil.Error:
            pass

    def expect(self, names: list[str], kind: str, timeout: float) -> dict[str, dict]:
        """The next message of each of `names`, which must be `kind`; `BenchError` on an error, a death or time out."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(names):
            waiting = {self.conns[n]: n for n in names if n not in got}
            ready = wait(list(waiting), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            for conn in ready:
                name = waiting[conn]
                try:
                    what, data = conn.recv()
                except EOFError:
                    raise BenchError(f"{name} exited (code {self.procs[name].exitcode}) before sending {kind!r}") from None
                if what == "error":
                    raise BenchError(str(data))
                if what != kind:
                    raise BenchError(f"{name} sent {what!r} where {kind!r} was expected")
                got[name] = data
            if time.monotonic() > deadline:
                late = ", ".join(n for n in names if n not in got)
                raise BenchError(f"no {kind!r} from {late} within {timeout:g} s")
        return got


    def close(self) -> None:
        """End every child: ask, wait, then terminate and kill; then any DHT process or p2pd left behind."""
        import psutil

        deadline = time.monotonic() + 15  # the time all of them get to end on their own
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            for proc in self.procs.values():
                if proc.is_alive():
                    getattr(proc, stop)()
                    proc.join(5)
        for p in self.others:
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs([p for p in self.others if p.is_running()], timeout=5)


def run_round(n: int, params: int, rate_bytes: float, root: Path, status: Any) -> dict[str, Any]:
    """One round with `n` workers in fresh processes; its figures."""
    run_dir = root / f"n{n}"
    run_dir.mkdir()
    fleet = Fleet()
    workers = [f"worker{i:02d}" for i in range(n)]
    try:
        status.update(f"N={n}: starting the coordinator (publishes v0)")
        fleet.start("coordinator", coordinator_main, str(root), str(run_dir), rate_bytes)
        ready = fleet.expect(["coordinator"], "ready", 300)["coordinator"]
        fleet.adopt(ready["dht_pid"])
        status.update(f"N={n}: starting {n} workers (each holds v0 and publishes a random delta)")
        for i, name in enumerate(workers):
            fleet.start(name, worker_main, str(root), str(run_dir), i, ready["maddr"], rate_bytes, params)
        published = fleet.expect(workers, "published", STEP_TIMEOUT_S)
        for data in published.values():
            fleet.adopt(data["dht_pid"])
        status.update(f"N={n}: the round: fetch {n} deltas, merge, publish v1, every worker pulls it")
        fleet.conns["coordinator"].send(("round", n))
        coord = fleet.expect(["coordinator"], "published", STEP_TIMEOUT_S)["coordinator"]
        pulled = fleet.expect(workers, "pulled", STEP_TIMEOUT_S)
        status.update(f"N={n}: collecting counters and stopping {n + 1} nodes")
        for name in ["coordinator", *workers]:
            fleet.conns[name].send(("stop",))
        stats = fleet.expect(["coordinator", *workers], "stats", 120)
    finally:
        fleet.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    delta = coord["delta_bytes"]
    coord_up = stats["coordinator"]["served"]
    coord_down = sum(p["served_before"] for p in pulled.values())  # only the coordinator fetched from them then
    worker_up = [stats[w]["served"] for w in workers]
    swarm_up = [stats[w]["served"] - pulled[w]["served_before"] for w in workers]
    rss = stats["coordinator"]["rss"]
    round_s = max(p["done_at"] for p in pulled.values()) - coord["t0"]
    coord_compute = coord["seconds"] - coord["steps"].get("fetch", 0.0)
    apply_s = max(p["apply_s"] for p in pulled.values())
    return {
        "workers": n, "round_s": round_s, "fetch_s": coord["steps"].get("fetch", 0.0), "merge_publish_s": coord_compute,
        "pull_s": max(p["done_at"] for p in pulled.values()) - coord["published_at"],
        "worker_apply_s_max": apply_s, "transfer_s": max(0.0, round_s - coord_compute - apply_s),
        "included": coord["included"], "rejected": coord["rejected"],
        "checkpoint_delta_bytes": delta, "worker_delta_bytes": statistics.mean(d["delta_bytes"] for d in published.values()),
        "coordinator_upload_bytes": coord_up, "coordinator_download_bytes": coord_down,
        "coordinator_upload_per_delta": coord_up / delta,
        "coordinator_peak_rss_bytes": rss, "coordinator_peak_rss_total_bytes": sum(rss.values()),
        "worker_upload_bytes_mean": statistics.mean(worker_up), "worker_upload_bytes_max": max(worker_up),
        "worker_swarm_upload_bytes_mean": statistics.mean(swarm_up), "worker_swarm_upload_bytes_max": max(swarm_up),
        "pull_sources_mean": statistics.mean(p["sources"] for p in pulled.values()),
        "pull_discarded_bytes": sum(p["discarded"] for p in pulled.values()),
    }


def project(row: dict[str, Any], params: int, rate_mbit: float) -> dict[str, float]:
    """PROJECTED 0.5B seconds at home uplinks: the transfer seconds measured scaled by bytes and by rate (the run's
    uplink / the home one); the round adds the compute seconds (merge + publish, apply) scaled by parameters."""
    k = TARGET_PARAMS / params
    compute = (row["merge_publish_s"] + row["worker_apply_s_max"]) * k
    out = {}
    for m in HOME_MBIT:
        out[f"projected_0.5B_transfer_s_at_{m:g}mbit"] = transfer = row["transfer_s"] * k * rate_mbit / m
        out[f"projected_0.5B_round_s_at_{m:g}mbit"] = transfer + compute
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def print_table(rows: list[dict[str, Any]], params: int, rate_mbit: float) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"one round, {params / 1e6:g}M-parameter bf16 model, uploads capped at "
                    f"{f'{rate_mbit:g} Mbit/s per peer' if rate_mbit else 'nothing'} (MB = 1e6 bytes)")
    cols = ["N", "round s", "fetch s", "merge s", "pull s", "coord up MB", "coord down MB", "up/delta",
            "coord RSS MB", "worker up MB mean/max", "of it swarm"]
    if rate_mbit:
        cols += [f"0.5B@{m:g}Mbit s* (transfer)" for m in HOME_MBIT]
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        cells = [str(r["workers"]), f"{r['round_s']:.1f}", f"{r['fetch_s']:.1f}", f"{r['merge_publish_s']:.1f}",
                 f"{r['pull_s']:.1f}", _mb(r["coordinator_upload_bytes"]), _mb(r["coordinator_download_bytes"]),
                 f"{r['coordinator_upload_per_delta']:.2f}", _mb(r["coordinator_peak_rss_total_bytes"]),
                 f"{_mb(r['worker_upload_bytes_mean'])}/{_mb(r['worker_upload_bytes_max'])}",
                 f"{_mb(r['worker_swarm_upload_bytes_mean'])}/{_mb(r['worker_swarm_upload_bytes_max'])}"]
        if rate_mbit:
            cells += [f"{r[f'projected_0.5B_round_s_at_{m:g}mbit']:,.0f} ({r[f'projected_0.5B_transfer_s_at_{m:g}mbit']:,.0f})"
                      for m in HOME_MBIT]
        t.add_row(*cells)
    console = Console()
    console.width = max(console.width, 150)
    console.print(t)
    print("coord RSS: peak RSS of the coordinator's process + its DHT process + p2pd; "
          "of it swarm: what workers uploaded to other workers (the rest went to the coordinator); "
          "*: projected, not measured")


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, checked on the measured rows."""
    worst = max(r["coordinator_upload_per_delta"] for r in rows)
    rss = [r["coordinator_peak_rss_total_bytes"] for r in rows]
    growth = max(rss) / min(rss) if min(rss) else float("inf")
    return {"upload_goal_met": worst <= 2.0, "worst_upload_per_delta": worst,
            "rss_growth_max_over_min": growth, "rss_flat": growth <= 1.2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=parse_workers, default=[2, 4, 8, 16], help="worker counts, comma-separated")
    ap.add_argument("--params", type=parse_count, default=25_000_000, help="model parameters (e.g. 25M, 0.5B)")
    ap.add_argument("--rate-mbit", type=parse_rate, default=100.0,
                    help="every peer's upload cap in Mbit/s (one upload at a time), 0 for uncapped")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    params = args.params // COLS * COLS  # whole rows of the synthetic tensors
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    work = Path(tempfile.mkdtemp(prefix="swarm-scale-"))
    need = (max(args.workers) + 1) * params * 2 * 6  # per node: base copy, v0, delta, merged delta, v1, slack
    free = shutil.disk_usage(work).free
    if need > free:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"error: N={max(args.workers)} with {params:,} parameters needs about {need / 1e9:.1f} GB "
                         f"of disk under {work.parent}, and {free / 1e9:.1f} GB are free; lower --params or --workers")
    from rich.console import Console

    rows = []
    try:
        with Console(stderr=True).status("building the base model") as status:
            from skillswarm.protocol.hashing import weights_hash
            from skillswarm.protocol.identity import Identity
            from skillswarm.protocol.netspec import new_network, save_spec
            from skillswarm.protocol.records import ScreenPolicy, TrustPolicy

            base = build_base(work, params)
            coord = Identity.load_or_create(work / "coordinator.key")
            save_spec(coord.sign_record(new_network(  # no usefulness test, so no lambda search either
                NET, str(base), weights_hash(base), SKILLS, [coord.public_key_hex], codec="dense_bf16",
                screen=ScreenPolicy(eval_n=0), trust=TrustPolicy(max_deltas_per_round=128),
                replicas=0)), work / "net.toml")  # a round's cost is measured, not a coordinator's leaving
            for n in args.workers:
                row = run_round(n, params, args.rate_mbit * 1e6 / 8, work, status)
                if args.rate_mbit:
                    row.update(project(row, params, args.rate_mbit))
                rows.append(row)
                log.warning("N=%d done: round %.1f s, coordinator up %.2fx a delta", n, row["round_s"],
                            row["coordinator_upload_per_delta"])
                log.info("N=%d: %s", n, json.dumps(row))
    except BenchError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("interrupted; every process the bench started was ended") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"params": params, "rate_mbit": args.rate_mbit, "projected_params": TARGET_PARAMS,
              "rows": rows, **verdict(rows)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(rows, params, args.rate_mbit)
        print(f"coordinator upload <= 2x one checkpoint delta for every N: {'yes' if result['upload_goal_met'] else 'NO'}"
              f" (worst {result['worst_upload_per_delta']:.2f}x); coordinator peak RSS max/min over N: "
              f"{result['rss_growth_max_over_min']:.2f} ({'flat' if result['rss_flat'] else 'NOT flat'}, goal <= 1.2)")
        if args.rate_mbit:
            print("0.5B: transfer seconds x bytes x (rate / home rate) + compute seconds x params")


if __name__ == "__main__":
    main()
