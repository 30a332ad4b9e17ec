"""The continuity drill: does a network with several coordinators keep going, and keep its history pullable, while
its peers die and come back?

On 127.0.0.1, each a real `skillswarm` process with its own SKILLSWARM_HOME (as the demo starts them): a bootstrap
peer (`net serve`, a fixed key and port, so it can come back at the same address), an archive (`net serve
--archive`), three coordinators of which two must sign a checkpoint (`--quorum 2`, `--failover 30`) and three
workers of the nano model (short rounds). An in-process observer reads every version's signed manifests from the
DHT all along. The events, in order:
  a. v1 is accepted (two signatures on one body);
  b. the leader of the round on v1 (`round_order(coordinators, 1)[0]`) is SIGKILLed at once, mid-round: the
     seconds until v2 is accepted are the failover (the next coordinator takes over when the dead one's heartbeat
     expires, about 30 s);
  c. the bootstrap is restarted (SIGTERM, then the same key and port), and the network goes on to v3; then a fresh
     node joining through the bootstrap alone says which version it finds (a figure, not a goal);
  d. a coordinator is stopped (SIGTERM) right after it publishes: the leader of v4, as soon as v4 is accepted;
  e. every process but the archive is stopped, the bootstrap comes back alone, and after two of the archive's
     refreshes a fresh node (`skillswarm pull` with a fresh SKILLSWARM_HOME, one per version) pulls every version
     0..latest; each pulled directory's weights must hash to the accepted manifest's `weights_hash`. Versions that
     fail are pulled again with --peers the archive's own address, a diagnosis (is the archive missing them, or is
     it only not found through the bootstrap?) that does not count for the goal.

Figures: rounds completed (accepted versions beyond v0), the failover seconds, the versions accepted and those
pullable at the end, forks (versions for which more than one distinct manifest body ever had a quorum of
signatures, across every observation: goal 0), the most distinct bodies seen for one version, and the bytes each
process uploaded to peers (each prints it when stopped with SIGTERM; a SIGKILLed one has none: null). Goals: every
version pullable at the end, no fork. Exit status 0 when both are met, 1 otherwise (or when the drill failed; its
error and the log tails are in the report).

    .venv/bin/python bench/continuity.py [--steps 10] [--timeout 1800] [--work DIR] [--json]

Progress goes to stderr; with --json, stdout holds one JSON object. Everything goes to a temp directory (kept with
--work); every process the drill starts it ends, on every way out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NET = "cont"
SKILLS = ["arith", "reverse"]
COORDINATORS = 3
WORKERS = 3
QUORUM = 2
FAILOVER_S = 30.0
MAX_WAIT_S = 60.0
REFRESH_S = 5.0
POLL_S = 1.0
STOP_WAIT_S = 90.0  # what a SIGTERMed process gets to leave before its process group is killed
STOPPED_RE = re.compile(r"stopped after (\d+) (merge|round)\(s\); uploaded ([0-9.]+) MB to peers")


class DrillError(Exception):
    """The drill could not go on: what happened, for the report."""


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commit() -> str:
    """HEAD's commit (read only), marked -dirty when tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


# ---- processes ------------------------------------------------------------------------------------------------
def _swarm_class() -> type:
    from skillswarm.node.demo.supervisor import Swarm

    class Drill(Swarm):
        """The demo's supervisor (a home and a log per process), with a process's whole group killed when it
        does not leave (its DHT process and p2pd with it), SIGKILL as an event of the drill, and a note of how
        each process was stopped."""

        def __init__(self, out: Path) -> None:
            super().__init__(out)
            self.how: dict[str, str] = {}  # name -> "SIGTERM", "SIGKILL", "exited"
            self.roles: dict[str, str] = {}

        def start_as(self, role: str, name: str, args: list[str]) -> subprocess.Popen:
            self.roles[name] = role
            return self.start(name, args)

        def alive(self, name: str) -> bool:
            p = self.procs.get(name)
            return p is not None and p.poll() is None

        def _group(self, name: str, sig: int) -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.procs[name].pid, sig)

        def kill(self, name: str) -> None:
            """SIGKILL the process and everything it started (a machine that dies)."""
            if not self.alive(name):
                return
            self._group(name, signal.SIGKILL)
            self.procs[name].wait(30)
            self.how[name] = "SIGKILL"

        def stop_all(self, names: list[str], timeout: float = STOP_WAIT_S) -> None:
            """SIGTERM to each (the process itself, as a user's `kill` would: it takes its DHT process and p2pd
            down), then wait; a process still there after `timeout` is killed with its group."""
            live = [n for n in names if self.alive(n)]
            for n in live:
                self.procs[n].send_signal(signal.SIGTERM)
                self.how[n] = "SIGTERM"
            deadline = time.monotonic() + timeout
            for n in live:
                try:
                    self.procs[n].wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"{n} did not leave within {timeout:.0f} s of SIGTERM; killing it")
                    self._group(n, signal.SIGKILL)
                    self.procs[n].wait(30)
                    self.how[n] = "SIGTERM, then SIGKILL"
            for n in live:  # anything the process left behind in its group
                self._group(n, signal.SIGKILL)

        def stop(self, name: str, timeout: float = STOP_WAIT_S) -> None:
            self.stop_all([name], timeout)

        def close(self) -> None:
            self.stop_all(list(self.procs), timeout=60)
            for n in self.procs:
                self._group(n, signal.SIGKILL)

        def log_path(self, name: str) -> Path:
            return self.out / "logs" / f"{name}.log"

        def text(self, name: str) -> str:
            path = self.log_path(name)
            return path.read_text(errors="replace") if path.exists() else ""

    return Drill


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def uploaded(s: Any, name: str) -> dict[str, Any]:
    """What a stopped process said it uploaded: its final line (None when it printed none, e.g. SIGKILLed)."""
    text = s.text(name)
    out: dict[str, Any] = {"role": s.roles.get(name), "stopped_by": s.how.get(name, "exited" if not s.alive(name) else None),
                           "uploaded_bytes": None}
    if m := STOPPED_RE.search(text):
        out["uploaded_bytes"] = int(round(float(m.group(3)) * 1e6))  # printed in MB with one decimal
        out["merges" if m.group(2) == "merge" else "rounds"] = int(m.group(1))
    for obj in json_lines(text):
        if obj.get("stopped") is True and "served_bytes" in obj:
            out["uploaded_bytes"] = int(obj["served_bytes"])
    return out


# ---- what the observer sees ------------------------------------------------------------------------------------
class Ledger:
    """Every body of every version seen signed, with the union of its signers over all observations; when each
    version was first accepted (a quorum on one body in one read, as `dht.get_checkpoint` decides)."""

    def __init__(self, coordinators: list[str], quorum: int, t0: float) -> None:
        self.coordinators, self.quorum, self.t0 = coordinators, quorum, t0
        self.bodies: dict[int, dict[str, set[str]]] = {}
        self.first: dict[int, dict[str, Any]] = {}  # digest -> its earliest manifest (the leader's copy)
        self.accepted: dict[int, dict[str, Any]] = {}  # version -> {t, digest, manifest, signers}
        self.failures = 0

    def who(self, key: str) -> str:
        return f"coord-{self.coordinators.index(key)}" if key in self.coordinators else key[:12]

    def observe(self, dht: Any) -> None:
        top = max([*self.bodies, *self.accepted, 0])
        for v in range(0, top + 2):
            try:
                found = dht.checkpoint_endorsements(v, trusted=self.coordinators)
            except Exception as e:  # a DHT hiccup (the bootstrap just went away): look again next time
                self.failures += 1
                if self.failures % 20 == 1:
                    say(f"observer: reading v{v} failed ({type(e).__name__}: {e}); retrying")
                return
            now = time.monotonic()
            for e in found:
                self.bodies.setdefault(v, {}).setdefault(e.digest, set()).update(e.signers)
                self.first.setdefault(v, {}).setdefault(e.digest, e.manifest)
                if len(e.signers) >= self.quorum and v not in self.accepted:
                    self.accepted[v] = {"t": now, "digest": e.digest, "manifest": e.manifest, "signers": e.signers}
                    say(f"v{v} accepted: led by {self.who(e.manifest.author)}, signed by "
                        f"{', '.join(self.who(k) for k in e.signers)} ({now - self.t0:.0f} s into the drill)")

    def forks(self) -> list[int]:
        return sorted(v for v, bodies in self.bodies.items()
                      if sum(len(signers) >= self.quorum for signers in bodies.values()) > 1)

    def max_bodies(self) -> int:
        return max((len(b) for b in self.bodies.values()), default=0)

    def versions(self) -> list[dict[str, Any]]:
        out = []
        for v in sorted(set(self.bodies) | set(self.accepted)):
            a = self.accepted.get(v)
            out.append({
                "version": v, "accepted": a is not None,
                "accepted_at_s": round(a["t"] - self.t0, 1) if a else None,
                "leader": self.who(a["manifest"].author) if a else None,
                "signers": sorted(self.who(k) for k in self.bodies[v][a["digest"]]) if a else [],
                "included": len(a["manifest"].included) if a else None,
                "bodies": len(self.bodies.get(v, {})),
                "weights_hash": a["manifest"].weights_hash if a else None,
            })
        return out


# ---- the drill -------------------------------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("skillswarm")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "skillswarm.node.cli.app", *args]


def make_network(work: Path, base: Path, steps: int, skills: list[str]) -> tuple[Path, list[Path], list[str]]:
    """Three coordinator keys and the network file (signed by the first)."""
    from skillswarm.protocol.identity import Identity

    keys = [work / "keys" / f"coord-{i}.key" for i in range(COORDINATORS)]
    hexes = [Identity.load_or_create(k).public_key_hex for k in keys]
    spec_file = work / "net.toml"
    cmd = cli("net", "init", "--name", NET, "--model", str(base), *[a for k in skills for a in ("--skill", k)],
              *[a for h in hexes for a in ("--coordinator", h)], "--quorum", str(QUORUM), "--failover", str(FAILOVER_S),
              "--replicas", "0",  # one machine: a leaving coordinator gains nothing by waiting for copies
              "--screen-eval-n", "0", "--min-deltas", "1", "--max-wait", str(MAX_WAIT_S),
              "--steps-per-round", str(steps), "--key", str(keys[0]), "--out", str(spec_file))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "SKILLSWARM_HOME": str(work / "nodes" / "init"), "COLUMNS": "160"})
    if r.returncode != 0:
        raise DrillError(f"`net init` failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return spec_file, keys, hexes


class Run:
    """One drill; `report` fills in as it goes, so a failure still reports what was measured."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.timeout
        self.phase = "setup"
        self.report: dict[str, Any] = {"events": {}}
        self.s: Any = None
        self.ledger: Ledger | None = None
        self.obs: Any = None
        self.boot_n = 0
        self.boot_args: list[str] = []
        self.coord_names: list[str] = []
        self.workers: list[str] = []
        self.expected: set[str] = set()  # processes that must be running now

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # -- processes --
    def boot_name(self) -> str:
        """The current bootstrap process's name: bootstrap, then bootstrap-2, -3 for its restarts."""
        return "bootstrap" if self.boot_n <= 1 else f"bootstrap-{self.boot_n}"

    def start_bootstrap(self) -> str:
        self.boot_n += 1
        name = self.boot_name()
        for attempt in range(10):  # the port may still be held for a moment after the last one left
            self.s.start_as("bootstrap", name, self.boot_args)
            try:
                line = self.wait_json_line(name, "maddrs", 90)
                self.expected.add(name)
                return line["maddrs"][0]
            except DrillError:
                if "address already in use" not in self.s.text(name).lower() or attempt == 9:
                    raise
                self.s.procs[name].wait(10)
                time.sleep(2)
        raise AssertionError("unreachable")

    def wait_json_line(self, name: str, key: str, timeout: float) -> dict:
        end = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < end:
            for obj in json_lines(self.s.text(name)):
                if key in obj:
                    return obj
            if not self.s.alive(name):
                break
            time.sleep(0.2)
        raise DrillError(f"{name} printed no {key!r} line within {timeout:.0f} s (exit {self.s.procs[name].poll()}):\n"
                         f"{self.s.log_tail(name, 25)}")

    def check_alive(self) -> None:
        for name in sorted(self.expected):
            if not self.s.alive(name):
                raise DrillError(f"{name} exited on its own ({self.s.procs[name].returncode}) during {self.phase}:\n"
                                 f"{self.s.log_tail(name, 25)}")

    # -- observing --
    def wait_accepted(self, version: int, why: str) -> dict[str, Any]:
        assert self.ledger is not None
        say(f"waiting for v{version} to be accepted ({why})")
        while version not in self.ledger.accepted:
            if time.monotonic() > self.deadline:
                raise DrillError(f"v{version} was not accepted within the drill's --timeout of {self.args.timeout:.0f} s "
                                 f"({why})")
            self.check_alive()
            self.ledger.observe(self.obs.dht)
            time.sleep(POLL_S)
        return self.ledger.accepted[version]

    # -- the events --
    def run(self) -> None:
        from skillswarm.node.network.session import open_session
        from skillswarm.node.rl.config import WorkerSettings, save_settings
        from skillswarm.node.roles.leadership import round_order
        from skillswarm.protocol.netspec import load_spec
        from skillswarm.skills.nano.build import build_base

        args, work = self.args, self.work
        say("base model: the nano model (built once, cached)")
        base = args.model or build_base()
        spec_file, keys, hexes = make_network(work, base, args.steps, args.skills)
        spec = load_spec(spec_file)
        self.ledger = Ledger(list(spec.coordinators), spec.quorum_k(), self.t0)
        self.report["network"] = {"name": NET, "skills": args.skills, "coordinators": COORDINATORS, "quorum": QUORUM,
                                  "failover_s": FAILOVER_S, "max_wait_s": MAX_WAIT_S, "workers": WORKERS,
                                  "steps_per_round": args.steps, "archive_refresh_s": REFRESH_S,
                                  "coordinator_keys": {f"coord-{i}": h[:16] for i, h in enumerate(hexes)}}
        self.s = _swarm_class()(work)
        s = self.s
        port = free_port()
        boot_key = work / "keys" / "bootstrap.key"
        self.boot_args = ["net", "serve", "--host", "127.0.0.1", "--port", str(port), "--network", str(spec_file),
                          "--key", str(boot_key), "--json"]

        self.phase = "start"
        say(f"starting the bootstrap (127.0.0.1:{port}), an archive, {COORDINATORS} coordinators and {WORKERS} workers")
        maddr = self.start_bootstrap()
        s.start_as("archive", "archive", ["net", "serve", "--host", "127.0.0.1", "--network", str(spec_file), "--peers",
                                          maddr, "--archive", str(work / "archive"), "--refresh", str(REFRESH_S), "--json"])
        self.wait_json_line("archive", "maddrs", 90)
        self.expected.add("archive")
        join = ["--network", str(spec_file), "--peers", maddr, "--host", "127.0.0.1"]
        for i, key in enumerate(keys):
            name = f"coord-{i}"
            s.start_as("coordinator", name, ["coordinator", "run", *join, "--key", str(key), "--eval-n", str(args.eval_n)])
            self.coord_names.append(name)
        settings = WorkerSettings(group_size=args.group_size, batch=args.batch, threads=1, eval_n=0, retain=0.0)
        for i in range(WORKERS):
            skill = args.skills[i % len(args.skills)]
            name = f"worker-{i}-{skill}"
            settings_file = save_settings(settings, s.home(name) / "settings.toml")
            s.start_as("worker", name, ["node", "run", *join, "--skill", skill, "--settings", str(settings_file),
                                        "--no-progress"])
            self.workers.append(name)
        self.expected |= set(self.coord_names) | set(self.workers)

        with contextlib.ExitStack() as observer:
            self.obs = observer.enter_context(open_session(
                spec_file, peers=[maddr], host="127.0.0.1", client_mode=True, ephemeral_key=True,
                cache=s.home("observer") / "cache"))
            ev = self.report["events"]

            # a. v1
            self.phase = "a: waiting for v1"
            v0 = self.wait_accepted(0, "the coordinators publish genesis")
            ev["v0_accepted_at_s"] = round(v0["t"] - self.t0, 1)
            v1 = self.wait_accepted(1, "the first round")
            ev["v1_accepted_at_s"] = round(v1["t"] - self.t0, 1)

            # b. kill the leader of the round on v1, mid-round
            self.phase = "b: failover"
            leader = round_order(list(spec.coordinators), 1)[0]
            victim = f"coord-{list(spec.coordinators).index(leader)}"
            self.expected.discard(victim)
            s.kill(victim)
            killed_at = time.monotonic()
            ev["leader_killed"] = {"name": victim, "at_s": self.at()}
            say(f"SIGKILLed {victim}, the leader of the round on v1")
            v2 = self.wait_accepted(2, f"the next coordinator takes over from {victim}")
            self.report["failover_s"] = round(v2["t"] - killed_at, 1)
            ev["v2_leader"] = self.ledger.who(v2["manifest"].author)
            ev["took_over_logged_by"] = [n for n in self.coord_names if "its leader is offline or silent" in s.text(n)]
            say(f"failover: v2 accepted {self.report['failover_s']:.1f} s after the kill, led by {ev['v2_leader']}")

            # c. restart the bootstrap
            self.phase = "c: bootstrap restart"
            old = self.boot_name()
            self.expected.discard(old)
            s.stop(old)
            again = self.start_bootstrap()
            ev["bootstrap_restarted"] = {"at_s": self.at(), "same_address": again == maddr}
            if again != maddr:
                raise DrillError(f"the restarted bootstrap is at {again}, not {maddr} (same key and port)")
            say("bootstrap restarted at the same address")
            v3 = self.wait_accepted(3, "the round after the bootstrap's restart")
            ev["v3_accepted_at_s"] = round(v3["t"] - self.t0, 1)
            ev["fresh_join_via_restarted_bootstrap"] = self.fresh_join(spec_file, spec, maddr, 3)

            # d. stop a coordinator right after it publishes
            self.phase = "d: a coordinator leaves after publishing"
            v4 = self.wait_accepted(4, "the next round")
            ev["v4_accepted_at_s"] = round(v4["t"] - self.t0, 1)
            live = [n for n in self.coord_names if s.alive(n)]
            led = self.ledger.who(v4["manifest"].author)
            leaving = led if led in live else live[0]
            self.expected.discard(leaving)
            signalled = time.monotonic()
            ev["coordinator_stopped"] = {"name": leaving, "led_v4": leaving == led, "at_s": self.at(),
                                         "after_v4_accepted_s": round(signalled - v4["t"], 1)}
            s.stop(leaving)
            ev["coordinator_stopped"].update(left_in_s=round(time.monotonic() - signalled, 1),
                                             printed_stop_line=uploaded(s, leaving)["uploaded_bytes"] is not None)
            say(f"SIGTERMed {leaving} right after v4 was accepted")
            for _ in range(3):  # what the others publish meanwhile (with one coordinator left, nothing is accepted)
                self.ledger.observe(self.obs.dht)
                time.sleep(POLL_S)

            # e. everyone but the archive leaves
            self.phase = "e: everyone but the archive leaves"
            self.ledger.observe(self.obs.dht)
            latest = max(self.ledger.accepted)
            self.report["accepted_at_end_of_run"] = {
                v: self.obs.dht.get_checkpoint(v, trusted=spec.coordinators, quorum=spec.quorum_k()) is not None
                for v in range(latest + 1)}
        self.obs = None
        rest = [n for n in [*self.coord_names, *self.workers, self.boot_name()] if s.alive(n)]
        self.expected = {"archive"}
        say(f"stopping {', '.join(rest)}")
        s.stop_all(rest)
        maddr_again = self.start_bootstrap()
        if maddr_again != maddr:
            raise DrillError(f"the restarted bootstrap is at {maddr_again}, not {maddr}")
        ev["alone_with_archive_at_s"] = self.at()
        wait = 2 * REFRESH_S + 5
        say(f"the archive and a fresh bootstrap alone; waiting {wait:.0f} s (two archive refreshes and a poll)")
        time.sleep(wait)
        self.check_alive()

        self.phase = "e: pulling every version from a fresh node"
        self.report["pulls"] = self.pull_all(spec_file, maddr, range(latest + 1))
        failed = [p["version"] for p in self.report["pulls"] if not p["ok"]]
        if failed:  # a diagnosis, not the goal: are those versions on the archive, only not found through the bootstrap?
            self.phase = "e: diagnosis, pulling the failed versions through the archive's own address"
            archive_maddr = self.wait_json_line("archive", "maddrs", 5)["maddrs"][0]
            say(f"diagnosis: pulling v{', v'.join(map(str, failed))} again with --peers the archive's own address")
            self.report["diagnosis_pulls_via_archive_address"] = self.pull_all(spec_file, archive_maddr, failed,
                                                                              prefix="diag-pull")

    def fresh_join(self, spec_file: Path, spec: Any, maddr: str, want: int) -> dict[str, Any]:
        """What a node joining now through the bootstrap alone sees: the latest accepted version (None: nothing)."""
        from skillswarm.node.checkpoints.pull import find_checkpoint
        from skillswarm.node.network.session import open_session

        seen, t = None, time.monotonic()
        try:
            with open_session(spec_file, peers=[maddr], host="127.0.0.1", client_mode=True, ephemeral_key=True,
                              cache=self.s.home("fresh-join") / "cache") as fresh:
                while time.monotonic() - t < 20:
                    found = find_checkpoint(fresh.dht, spec)
                    seen = found.version if found is not None else None
                    if seen is not None and seen >= want:
                        break
                    time.sleep(2)
                peers = sorted({p.role for p in fresh.dht.get_peers()})
        except Exception as e:  # noqa: BLE001 - reported, the drill goes on
            return {"latest_seen": seen, "expected": want, "error": f"{type(e).__name__}: {e}"}
        say(f"a fresh node joining through the restarted bootstrap sees {'no checkpoint' if seen is None else f'v{seen}'}"
            f" (v{want} is accepted) and peers of roles {peers}")
        return {"latest_seen": seen, "expected": want, "peer_roles_seen": peers, "seconds": round(time.monotonic() - t, 1)}

    def pull_all(self, spec_file: Path, maddr: str, versions: Any, prefix: str = "pull") -> list[dict[str, Any]]:
        from skillswarm.protocol.hashing import weights_hash

        assert self.ledger is not None
        out = []
        for v in versions:
            name = f"{prefix}-v{v}"
            dest = self.work / prefix / f"v{v}"
            t = time.monotonic()
            p = self.s.start_as("pull", name, ["pull", "--network", str(spec_file), "--peers", maddr, "--version", str(v),
                                               "--out", str(dest), "--json"])
            row: dict[str, Any] = {"version": v}
            try:
                p.wait(min(self.args.pull_timeout, max(1.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.s.stop(name, timeout=10)
                row["error"] = f"no result within {self.args.pull_timeout:.0f} s"
            row["exit"] = p.returncode
            row["seconds"] = round(time.monotonic() - t, 1)
            want = self.ledger.accepted.get(v)
            if p.returncode == 0 and "error" not in row:
                try:
                    got = weights_hash(dest)
                except (OSError, ValueError) as e:
                    got, row["error"] = None, f"{type(e).__name__}: {e}"
                row["weights_match"] = want is not None and got == want["manifest"].weights_hash
                if want is None:
                    row["error"] = "pulled, but the observer never saw this version accepted"
                elif got != want["manifest"].weights_hash:
                    row["error"] = f"pulled weights hash {str(got)[:12]}, the accepted manifest says {want['manifest'].weights_hash[:12]}"
            elif "error" not in row:
                row["error"] = " ".join(self.s.log_tail(name, 6).split())[:400]
            row["ok"] = row.get("weights_match") is True
            say(f"pull v{v}: {'ok' if row['ok'] else 'FAILED'} in {row['seconds']:.1f} s"
                + ("" if row["ok"] else f": {row.get('error')}"))
            out.append(row)
        return out


def summarize(run: Run, error: str | None) -> dict[str, Any]:
    """The report: the figures of the module docstring."""
    r = dict(run.report)
    led = run.ledger
    accepted = sorted(led.accepted) if led else []
    total = (max(accepted) + 1) if accepted else 0
    pulls = r.pop("pulls", [])
    pullable = [p["version"] for p in pulls if p.get("ok")]
    forks = led.forks() if led else []
    processes = {}
    by_role: dict[str, dict[str, Any]] = {}
    if run.s is not None:
        for name in run.s.procs:
            if run.s.roles.get(name) == "pull":  # (pulls print JSON, not their uploads)
                continue
            row = uploaded(run.s, name)
            processes[name] = row
            role = by_role.setdefault(row["role"], {"uploaded_bytes": 0, "unreported": []})
            if row["uploaded_bytes"] is None:
                role["unreported"].append(name)
            else:
                role["uploaded_bytes"] += row["uploaded_bytes"]
    goals = {"all_versions_pullable": bool(total) and len(pullable) == total and pulls != [],
             "no_forks": not forks}
    out = {
        "rounds_completed": max(0, len(accepted) - (1 if 0 in accepted else 0)),
        "failover_s": r.pop("failover_s", None),
        "versions_accepted": accepted,
        "versions_total": total,
        "versions_pullable_at_end": {"count": len(pullable), "list": pullable},
        "forks_accepted": len(forks),
        "fork_versions": forks,
        "max_bodies_per_version": led.max_bodies() if led else 0,
        "uploaded_bytes_by_role": by_role,
        "uploaded_note": "each process's own count at its SIGTERM: coordinators and workers print MB to one decimal "
                         "(+-0.05 MB), net serve prints bytes; a SIGKILLed process prints none (unreported)",
        "processes": processes,
        "versions": led.versions() if led else [],
        "pulls": pulls,
        **r,
        "wall_s": round(time.monotonic() - run.t0, 1),
        "commit": commit(),
        "goals": goals,
        "goals_met": all(goals.values()) and error is None,
        "error": error,
    }
    if error is not None:
        out["failed_phase"] = run.phase
        if run.s is not None:
            out["log_tails"] = {n: run.s.log_tail(n, 20) for n in run.s.procs if run.s.log_path(n).exists()}
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 140)
    t = Table(title="continuity drill: accepted versions")
    diag = {p["version"]: p for p in result.get("diagnosis_pulls_via_archive_address", [])}
    cols = ["version", "accepted at (s)", "leader", "signers", "deltas in", "bodies seen", "pulled at the end"]
    for col in cols + (["pulled via the archive's address (diagnosis)"] if diag else []):
        t.add_column(col)
    pulled = {p["version"]: p for p in result["pulls"]}
    for v in result["versions"]:
        p, d = pulled.get(v["version"]), diag.get(v["version"])
        cells = [str(v["version"]), str(v["accepted_at_s"]), str(v["leader"]), ", ".join(v["signers"]),
                 str(v["included"]), str(v["bodies"]), "-" if p is None else ("yes, hash matches" if p["ok"] else "NO")]
        if diag:
            cells.append("-" if d is None else ("yes, hash matches" if d["ok"] else "NO"))
        t.add_row(*cells)
    console.print(t)
    for why in sorted({str(p.get("error")) for p in [*result["pulls"], *diag.values()] if not p["ok"]}):
        console.print(f"  pull failed: {why}", highlight=False)
    u = Table(title="uploaded to peers (each process's own count, printed when stopped)")
    for col in ("process", "role", "stopped by", "uploaded MB"):
        u.add_column(col)
    for name, row in result["processes"].items():
        b = row["uploaded_bytes"]
        u.add_row(name, str(row["role"]), str(row["stopped_by"]), "none printed" if b is None else f"{b / 1e6:.1f}")
    console.print(u)
    fo = result["failover_s"]
    console.print(f"rounds completed: {result['rounds_completed']}; failover: "
                  f"{'-' if fo is None else f'{fo:.1f} s'}; versions pullable at the end: "
                  f"{result['versions_pullable_at_end']['count']} of {result['versions_total']}; forks: "
                  f"{result['forks_accepted']} (most bodies for one version: {result['max_bodies_per_version']}); "
                  f"{result['wall_s']:.0f} s in all")
    fresh = result["events"].get("fresh_join_via_restarted_bootstrap")
    if fresh:
        console.print(f"a fresh node joining through the restarted bootstrap saw "
                      f"{'no checkpoint' if fresh.get('latest_seen') is None else 'v' + str(fresh['latest_seen'])} "
                      f"(v{fresh['expected']} accepted)")
    if "diagnosis_pulls_via_archive_address" in result:
        diag = result["diagnosis_pulls_via_archive_address"]
        console.print(f"diagnosis: the versions not pulled through the bootstrap, pulled with --peers the archive's own "
                      f"address: {sum(p['ok'] for p in diag)} of {len(diag)} ok (not counted in the goals)")
    console.print(f"goals met: {'yes' if result['goals_met'] else 'NO'} {result['goals']}")
    if result["error"]:
        console.print(f"[bold red]the drill failed[/] during {result.get('failed_phase')}: {result['error']}",
                      highlight=False)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="Base model (default: the nano model, built if needed).")
    ap.add_argument("--skills", type=lambda t: [k for k in t.split(",") if k], default=SKILLS,
                    help="The network's skills, comma-separated; the workers take them in turn.")
    ap.add_argument("--steps", type=int, default=10, help="Training steps per round.")
    ap.add_argument("--group-size", type=int, default=4, help="The workers' GRPO group size.")
    ap.add_argument("--batch", type=int, default=2, help="The workers' tasks per step.")
    ap.add_argument("--eval-n", type=int, default=8, help="Held-out episodes per skill of each merge's evaluation.")
    ap.add_argument("--timeout", type=float, default=1800.0, help="Seconds the whole drill may take.")
    ap.add_argument("--pull-timeout", type=float, default=180.0, help="Seconds one final pull may take.")
    ap.add_argument("--work", type=Path, default=None, help="Work directory (logs, homes), kept.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = ap.parse_args()
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="skillswarm-continuity-"))
    work.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that `finally` stops every process
    run = Run(args, work)
    error: str | None = None
    try:
        try:
            run.run()
        except DrillError as e:
            error = str(e)
        except KeyboardInterrupt:
            error = "interrupted"
        except SystemExit as e:  # a SIGTERM to the drill itself
            error = f"stopped by a signal (exit {e.code})"
        except Exception as e:  # noqa: BLE001 - a bug of the package or of the drill: reported, with the logs
            import traceback

            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        finally:
            if run.s is not None:
                say("stopping every process the drill started")
                run.s.close()
        if error:
            say(f"the drill failed during {run.phase}: {error.splitlines()[0] if error else ''}")
        result = summarize(run, error)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print_table(result)
    sys.exit(0 if result["goals_met"] else 1)


if __name__ == "__main__":
    main()
