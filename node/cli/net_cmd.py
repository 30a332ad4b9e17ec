"""`skillswarm net ...`: create and inspect network files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer

from skillswarm.node.cli.common import JsonOpt, KeyOpt, console, fail, print_json, table
from skillswarm.protocol.errors import SpecError
from skillswarm.protocol.identity import Identity, fingerprint
from skillswarm.protocol.netspec import load_spec, new_network, save_spec
from skillswarm.protocol.records import (
    ADMISSIONS,
    CODECS,
    DEFAULT_CODEC,
    DEFAULT_LAMBDA_SEARCH,
    MERGE_METHODS,
    MergePolicy,
    NetworkSpec,
    RoundPolicy,
    ScreenPolicy,
    SkillVersion,
    TrustPolicy,
)

# The policies' own defaults, shown in --help: the records are where each default is stated.
_SCREEN, _TRUST, _ROUND, _MERGE = ScreenPolicy(), TrustPolicy(), RoundPolicy(), MergePolicy()

app = typer.Typer(help="Create and inspect networks.", no_args_is_help=True)


def _plugin_pins(skills: list[str]) -> dict[str, SkillVersion]:
    """The version of every plugin skill among `skills` (built-ins are versioned with skillswarm itself);
    a skill this machine does not have cannot be pinned, so it is an error."""
    from skillswarm.skills.registry import get_skill, is_builtin, plugin_names, plugin_version

    pins = {}
    for name in dict.fromkeys(skills):
        if is_builtin(name):
            continue
        if name not in plugin_names():
            fail(f"skill {name!r} is not installed on this machine (see `skillswarm skills list`): install the plugin "
                 "that provides it first, so that the network file records its version")
        pin = plugin_version(get_skill(name))
        if pin is not None:
            pins[name] = SkillVersion(version=pin.version, distribution=pin.distribution,
                                      distribution_version=pin.distribution_version)
    return pins


def _resolve_base(model: str, revision: str | None) -> str:
    """The state-dict hash of the base model's weights: a local directory, or a hub id (downloaded)."""
    from skillswarm.protocol.hashing import weights_hash

    path = Path(model).expanduser()
    if path.exists():
        try:
            return weights_hash(path)
        except FileNotFoundError as e:
            fail(f"{e}; --model must be a Hugging Face model directory with safetensors weights")
    from skillswarm.node.checkpoints.hub import resolve_model

    ref = f"{model}@{revision}" if revision else model
    return weights_hash(resolve_model(ref, "--model", patterns=["*.safetensors", "*.json"]))


@app.command("init")
def init(
    name: Annotated[str, typer.Option(help="Network name (lower-case letters, digits, . _ -).")],
    model: Annotated[str, typer.Option(help="Base model: a local HF directory or a hub id.")],
    skill: Annotated[list[str], typer.Option(help="A skill shard; repeat for each.")],
    out: Annotated[Path, typer.Option(help="Where to write the network file.")] = Path("network.toml"),
    coordinator: Annotated[Optional[list[str]], typer.Option(help="Trusted coordinator public key (hex); repeatable. Default: yours.")] = None,
    quorum: Annotated[Optional[int], typer.Option(
        help="How many of the coordinators must sign the same checkpoint before nodes accept it (k of n). More than "
             "half of them: two checkpoints of one version can never both be accepted. Default: 1.",
        min=1, max=32, show_default=False)] = None,
    failover: Annotated[Optional[float], typer.Option(
        help="Seconds past --max-wait an online round leader may take before the next coordinator runs the round "
             f"(an offline one is replaced at once). Default: {_ROUND.overdue_s() - _ROUND.max_wait_s:g}.",
        min=1.0, show_default=False)] = None,
    bootstrap: Annotated[Optional[list[str]], typer.Option(help="Bootstrap peer multiaddr; repeatable.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of the base model.")] = None,
    description: Annotated[str, typer.Option(help="One line about the network.")] = "",
    method: Annotated[str, typer.Option(help=f"Merge method: {', '.join(MERGE_METHODS)}.")] = _MERGE.method,
    density: Annotated[float, typer.Option(help="Fraction of each delta kept by ties/dare/breadcrumbs.")] = _MERGE.density,
    scale: Annotated[float, typer.Option("--lambda", help="Scale of the merged task vector.")] = _MERGE.scale,
    lambda_search: Annotated[Optional[list[float]], typer.Option(help="Another lambda a coordinator may merge a round at "
                                                                 "where it scores significantly better on held-out tasks; "
                                                                 "repeatable (default: " + ", ".join(
                                                                     f"{x:g}" for x in DEFAULT_LAMBDA_SEARCH) +
                                                                 "; --lambda-search with the --lambda value: none).")] = None,
    codec: Annotated[str, typer.Option(help=f"Delta codec workers publish: {', '.join(CODECS)}.")] = DEFAULT_CODEC,
    steps_per_round: Annotated[int, typer.Option(help="Training steps per round.", min=1)] = _ROUND.steps_per_round,
    lr_decay: Annotated[Optional[float], typer.Option(help="Workers train on checkpoint vN at their learning rate times "
                                                           "LR_DECAY**N (at least a quarter of it). Default: a constant rate.",
                                                      min=0.0, max=1.0)] = None,
    min_deltas: Annotated[int, typer.Option(help="Deltas a coordinator waits for before merging.", min=1)] = _ROUND.min_deltas,
    max_wait: Annotated[float, typer.Option(help="Seconds a round waits at most.")] = _ROUND.max_wait_s,
    replicas: Annotated[Optional[int], typer.Option(
        help="Other peers that must hold a verified copy of a coordinator's latest checkpoint before it leaves (0: "
             f"leave at once). Default: {_ROUND.copies_wanted()}.", min=0, max=64, show_default=False)] = None,
    replica_wait: Annotated[Optional[float], typer.Option(
        help=f"Seconds a leaving coordinator waits at most for those copies. Default: {_ROUND.copies_wait_s():g}.",
        min=0.0, show_default=False)] = None,
    admission: Annotated[str, typer.Option(help=f"Who may publish deltas, heartbeats and provider records: "
                                                f"{', '.join(ADMISSIONS)} (allowlist: only the --worker keys, the "
                                                "coordinators and the bootstrap peers; anyone may still read and pull).")] = _TRUST.admission,
    worker: Annotated[Optional[list[str]], typer.Option(help="An allowed worker's public key (hex); repeatable.")] = None,
    screen_eval_n: Annotated[int, typer.Option(help="Held-out tasks per skill a coordinator evaluates each delta on "
                                                    "before merging it; 0 turns the usefulness test off.",
                                               min=0)] = _SCREEN.eval_n,
    confidence: Annotated[float, typer.Option(help="Confidence a delta must show that it improves its skill.")] = _SCREEN.confidence,
    key: KeyOpt = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a new network file (the genesis: base model and its hash, skills, trusted coordinators, policy)."""
    if out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite it")
    pins = _plugin_pins(skill)
    ident = Identity.load_or_create(key)
    base_hash = _resolve_base(model, revision)
    try:
        spec = new_network(
            name, model, base_hash, skill, coordinator or [ident.public_key_hex], description=description,
            base_revision=revision, bootstrap=bootstrap or [], codec=codec,
            round=RoundPolicy(steps_per_round=steps_per_round, min_deltas=min_deltas, max_wait_s=max_wait,
                              lr_decay=msgspec.UNSET if lr_decay is None else lr_decay),
            merge=MergePolicy(method=method, density=density, scale=scale,  # type: ignore[arg-type]
                              scale_search=lambda_search or msgspec.UNSET),
            trust=TrustPolicy(admission=admission, workers=worker or []),  # type: ignore[arg-type]
            screen=ScreenPolicy.for_new_network(eval_n=screen_eval_n, confidence=confidence), skill_versions=pins,
            replicas=replicas, replica_wait_s=replica_wait, quorum=quorum, failover_s=failover)
    except SpecError as e:
        fail(str(e))
    except ValueError as e:  # a policy's own check, e.g. an allowlist without workers
        fail(f"invalid network settings: {e}")
    save_spec(ident.sign_record(spec), out)
    pinned = "".join(f"; {n} {p.version} from {p.distribution}" for n, p in pins.items())
    console.print(f"wrote [bold]{out}[/] for network [bold]{name}[/] (base {base_hash[:12]}, {len(skill)} skills"
                  f"{pinned})", highlight=False)
    n, k = len(spec.coordinators), spec.quorum_k()
    if n > 1 and 2 * k <= n:
        console.print(f"[yellow]warning:[/] a quorum of {k} of {n} coordinators is not a majority: two coordinators "
                      "racing for one version could each have theirs accepted; use --quorum "
                      f"{n // 2 + 1} or more", highlight=False)


@app.command("show")
def show(path: Annotated[Optional[Path], typer.Argument(help="Network file (the same as --network).",
                                                        show_default=False)] = None,
         network: Annotated[Optional[Path], typer.Option("--network", help="Network file (from `skillswarm net init`). "
                                                         "Default: network.toml.")] = None,
         json: JsonOpt = False) -> None:
    """Validate a network file and print what it says (`--network FILE`, as every other command takes it)."""
    if path is not None and network is not None and path != network:
        fail(f"two network files given ({path} and --network {network}); give one")
    spec = load_spec(network or path or Path("network.toml"))
    if json:
        print_json(msgspec.to_builtins(spec) | {"signature": spec.signature.hex()})
        return
    pins = spec.plugin_versions()
    rows = [
        ["name", spec.network], ["base model", spec.base_model], ["base hash", spec.base_hash],
        ["skills", ", ".join(spec.skills)],
        *([["plugin versions", "\n".join(f"{n} {v.version} ({v.distribution} {v.distribution_version})"
                                          for n, v in pins.items())]] if pins else []),
        ["coordinators", ", ".join(fingerprint(k) for k in spec.coordinators) or "(none: no checkpoint can be trusted)"],
        ["bootstrap", "\n".join(spec.bootstrap) or "(none)"], ["codec", spec.codec],
        ["round", f"{spec.round.steps_per_round} steps, >= {spec.round.min_deltas} deltas, <= {spec.round.max_wait_s:g} s"
                  + ("" if spec.round.lr_factor(1) == 1.0 else f", learning rate x{spec.round.lr_decay:g} per version")
                  + f"; a coordinator leaves once {spec.round.copies_wanted()} other peer(s) hold its latest checkpoint "
                    f"(<= {spec.round.copies_wait_s():g} s)"],
        ["merge", f"{spec.merge.method} (density {spec.merge.density:g}, lambda {spec.merge.scale:g}"
                  f"{''.join(f' or {x:g}' for x in spec.merge.scales()[1:])}, "
                  f"within a skill: {spec.merge.aggregator})"],
        ["admission", spec.trust.admission + (f" ({len(spec.trust.workers)} keys)" if spec.trust.admission == "allowlist"
                                              else f" (<= {spec.trust.max_deltas_per_author} deltas per key and "
                                                   f"{spec.trust.max_deltas_per_round} per round)")],
        ["screening", "usefulness test off" if not spec.screen.eval_n else
         f"{spec.screen.eval_n} held-out tasks per skill, {spec.screen.confidence:.0%} confidence, "
         f"others may lose <= {spec.screen.max_other_drop:.0%}"
         + ("" if spec.screen.saturated_at is msgspec.UNSET else f"; no delta for a skill at >= {spec.screen.saturated_at:.0%}"
            + ("" if spec.screen.repair_layers is msgspec.UNSET
               else f" but a repair of its first {spec.screen.repair_layers} layer(s)"))
         + ("; inconclusive deltas of keys with a record merged on credit" if spec.screen.on_credit is True else "")],
        ["signed by", fingerprint(spec.author) if spec.signature else "(unsigned)"],
    ]
    console.print(table(f"network {spec.network}", ["field", "value"], rows))


# ---- live network: serve, peers, status ------------------------------------------------------------
PeersOpt = Annotated[
    Optional[list[str]],
    typer.Option("--peers", help="Multiaddr of a running peer (…/p2p/<peer id>); repeatable. Default: the network file's bootstrap."),
]
NetworkOpt = Annotated[Path, typer.Option("--network", help="Network file.")]


def join_peers(spec: NetworkSpec, peers: list[str] | None) -> list[str]:
    joined = list(peers or spec.bootstrap)
    if not joined:
        fail(f"no peer to join network `{spec.network}`: pass --peers MADDR (from `skillswarm net serve`) "
             "or list bootstrap peers in the network file (`net init --bootstrap`)")
    return joined


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.0f} h ago"


def _hardware(h) -> str:  # a Hardware part, in a few words
    if h.device == "cpu":
        return f"cpu x{h.cpu_count}, {h.ram_gb:g} GB" if h.cpu_count else "cpu"
    return f"{h.accelerator or h.device} {h.accelerator_mem_gb:g} GB" if h.accelerator_mem_gb else (h.accelerator or h.device)


def _short(peer_id: str) -> str:
    return f"{peer_id[:10]}…{peer_id[-6:]}"


def observer(spec: NetworkSpec, peers: list[str] | None):
    """A short-lived client-mode peer with a throwaway key (never the node's own: two peers with one
    identity on one network confuse libp2p), which accepts only what the network admits."""
    from skillswarm.protocol.transport.dht import SwarmDHT
    from skillswarm.protocol.transport.validation import StorePolicy

    return SwarmDHT(spec.network, Identity.generate(), host="0.0.0.0", initial_peers=join_peers(spec, peers),
                    client_mode=True, policy=StorePolicy.from_spec(spec))


@app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port; pick a fixed one for a bootstrap peer).")] = 0,
    peers: Annotated[Optional[list[str]], typer.Option("--peers", help="Multiaddr of a running peer to join; repeatable. None: start a new DHT.")] = None,
    network: Annotated[Optional[Path], typer.Option("--network", help="Network file: announce this peer in it (role bootstrap).")] = None,
    announce: Annotated[Optional[list[str]], typer.Option("--announce", help="Public multiaddr others should dial (behind NAT with a forwarded port); repeatable.")] = None,
    auto_relay: Annotated[bool, typer.Option("--auto-relay", help="Behind NAT without a forwarded port: become reachable through relays.")] = False,
    relay: Annotated[bool, typer.Option("--relay/--no-relay", help="Use and offer circuit relays.")] = True,
    heartbeat: Annotated[float, typer.Option(help="Seconds between announcements (records expire after 3 beats).")] = 10.0,
    archive: Annotated[Optional[Path], typer.Option(
        "--archive", help="Also archive the network (needs --network): pin every accepted checkpoint (signed manifests, "
                          "files, merged delta) under this directory, serve them, and keep their records in the DHT "
                          "across restarts of any peer.")] = None,
    quota_gb: Annotated[Optional[float], typer.Option(
        help="With --archive: the most its checkpoint files may take (GB); the oldest versions' files go first, "
             "never the newest. Default: no limit.", min=0.001, show_default=False)] = None,
    refresh: Annotated[float, typer.Option(
        help="With --archive: seconds between re-storing its records (also at once when a new peer connects).",
        min=1.0)] = 600.0,
    key: KeyOpt = None,
    json: JsonOpt = False,
) -> None:
    """Run a DHT peer (a bootstrap for others) with the project's record validators and storage caps until
    Ctrl-C or SIGTERM; with --network, it stores only what that network admits; with --archive, it also keeps the
    network's checkpoints pullable (an archive node)."""
    import json as json_lib
    import signal
    import threading

    from skillswarm.protocol.hardware import probe_hardware
    from skillswarm.protocol.transport.dht import SwarmDHT
    from skillswarm.protocol.transport.validation import StorePolicy

    spec = load_spec(network) if network else None
    if archive is not None and spec is None:
        fail("--archive needs --network FILE: an archive keeps the checkpoints of one network")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = SwarmDHT(spec.network if spec else None, Identity.claim(key), host=host, port=port,
                   initial_peers=peers or (), announce_maddrs=announce or (), use_auto_relay=auto_relay, use_relay=relay,
                   policy=StorePolicy.from_spec(spec) if spec else None)
    with dht:
        maddrs = dht.visible_maddrs()
        keeper = None
        if spec is not None and archive is not None:
            from skillswarm.node.roles.archive import Archive

            keeper = Archive(spec, dht.identity, dht, archive, refresh_s=refresh,
                             quota_bytes=None if quota_gb is None else int(quota_gb * 1e9), poll=min(5.0, refresh))
            dht.serve_blobs(keeper.blobs)
        if spec is not None:
            hardware = probe_hardware()
            role = "bootstrap" if keeper is None else "archive"
            dht.start_heartbeat(lambda: dht.make_peer_record(
                role=role, hardware=hardware, state=keeper.state if keeper else "idle",  # type: ignore[arg-type]
                note=keeper.note if keeper else "", checkpoint_version=keeper.store.latest() if keeper else None),
                interval=heartbeat, ttl=3 * heartbeat)
        if json:  # one line, so a supervising script can read it while the peer keeps running
            console.file.write(json_lib.dumps({"peer_id": dht.identity.peer_id, "maddrs": maddrs,
                                               "network": spec.network if spec else None}) + "\n")
            console.file.flush()
        else:
            where = f"network [bold]{spec.network}[/]" if spec else "any network"
            console.print(f"DHT peer [bold]{dht.identity.peer_id}[/] serving {where}. Give others one of these as "
                          "--peers (or put it in the network file's `bootstrap`):")
            for m in maddrs:
                console.print(f"  {m}", highlight=False, soft_wrap=True)
            console.print("Ctrl-C to stop.")
            console.file.flush()  # others wait for these lines (scripts, tests)
        worker = None
        if keeper is not None:
            worker = threading.Thread(target=keeper.run, args=(stop,), name="skillswarm-archive", daemon=True)
            worker.start()
        while not stop.wait(1.0):
            if not dht.is_running:
                fail("the DHT process stopped unexpectedly; see the log above")
            if worker is not None and not worker.is_alive():
                fail("the archive stopped unexpectedly; see the log above")
        if worker is not None:
            worker.join(30)
        served = dht.served_bytes()
    if json:
        console.file.write(json_lib.dumps({"stopped": True, "served_bytes": served}) + "\n")
    else:
        console.print(f"stopped; uploaded {served / 1e6:.1f} MB to peers.")


@app.command("peers")
def peers_cmd(
    network: NetworkOpt = Path("network.toml"),
    peers: PeersOpt = None,
    json: JsonOpt = False,
) -> None:
    """Join briefly and list the nodes online: peer id, role, skills, engine, hardware, last seen."""
    import time

    from skillswarm.node.network.view import peers_view

    spec = load_spec(network)
    with observer(spec, peers) as dht:
        found = dht.get_peers()
        view = peers_view(dht, spec)
    now = time.time()
    if json:
        print_json(view)
        return
    rows = [[_short(p.peer_id), p.role, ", ".join(p.skills) or "-", p.engine, _hardware(p.hardware),
             "-" if p.checkpoint_version is None else p.checkpoint_version, p.state, ago(now - p.created)] for p in found]
    console.print(table(f"{len(found)} peers online in {spec.network}",
                        ["peer id", "role", "skills", "engine", "hardware", "version", "state", "last seen"], rows))


@app.command("status")
def status(
    network: NetworkOpt = Path("network.toml"),
    peers: PeersOpt = None,
    json: JsonOpt = False,
) -> None:
    """Join briefly and show this node's view: peers by role, skills covered, checkpoint versions seen."""
    from skillswarm.node.network.view import status_view

    spec = load_spec(network)
    joined = join_peers(spec, peers)
    with observer(spec, peers) as dht:
        view = status_view(dht, spec, joined)
    roles, skills, latest, connected = view["roles"], view["workers_per_skill"], view["latest_checkpoint"], view["connections"]
    if json:
        print_json(view)
        return
    rows = [
        ["network", spec.network], ["joined via", "\n".join(joined)], ["libp2p connections", connected],
        ["peers online", f"{view['peers_online']} ({', '.join(f'{n} {r}' for r, n in sorted(roles.items())) or 'none'})"],
        ["workers per skill", ", ".join(f"{s}: {n}" for s, n in skills.items())],
        ["latest checkpoint", "none yet (version 0 is the base model)" if latest is None else f"v{latest}"],
        ["versions seen", ", ".join(f"v{v}" for v in view["checkpoint_versions"]) or "-"],
        ["deltas on latest", view["deltas_on_latest"]],
    ]
    for c in view["coordinators"]:
        trust = "" if c["trusted"] else " (not trusted by this network file)"
        rows.append([f"coordinator {_short(c['peer_id'])}", f"{c['state']}{trust}" + (f": {c['note']}" if c["note"] else "")])
    if len(spec.coordinators) > 1:
        rows.append(["quorum", f"{view['quorum']} of {len(spec.coordinators)} coordinators sign each checkpoint"])
        rows.append(["round leader", view["leader"] or "no trusted coordinator online"])
        for sig in view["signatures"]:
            mark = "accepted" if sig["accepted"] else f"{len(sig['signers'])} of {view['quorum']}"
            rows.append([f"v{sig['version']} {sig['weights_hash']}", f"{mark}: signed by {', '.join(sig['signers'])}"])
        rows.append(["failovers", ", ".join(f"v{v}" for v in view["failovers"]) or "none"])
    if not spec.coordinators:
        rows.append(["note", "the network file trusts no coordinator: no checkpoint is accepted"])
    console.print(table(f"status of {spec.network} (this node's view)", ["", ""], rows))
