"""`skillswarm net skills | deltas | checkpoints`: what the network has learned, from a short-lived
client peer (tables, or `--json`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer

from skillswarm.node.cli.common import JsonOpt, console, print_json, table
from skillswarm.node.cli.net import NetworkOpt, PeersOpt, _ago, _observer, app
from skillswarm.protocol.identity import fingerprint
from skillswarm.protocol.netspec import load_spec


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@app.command("skills")
def skills_cmd(network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None, json: JsonOpt = False) -> None:
    """Each skill shard: its contributors (workers online), their latest progress, and the latest merged score."""
    spec = load_spec(network)
    with _observer(spec, peers) as dht:
        online = dht.get_peers()
        stats = {s: dht.get_skill_stats(s) for s in spec.skills}
        latest = dht.latest_checkpoint(trusted=spec.coordinators)
    now = time.time()
    out = []
    for s in spec.skills:
        workers = [p for p in online if p.role == "worker" and s in p.skills]
        rows = sorted(stats[s], key=lambda r: -r.created)
        metric = latest.metrics.get(s) if latest else None
        out.append({
            "skill": s, "workers_online": len(workers),
            "contributors": [{"author": fingerprint(r.author), "checkpoint_version": r.checkpoint_version,
                              "steps": r.stats.steps, "mean_reward": r.stats.mean_reward,
                              "accuracy_after": r.stats.accuracy_after, "updated_s": round(now - r.created, 1)} for r in rows],
            "merged_accuracy": None if metric is None else metric.accuracy,
            "merged_version": None if latest is None else latest.version,
        })
    if json:
        print_json({"network": spec.network, "skills": out})
        return
    rows = []
    for o in out:
        best = o["contributors"][0] if o["contributors"] else None
        rows.append([o["skill"], o["workers_online"], len(o["contributors"]),
                     "-" if best is None else f"{best['mean_reward']:.3f} (v{best['checkpoint_version']}, step {best['steps']})",
                     "-" if best is None else _ago(best["updated_s"]),
                     "-" if o["merged_accuracy"] is None else f"{_pct(o['merged_accuracy'])} (v{o['merged_version']})"])
    console.print(table(f"skills of {spec.network}", ["skill", "workers online", "contributors", "latest reward",
                                                       "updated", "merged accuracy"], rows))


@app.command("deltas")
def deltas_cmd(
    network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None,
    version: Annotated[Optional[int], typer.Option(help="Base version (default: the latest and the one before).")] = None,
    json: JsonOpt = False,
) -> None:
    """Deltas per base version with their screening result (from the manifest that merged them)."""
    spec = load_spec(network)
    with _observer(spec, peers) as dht:
        latest = dht.latest_checkpoint(trusted=spec.coordinators)
        top = latest.version if latest else 0
        versions = [version] if version is not None else sorted({max(top - 1, 0), top})
        found = {v: dht.get_deltas(v) for v in versions}
        merged = {v: dht.get_checkpoint(v + 1, trusted=spec.coordinators) for v in versions}
    out = []
    for v in versions:
        m = merged[v]
        included = {d.blob for d in m.included} if m else set()
        reasons = {r.blob: r.reason for r in m.rejected} if m else {}
        for d in found[v]:
            verdict = "pending" if m is None else "included" if d.blob in included else "rejected" if d.blob in reasons else "late"
            out.append({"base_version": v, "skill": d.skill, "author": fingerprint(d.author), "blob": d.blob,
                        "size": d.size, "codec": d.codec, "norm": d.norm, "steps": d.stats.steps,
                        "accuracy_before": d.stats.accuracy_before, "accuracy_after": d.stats.accuracy_after,
                        "screening": verdict, "reason": reasons.get(d.blob)})
    if json:
        print_json({"network": spec.network, "deltas": out})
        return
    rows = [[f"v{o['base_version']}", o["skill"], o["author"], o["blob"][:12], f"{o['size'] / 1e6:.1f} MB", o["codec"],
             f"{o['norm']:.3g}", f"{_pct(o['accuracy_before'])} -> {_pct(o['accuracy_after'])}",
             o["screening"] + (f": {o['reason']}" if o["reason"] else "")] for o in out]
    console.print(table(f"deltas in {spec.network}", ["base", "skill", "author", "blob", "size", "codec", "norm",
                                                       "held-out", "screening"], rows))


@app.command("checkpoints")
def checkpoints_cmd(network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None, json: JsonOpt = False) -> None:
    """Checkpoint history (trusted coordinators only): parents, merge method, deltas in and out, per-skill metrics."""
    spec = load_spec(network)
    with _observer(spec, peers) as dht:
        found = dht.get_checkpoints(trusted=spec.coordinators)
    if json:
        print_json({"network": spec.network, "checkpoints": [
            {**msgspec.to_builtins(c), "signature": c.signature.hex()} for c in found]})
        return
    rows = [[f"v{c.version}", "-" if c.parent_version is None else f"v{c.parent_version}", c.weights_hash[:12],
             c.method or "base", len(c.included), len(c.rejected),
             ", ".join(f"{k} {_pct(m.accuracy)}" for k, m in sorted(c.metrics.items())) or "-",
             fingerprint(c.author), _ago(time.time() - c.created)] for c in found]
    console.print(table(f"checkpoints of {spec.network}", ["version", "parent", "weights", "method", "in", "out",
                                                            "accuracy", "coordinator", "published"], rows))
