"""The demo: a whole swarm on this machine. A bootstrap peer, a coordinator and one worker per skill run
as separate `skillswarm` processes on 127.0.0.1 for a few rounds; then the final checkpoint is pulled
and each skill's gain is compared between its specialist and the merged model.

Figures (all greedy, on the same held-out tasks, `eval_n` of them): base = the genesis checkpoint,
measured by each worker before its first round; specialist = the worker's model after the last round;
merged = the coordinator's evaluation of the final checkpoint. retention = (merged - base) /
(specialist - base): how much of the specialist's gain the merged generalist keeps. The three models are then
re-measured task by task on `retention_n` held-out tasks (a prefix-extension of the same list) for a retention
with about half the sampling error, and its interval.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from skillswarm.node.demo.compare import compare_methods, parse_method
from skillswarm.node.demo.config import DemoConfig, make_spec
from skillswarm.node.demo.report import make_report, plot_report
from skillswarm.node.demo.retention import Solved, remeasure
from skillswarm.node.demo.rundir import specialist_dir, versus_first_specialists
from skillswarm.node.demo.supervisor import bootstrap_address, swarm
from skillswarm.node.rl.config import save_settings
from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import save_spec
from skillswarm.protocol.records import CheckpointManifest

log = logging.getLogger(__name__)


@dataclass
class DemoStatus:
    """What the progress display shows."""

    version: int = 0
    deltas: int = 0
    phase: str = "starting"
    log: list[str] = field(default_factory=list)


def run_demo(cfg: DemoConfig, base: Path, on_status: Callable[[DemoStatus], None] | None = None) -> dict:
    """Run the swarm for `cfg.rounds` rounds and return the report (also written to out/report.json)."""
    from skillswarm.node.checkpoints.pull import check_out, export, find_checkpoint, pull
    from skillswarm.node.network.session import open_session

    for text in [cfg.method, *cfg.compare]:
        parse_method(text, cfg)  # a typo fails now, not after the rounds
    t0 = time.monotonic()
    status = DemoStatus()
    notify = on_status or (lambda st: None)
    cfg.out.mkdir(parents=True, exist_ok=True)
    try:  # the final checkpoint's export refuses what it did not write: say so now, not after the rounds
        check_out(cfg.out / "final")
    except SkillswarmError as e:
        raise SkillswarmError(f"{e} (the demo writes its final checkpoint to {cfg.out / 'final'}: remove that "
                              "directory, or give the demo another --out)") from None
    with swarm(cfg.out) as s:
        coord_key = s.home("coordinator") / "config" / "identity.key"
        spec = make_spec(cfg, base, Identity.load_or_create(coord_key))
        spec_file = save_spec(spec, cfg.out / "network.toml")
        s.start("bootstrap", ["net", "serve", "--host", "127.0.0.1", "--network", str(spec_file), "--json"])
        maddr = bootstrap_address(s)
        join = ["--network", str(spec_file), "--peers", maddr, "--host", "127.0.0.1"]
        s.start("coordinator", ["coordinator", "run", *join, "--key", str(coord_key), "--eval-n", str(cfg.eval_n)])
        settings = cfg.worker_settings()
        workers = [f"worker-{k}" for k in cfg.skills]
        for skill, name in zip(cfg.skills, workers):
            settings_file = save_settings(settings, s.home(name) / "settings.toml")
            s.start(name, ["node", "run", *join, "--skill", skill, "--settings", str(settings_file),
                           "--rounds", str(cfg.rounds), "--no-progress"])
        status.phase = "training"
        notify(status)
        deadline = time.monotonic() + cfg.timeout_s
        with open_session(spec_file, peers=[maddr], host="127.0.0.1", client_mode=True, ephemeral_key=True,
                          cache=s.home("observer") / "cache") as obs:
            final: CheckpointManifest | None = None
            while final is None:
                if time.monotonic() > deadline:
                    raise SkillswarmError(f"the demo did not finish {cfg.rounds} rounds in {cfg.timeout_s:.0f} s; "
                                          f"see the logs in {cfg.out / 'logs'}")
                s.check_alive(["bootstrap", "coordinator", *workers])
                latest = find_checkpoint(obs.dht, spec)
                if latest is not None:
                    status.version = latest.version
                    status.deltas = len(obs.dht.get_deltas(latest.version))
                    if latest.version >= cfg.rounds:
                        final = latest
                notify(status)
                time.sleep(2.0)
            status.phase = "pulling"
            notify(status)
            history = [obs.dht.get_checkpoint(v, trusted=spec.coordinators, quorum=spec.quorum_k()) for v in range(1, final.version + 1)]
            deltas = {v: obs.dht.get_deltas(v) for v in range(final.version)}
            pull(obs.dht, spec, final, obs.store, obs.blobs, progress=False)
            export(obs.store, final.version, cfg.out / "final")
            alternatives = {}
            if cfg.compare:
                status.phase = "comparing"
                notify(status)
                alternatives = compare_methods(obs, spec, final, cfg)
        for name in workers:  # they pull the final checkpoint and exit by themselves
            try:
                s.procs[name].wait(120)
            except subprocess.TimeoutExpired:
                s.stop(name)
        s.stop("coordinator")
        s.stop("bootstrap")
        status.phase = "remeasuring"
        notify(status)
        trained = {k: specialist_dir(s.home(f"worker-{k}"), k, final.version - 1) for k in cfg.skills}
        missing = sorted(k for k, path in trained.items() if not path.is_dir())
        if missing:  # a worker that did not finish the last round itself has no interval
            log.warning("no last-round model for %s: no re-measured retention for it", ", ".join(missing))
        solved: Solved = {}  # the final checkpoint (and a one-round run's specialists) are played once for both
        remeasured = remeasure(base, {k: p for k, p in trained.items() if k not in missing}, cfg.out / "final",
                               cfg.retention_n, solved=solved)
        versus = versus_first_specialists(cfg.out, list(cfg.skills), final.version, cfg.retention_n, solved)
    report = make_report(cfg, final, [h for h in history if h is not None], deltas, time.monotonic() - t0,
                         alternatives, remeasured, versus)
    atomic_write_text(cfg.out / "report.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    plot_report(report, cfg.out / "report.png")
    status.phase = "done"
    notify(status)
    return report
