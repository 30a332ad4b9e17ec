"""A demo run's directory (`--out`): each node's home under nodes/, where a worker keeps the model it trained each
round, and every round's checkpoint of a finished run against the first-round specialists."""

from __future__ import annotations

from pathlib import Path

from skillswarm.node.checkpoints.store import CheckpointStore, network_dir, round_dir
from skillswarm.node.demo.config import NETWORK
from skillswarm.node.demo.retention import Solved, Versus, versus_specialists


def versus_first_specialists(out: Path, skills: list[str], last: int, n: int,
                             solved: Solved | None = None) -> dict[str, list[Versus]]:
    """Every round's merged checkpoint of the demo run in `out` (the coordinator's copies; the last one as pulled to
    out/final) against each skill's first-round specialist, on `n` tasks: does the swarm end above what one round of
    one worker reached alone?"""
    store = CheckpointStore(NETWORK, network_dir(NETWORK, out / "nodes" / "coordinator"))
    checkpoints = {v: store.path(v) for v in range(1, last + 1) if store.has(v)}
    if (out / "final").is_dir():
        checkpoints[last] = out / "final"
    first = {k: specialist_dir(out / "nodes" / f"worker-{k}", k, 0) for k in skills}
    return versus_specialists(checkpoints, {k: p for k, p in first.items() if p.is_dir()}, n, solved)


def specialist_dir(home: Path, skill: str, version: int) -> Path:
    """The model a demo worker (whose SKILLSWARM_HOME is `home`) trained on checkpoint `version`."""
    return round_dir(network_dir(NETWORK, home), skill, version) / "model"
