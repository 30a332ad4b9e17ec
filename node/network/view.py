"""What a node sees of its network, as JSON-able dicts: the data behind `net peers | status | skills |
deltas | checkpoints --json` and the dashboard (`net dashboard`), gathered once from a DHT peer."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec

from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.identity import fingerprint
from skillswarm.protocol.records import CheckpointManifest, DeltaRef, NetworkSpec, delta_layers


def peers_view(dht: Any, spec: NetworkSpec) -> dict[str, Any]:
    """Every node online: its signed peer record, and how long ago it was seen."""
    now = time.time()
    return {"network": spec.network, "peers": [
        {**msgspec.to_builtins(p), "signature": p.signature.hex(), "last_seen_s": round(now - p.created, 1)}
        for p in dht.get_peers()]}


def status_view(dht: Any, spec: NetworkSpec, joined: list[str]) -> dict[str, Any]:
    """Peers by role, workers per skill, checkpoint versions, deltas on the latest, coordinators' states."""
    online = dht.get_peers()
    checkpoints = dht.get_checkpoints(trusted=spec.coordinators, quorum=spec.quorum_k())
    latest = max((c.version for c in checkpoints), default=None)
    deltas = dht.get_deltas(latest if latest is not None else 0)
    return {
        "network": spec.network, "joined_via": joined, "connections": len(dht.connected_peers()),
        "peers_online": len(online), "roles": dict(Counter(p.role for p in online)),
        "workers_per_skill": {s: sum(1 for p in online if p.role == "worker" and s in p.skills) for s in spec.skills},
        "latest_checkpoint": latest, "checkpoint_versions": sorted({c.version for c in checkpoints}),
        "deltas_on_latest": len(deltas), "trusted_coordinators": len(spec.coordinators),
        "coordinators": [{"peer_id": p.peer_id, "state": p.state, "note": p.note,
                          "trusted": p.author in spec.coordinators} for p in online if p.role == "coordinator"],
        **leadership_view(dht, spec, online, checkpoints),
    }


def leadership_view(dht: Any, spec: NetworkSpec, online: list, checkpoints: list[CheckpointManifest]) -> dict[str, Any]:
    """With several coordinators: the quorum, who leads the round on the latest checkpoint, the signatures
    collected on the latest and the next version, and the rounds a coordinator took over (a version first signed
    by another than its round's first leader: node/roles/leadership.py)."""
    from skillswarm.node.roles.leadership import round_leader, round_order

    k, coords = spec.quorum_k(), spec.coordinators
    latest = max((c.version for c in checkpoints), default=None)
    live = {p.author for p in online if p.role == "coordinator"} & set(coords)
    leader = round_leader(coords, latest, live, 0.0, spec.round.overdue_s()) if latest is not None else None
    signatures = []
    for v in ([] if latest is None else [latest, latest + 1]):
        for e in dht.checkpoint_endorsements(v, trusted=coords):
            signatures.append({"version": v, "digest": e.digest[:12], "weights_hash": e.manifest.weights_hash[:12],
                               "signers": [fingerprint(a) for a in e.signers], "accepted": len(e.signers) >= k})
    failovers = [c.version for c in checkpoints if c.parent_version is not None and len(coords) > 1
                 and c.author != round_order(coords, c.parent_version)[0]]
    return {"quorum": k, "leader": None if leader is None else fingerprint(leader), "signatures": signatures,
            "failovers": failovers}


def skills_view(dht: Any, spec: NetworkSpec) -> dict[str, Any]:
    """Each skill shard: workers online, each contributor's latest progress, the latest merged accuracy."""
    online = dht.get_peers()
    stats = {s: dht.get_skill_stats(s) for s in spec.skills}
    latest = dht.latest_checkpoint(trusted=spec.coordinators, quorum=spec.quorum_k())
    now = time.time()
    out = []
    for s in spec.skills:
        rows = sorted(stats[s], key=lambda r: -r.created)
        metric = latest.metrics.get(s) if latest else None
        out.append({
            "skill": s, "workers_online": sum(1 for p in online if p.role == "worker" and s in p.skills),
            "contributors": [{"author": fingerprint(r.author), "checkpoint_version": r.checkpoint_version,
                              "steps": r.stats.steps, "mean_reward": r.stats.mean_reward,
                              "accuracy_after": r.stats.accuracy_after, "updated_s": round(now - r.created, 1)} for r in rows],
            "merged_accuracy": None if metric is None else metric.accuracy,
            "merged_version": None if latest is None else latest.version,
        })
    return {"network": spec.network, "skills": out}


def deltas_view(dht: Any, spec: NetworkSpec, version: int | None = None) -> dict[str, Any]:
    """Deltas per base version (default: the latest and the one before) with their screening result."""
    latest = dht.latest_checkpoint(trusted=spec.coordinators, quorum=spec.quorum_k())
    top = latest.version if latest else 0
    versions = [version] if version is not None else sorted({max(top - 1, 0), top})
    out = []
    for v in versions:
        m = dht.get_checkpoint(v + 1, trusted=spec.coordinators, quorum=spec.quorum_k())
        included = {d.blob for d in m.included} if m else set()
        reasons = {r.blob: r.reason for r in m.rejected} if m else {}
        # merged on credit: inconclusive on its skill, from a key with a record (node/roles/rounds/usefulness.py)
        reasons.update({d.blob: "on credit: its gain was not significant" for d in (m.included if m else [])
                        if d.figures.get("on_credit", 0.0) > 0})
        # a saturated skill's repair: merged in its first layers only (node/roles/rounds/usefulness.py)
        for d in (m.included if m else []):
            if layers := _layers(m, d):
                reasons[d.blob] = ", ".join(filter(None, [f"a repair of its first {layers} layer(s), merged there only",
                                                          reasons.get(d.blob)]))
        for d in dht.get_deltas(v):
            verdict = "pending" if m is None else "included" if d.blob in included else "rejected" if d.blob in reasons else "late"
            out.append({"base_version": v, "skill": d.skill, "author": fingerprint(d.author), "blob": d.blob,
                        "size": d.size, "codec": d.codec, "norm": d.norm, "steps": d.stats.steps,
                        "accuracy_before": d.stats.accuracy_before, "accuracy_after": d.stats.accuracy_after,
                        "screening": verdict, "reason": reasons.get(d.blob)})
    return {"network": spec.network, "deltas": out}


def _layers(manifest: CheckpointManifest, ref: DeltaRef) -> int | None:
    """The layers `manifest` says `ref` was merged in (None: all, or a manifest that does not say: shown as no repair)."""
    try:
        return delta_layers(manifest, ref)
    except RecordError:
        return None


def checkpoints_view(dht: Any, spec: NetworkSpec) -> dict[str, Any]:
    """Checkpoint history signed by trusted coordinators (parents, method, deltas in and out, metrics)."""
    return {"network": spec.network, "checkpoints": [
        {**msgspec.to_builtins(c), "signature": c.signature.hex()} for c in dht.get_checkpoints(trusted=spec.coordinators, quorum=spec.quorum_k())]}


def snapshot(dht: Any, spec: NetworkSpec, joined: list[str]) -> dict[str, Any]:
    """Everything the dashboard shows, gathered in one pass."""
    return {"network": spec.network, "time": time.time(), "status": status_view(dht, spec, joined),
            "peers": peers_view(dht, spec)["peers"], "skills": skills_view(dht, spec)["skills"],
            "deltas": deltas_view(dht, spec)["deltas"], "checkpoints": checkpoints_view(dht, spec)["checkpoints"]}
