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

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from msgspec import UNSET

from skillswarm.node.retention import (
    AT_OR_ABOVE_P,
    LEVEL,
    RETENTION_N,
    Remeasured,
    Solved,
    Versus,
    remeasure,
    retention,
    versus_specialists,
)
from skillswarm.node.rl.config import EVAL_N, TrainConfig, WorkerSettings, default_of, save_settings
from skillswarm.node.store import CheckpointStore, network_dir, round_dir
from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import new_network, save_spec
from skillswarm.protocol.records import (
    DEFAULT_LAMBDA_SEARCH,
    CheckpointManifest,
    Codec,
    DeltaManifest,
    MergeMethod,
    MergePolicy,
    NetworkSpec,
    RoundPolicy,
    ScreenPolicy,
)

log = logging.getLogger(__name__)

NETWORK = "demo"
DESCRIPTION = "skillswarm demo on 127.0.0.1"


@dataclass
class DemoConfig:
    """What the demo runs."""

    out: Path
    skills: list[str]
    # More, shorter rounds keep more of each gain than fewer, longer ones (same steps in all; see docs/demo.md):
    # every skill re-learns on the merged model, and the last round's deltas, the ones merged last, are small.
    rounds: int = 4
    # The same steps for every skill (time-boxed rounds starve the slow, multi-turn ones): the network's default.
    steps_per_round: int = RoundPolicy().steps_per_round
    # A cap on each round's training, a safety net for slow machines: 50 steps of calc (3.5-6x the tokens of the other
    # skills' steps) took 65 s on one 2-core machine and about 3 minutes on a slower one, where a 2-minute cap
    # ended its rounds at 12-23 steps (docs/nano-model.md, "The swarm on a second machine").
    minutes_per_round: float | None = 3.0
    # The workers' learning rate on vN: lr * lr_decay**N (RoundPolicy.lr_decay); 1: constant. 0.8 kept no more of the
    # gains in three runs and merged 5 points fewer (docs/merging.md, "What the last round loses").
    lr_decay: float = 1.0
    method: str = MergePolicy().method
    density: float = MergePolicy().density
    # The network's: with the workers' retain loss the deltas of a round add up at full strength (docs/demo.md)
    scale: float = MergePolicy().scale
    scale_search: list[float] = field(default_factory=lambda: list(DEFAULT_LAMBDA_SEARCH))  # other lambdas, on evidence
    compare: list[str] = field(default_factory=lambda: ["task_arithmetic@1", "task_arithmetic@0.6"])  # re-merge the last round
    eval_n: int = EVAL_N
    retention_n: int = RETENTION_N  # held-out tasks per skill of the final re-measure
    # The demo's own, not TrainConfig's 16: half the episodes per step, for one machine running a worker per skill.
    group_size: int = 8
    batch: int = default_of(TrainConfig, "batch")
    lr: float = default_of(TrainConfig, "lr")
    retain: float = default_of(TrainConfig, "retain")  # the workers' retain loss (0: off)
    # The demo's own, not the network default (int8): lossless deltas, so no codec loss enters its retention figures.
    codec: Codec = "dense_fp32"
    timeout_s: float = 1800.0
    screen: ScreenPolicy = field(default_factory=ScreenPolicy.for_new_network)  # what the coordinator checks before merging a delta

    def worker_settings(self) -> WorkerSettings:
        """What every demo worker trains with (its --settings file): one torch thread each, as the workers share the
        machine's cores."""
        return WorkerSettings(group_size=self.group_size, batch=self.batch, lr=self.lr, threads=1, eval_n=self.eval_n,
                              retain=self.retain, minutes_per_round=self.minutes_per_round or None)


@dataclass
class DemoStatus:
    """What the progress display shows."""

    version: int = 0
    deltas: int = 0
    phase: str = "starting"
    log: list[str] = field(default_factory=list)


class Swarm:
    """The demo's processes; every one of them is stopped on exit, whatever happens."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def home(self, name: str) -> Path:
        path = self.out / "nodes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, "SKILLSWARM_HOME": str(self.home(name)), "COLUMNS": "160"}
        log_file = open(self.out / "logs" / f"{name}.log", "w")
        exe = Path(sys.executable).with_name("skillswarm")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "skillswarm.node.cli.app"]
        p = subprocess.Popen([*cmd, *args], stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.out / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self, names: list[str]) -> None:
        for name in names:
            p = self.procs[name]
            if p.poll() is not None and p.returncode != 0:
                raise SkillswarmError(f"the demo's {name} process exited with {p.returncode}:\n{self.log_tail(name)}")

    def stop(self, name: str, timeout: float = 60.0) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=30)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def swarm(out: Path) -> Iterator[Swarm]:
    """The demo's processes, stopped on the way out: on an error, Ctrl-C or a SIGTERM to the demo itself
    (whose default action would end it at once and leave the swarm running)."""
    s = Swarm(out)
    main = threading.current_thread() is threading.main_thread()  # signal handlers belong to the main thread
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield s
    finally:
        s.close()
        if previous is not None:  # None: the handler was not Python's, and cannot be put back from here
            signal.signal(signal.SIGTERM, previous)


def _bootstrap_address(s: Swarm, timeout: float = 90.0) -> str:
    path = s.out / "logs" / "bootstrap.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.check_alive(["bootstrap"])
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and "maddrs" in line:
                return json.loads(line)["maddrs"][0]
        time.sleep(0.2)
    raise SkillswarmError(f"the bootstrap peer printed no address within {timeout:.0f} s:\n{s.log_tail('bootstrap')}")


def make_spec(cfg: DemoConfig, base: Path, coordinator: Identity) -> NetworkSpec:
    """The demo network: the nano base, the skills, the coordinator, a round that waits for every skill."""
    return coordinator.sign_record(new_network(
        NETWORK, str(base), weights_hash(base), cfg.skills, [coordinator.public_key_hex],
        description=DESCRIPTION, codec=cfg.codec,
        round=RoundPolicy(steps_per_round=cfg.steps_per_round, min_deltas=len(cfg.skills), max_wait_s=cfg.timeout_s,
                          lr_decay=cfg.lr_decay if cfg.lr_decay < 1 else UNSET),
        merge=MergePolicy(method=cfg.method, density=cfg.density, scale=cfg.scale,  # type: ignore[arg-type]
                          scale_search=cfg.scale_search),
        screen=cfg.screen,
    ))


def run_demo(cfg: DemoConfig, base: Path, on_status: Callable[[DemoStatus], None] | None = None) -> dict:
    """Run the swarm for `cfg.rounds` rounds and return the report (also written to out/report.json)."""
    from skillswarm.node.pull import check_out, export, find_checkpoint, pull
    from skillswarm.node.session import open_session

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
        maddr = _bootstrap_address(s)
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
            history = [obs.dht.get_checkpoint(v, trusted=spec.coordinators) for v in range(1, final.version + 1)]
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


def parse_method(text: str, cfg: DemoConfig) -> MergePolicy:
    """`METHOD` or `METHOD@LAMBDA` (density from the demo's settings) as a merge policy."""
    method, _, scale = text.partition("@")
    known = typing.get_args(MergeMethod)
    try:
        value = float(scale) if scale else cfg.scale
    except ValueError:
        value = -1.0
    if method not in known or not 0 < value <= 100:
        raise SkillswarmError(f"bad merge method {text!r}: use METHOD or METHOD@LAMBDA with METHOD one of "
                              f"{', '.join(known)} and 0 < LAMBDA <= 100, e.g. task_arithmetic@0.6")
    return MergePolicy(method=method, density=cfg.density, scale=value)  # type: ignore[arg-type]


def method_label(policy: MergePolicy) -> str:
    """`ties(density=0.5, lambda=1.0)`: a method with the parameters that matter to it."""
    uses_density = policy.method in ("ties", "dare_linear", "dare_ties", "breadcrumbs")
    density = f"density={policy.density:g}, " if uses_density else ""
    return f"{policy.method}({density}lambda={policy.scale:g})"


def compare_methods(obs, spec: NetworkSpec, final: CheckpointManifest, cfg: DemoConfig) -> dict[str, dict]:
    """Re-merge the final round's deltas onto its parent with each of `cfg.compare` and evaluate every skill
    (same deltas, same held-out tasks), so one run reports retention per merge method."""
    import shutil

    from skillswarm.merge import round_merge
    from skillswarm.node.coordinator import evaluate_all, merge_inputs

    parent_dir, deltas = merge_inputs(spec, obs.dht, obs.store, obs.blobs, final)
    out: dict[str, dict] = {}
    if not deltas:  # the last round rejected every delta: its checkpoint is its parent, nothing to re-merge
        log.info("v%d merged no delta: no other method to compare", final.version)
        return out
    for text in cfg.compare:
        policy = parse_method(text, cfg)
        staging = obs.store.staging()
        try:
            round_merge(parent_dir, deltas, policy, staging / "ckpt", seed=final.parent_version or 0, progress=True)
            metrics = evaluate_all(staging / "ckpt", list(cfg.skills), cfg.eval_n)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        out[method_label(policy)] = {k: m.accuracy for k, m in metrics.items()}
        log.info("re-merged v%d with %s: %s", final.version, method_label(policy), out[method_label(policy)])
    return out


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


def make_report(cfg: DemoConfig, final: CheckpointManifest, history: list[CheckpointManifest],
                deltas: dict[int, list[DeltaManifest]], seconds: float,
                alternatives: dict[str, dict[str, float]] | None = None,
                remeasured: dict[str, Remeasured] | None = None,
                versus: dict[str, list[Versus]] | None = None) -> dict:
    """report.json: per skill base / specialist / merged accuracy and retention, plus the run's history;
    `methods` holds the same figures for the final round re-merged with other methods; `remeasured` the three
    models on `retention_n` tasks (from `remeasure`), and `retention_interval` that retention's interval;
    `versus_first_specialist` every round's checkpoint against the first-round specialist (`versus_specialists`)."""
    skills = {}
    last = final.version - 1
    for skill in cfg.skills:
        first = [d for d in deltas.get(0, []) if d.skill == skill]
        spec_d = [d for d in deltas.get(last, []) if d.skill == skill]
        base = first[0].stats.accuracy_before if first else None
        specialist = max((d.stats.accuracy_after for d in spec_d if d.stats.accuracy_after is not None), default=None)
        metric = final.metrics.get(skill)
        merged = metric.accuracy if metric else None
        rounds = [max((d.stats.accuracy_after for d in deltas.get(v, []) if d.skill == skill
                       and d.stats.accuracy_after is not None), default=None) for v in range(final.version)]
        best = max((a for a in rounds if a is not None), default=None)
        skills[skill] = {"base": base, "specialist": specialist, "merged": merged,
                         "retention": retention(base, specialist, merged),
                         "round_specialists": rounds, "best_round_specialist": best,
                         "first_round_specialist": rounds[0] if rounds else None,
                         "remeasured": _remeasured_row(r) if (r := (remeasured or {}).get(skill)) else None,
                         "retention_interval": list(r.interval) if r and r.interval else None,
                         "versus_first_specialist": [_versus_row(x) for x in (versus or {}).get(skill, [])]}
    run_label = method_label(MergePolicy(method=cfg.method, density=cfg.density, scale=cfg.scale))  # type: ignore[arg-type]
    methods = {run_label: {k: {"merged": v["merged"], "retention": v["retention"]} for k, v in skills.items()}}
    for label, accuracy in (alternatives or {}).items():
        methods[label] = {k: {"merged": accuracy.get(k), "retention": retention(v["base"], v["specialist"], accuracy.get(k))}
                          for k, v in skills.items()}
    return {
        "skills": skills, "method": cfg.method, "method_label": run_label, "methods": methods,
        "rounds": final.version, "steps_per_round": cfg.steps_per_round, "minutes_per_round": cfg.minutes_per_round,
        "retain": cfg.retain, "lr_decay": cfg.lr_decay,
        "eval_n": cfg.eval_n, "retention_n": cfg.retention_n, "interval_level": LEVEL, "at_or_above_p": AT_OR_ABOVE_P,
        "seconds": round(seconds, 1), "final_version": final.version,
        "weights_hash": final.weights_hash, "checkpoint": str(cfg.out / "final"),
        "history": [{"version": h.version, "included": len(h.included), "rejected": len(h.rejected),
                     "accuracy": {k: m.accuracy for k, m in sorted(h.metrics.items())}} for h in history],
        "per_round": per_round(skills, history),
        "specialists": {str(v): {d.skill: {"before": d.stats.accuracy_before, "after": d.stats.accuracy_after}
                                 for d in ds} for v, ds in sorted(deltas.items())},
    }


def _remeasured_row(r: Remeasured) -> dict:
    return {"n": r.n, "base": r.base, "specialist": r.specialist, "merged": r.merged, "retention": r.retention}


def _versus_row(x: Versus) -> dict:
    return {"version": x.version, "merged": x.merged, "specialist": x.specialist, "wins": x.wins, "losses": x.losses,
            "p_worse": round(x.p_worse, 4), "at_or_above": x.at_or_above}


def per_round(skills: dict[str, dict], history: list[CheckpointManifest]) -> list[dict]:
    """Merged accuracy per skill at every version (v0: the base, as its workers measured it), with how many
    deltas each merge included and rejected: whether the swarm keeps improving round over round."""
    rows = [{"version": 0, "accuracy": {k: v["base"] for k, v in skills.items()}, "included": None, "rejected": None}]
    for h in sorted(history, key=lambda h: h.version):
        rows.append({"version": h.version, "accuracy": {k: (h.metrics[k].accuracy if k in h.metrics else None)
                                                        for k in skills},
                     "included": len(h.included), "rejected": len(h.rejected)})
    return rows


def plot_report(report: dict, png: Path) -> Path:
    """A grouped bar chart: base, specialist and merged accuracy per skill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["skills"])
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
    for i, (key, color) in enumerate((("base", "#9e9e9e"), ("specialist", "#1f77b4"), ("merged", "#2ca02c"))):
        values = [100 * (report["skills"][n][key] or 0) for n in names]
        ax.bar([x + 0.27 * (i - 1) for x in range(len(names))], values, 0.27, label=key, color=color)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"skillswarm demo: {report.get('method_label', report['method'])}, {report['rounds']} rounds")
    ax.legend(frameon=False)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)
    return png
