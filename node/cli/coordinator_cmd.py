"""`skillswarm coordinator run`: merge each round's deltas into the next checkpoint (or `--verify` one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, KeyOpt, console, fail, print_json
from skillswarm.node.cli.swarm_opts import AnnounceOpt, AutoRelayOpt, HostOpt, NetworkOpt, PeersOpt, PortOpt
from skillswarm.node.rl.config import EVAL_N

if TYPE_CHECKING:
    from skillswarm.node.roles.coordinator import Coordinator

app = typer.Typer(help="Run a coordinator node.", no_args_is_help=True)


@app.command("run")
def run(
    network: NetworkOpt,
    peers: PeersOpt = None,
    rounds: Annotated[Optional[int], typer.Option(help="Stop after this many merges (default: until Ctrl-C).")] = None,
    eval_n: Annotated[int, typer.Option(help="Held-out episodes per skill when evaluating a merge.", min=1)] = EVAL_N,
    verify: Annotated[bool, typer.Option("--verify", help="Recompute a published merge and report whether its hash matches.")] = False,
    version: Annotated[Optional[int], typer.Option(help="With --verify: the version to check (default: latest).")] = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for merging (default: up to 4).", min=1)] = None,
    chunk_elems: Annotated[Optional[int], typer.Option(
        help="Elements per row chunk of the streaming merge, which bounds memory per delta (default: the "
             "engine's). Results never depend on it or on --threads.", min=1)] = None,
    max_blob_gb: Annotated[Optional[float], typer.Option(
        help="Cap on the blob store (GB): a download that would pass it is refused (default: only keep the disk "
             "from filling).", min=0.001)] = None,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 0,
    announce: AnnounceOpt = None,
    auto_relay: AutoRelayOpt = False,
    key: KeyOpt = None,
    report_to: Annotated[Optional[list[str]], typer.Option(help="Also send each merge's per-skill accuracy and counts to "
                                                           "tensorboard or wandb (under the store's tracking/); repeatable.")] = None,
    json: JsonOpt = False,
) -> None:
    """Collect, verify, screen and merge each round's deltas; evaluate every skill; publish the signed
    checkpoint. A coordinator killed mid-round restarts without publishing a version twice."""
    from skillswarm.node.roles.coordinator import Coordinator
    from skillswarm.node.roles.verification import MergeOptions, verify_checkpoint
    from skillswarm.node.checkpoints.pull import find_checkpoint
    from skillswarm.node.network.session import open_session, stop_on_signals
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.skills.registry import check_network

    spec = load_spec(network)
    check_network(spec, spec.skills)  # it evaluates every skill: each plugin must be the network's version
    options = MergeOptions(threads=threads, chunk_elems=chunk_elems)
    if threads:
        import torch

        torch.set_num_threads(threads)  # torch's own kernels too, not only the merge's thread pool
    with stop_on_signals() as stop, open_session(network, key=key, peers=peers, host=host, port=port,
                                                 announce=announce or (), auto_relay=auto_relay,
                                                 ephemeral_key=verify and key is None,
                                                 max_blob_bytes=int(max_blob_gb * 1e9) if max_blob_gb else None) as s:
        if verify:
            manifest = find_checkpoint(s.dht, s.spec, version)
            if manifest is None:
                fail(f"no trusted checkpoint{'' if version is None else f' v{version}'} found on {s.spec.network}")
            v = verify_checkpoint(s.spec, s.dht, s.store, s.blobs, manifest, progress=not json, options=options)
            published_delta = manifest.merged_delta.sha256 if manifest.merged_delta else None
            result = {"version": manifest.version, "published_hash": manifest.weights_hash,
                      "recomputed_hash": v.weights_hash, "published_merged_delta": published_delta,
                      "recomputed_merged_delta": v.merged_delta, "match": v.match}
            if json:
                print_json(result)
            else:
                verdict = "[bold green]matches[/]" if v.match else "[bold red]DOES NOT MATCH[/]"
                console.print(f"v{manifest.version}: recomputed {v.weights_hash[:16]} {verdict} published "
                              f"{manifest.weights_hash[:16]} (merged delta {str(v.merged_delta)[:16]} vs "
                              f"{str(published_delta)[:16]})", highlight=False)
            if not v.match:
                raise typer.Exit(3)
            return

        from skillswarm.node.rl.tracking import open_trackers, send

        trackers = open_trackers(report_to or [], s.store.root / "tracking", f"coordinator-{s.spec.network}",
                                 {"network": s.spec.network, "skills": list(s.spec.skills)})

        def event(kind: str, data: dict) -> None:
            if kind == "merged":
                send(trackers, {"kind": "round", "step": data["version"], "accuracy": data["metrics"],
                                "included": data["included"], "rejected": data["rejected"], "seconds": data["seconds"]})
            if kind == "published":
                console.print(f"published checkpoint v{data['version']} ({data['weights_hash'][:12]})")
            elif kind == "round":
                console.print(f"round v{data['version']}: {data['deltas']} delta(s)")
            elif kind == "waiting":
                console.print(data["note"], highlight=False)
            elif kind == "cosigned":
                console.print(f"v{data['version']}: recomputed the leader's merge here and co-signed it "
                              f"({data['signers']} signature(s) seen)")
            elif kind == "failover":
                console.print(f"round v{data['version']}: its leader is offline or silent; this node runs it")
            elif kind == "merged":
                accs = ", ".join(f"{k} {v:.2f}" for k, v in data["metrics"].items())
                at = f" at lambda {data['lambda']:g}" if data.get("lambda") is not None else ""
                console.print(f"merged v{data['version']}{at}: {data['included']} in, {data['rejected']} rejected, "
                              f"{data['seconds']:.1f}s; accuracy {accs}")

        coordinator = Coordinator(s.spec, s.identity, s.dht, s.store, s.blobs, eval_n=eval_n, on_event=event,
                                  merge_options=options)
        s.dht.start_heartbeat(lambda: s.dht.make_peer_record(role="coordinator", state=coordinator.state,
                                                             note=coordinator.note, checkpoint_version=s.store.latest()),
                              interval=10.0, ttl=30.0)
        console.print(f"coordinator [bold]{s.identity.peer_id}[/] for {s.spec.network}; listening on "
                      f"{', '.join(s.dht.visible_maddrs()[:2])}", highlight=False)
        try:
            reports = coordinator.run(stop, max_rounds=rounds)
        finally:
            for tracker in trackers:
                tracker.close()
        _hold(coordinator, again=stop.is_set())
        served = s.dht.served_bytes()
    console.print(f"stopped after {len(reports)} merge(s); uploaded {served / 1e6:.1f} MB to peers.")


def _hold(coordinator: "Coordinator", again: bool) -> None:
    """Keep serving the latest checkpoint until enough other peers hold it (`Coordinator.hold`); a Ctrl-C after the
    one that stopped the rounds (`again`: that one came already) leaves at once, with a warning."""
    current = coordinator.current
    if current is None or coordinator.spec.round.copies_wanted() <= 0:
        return
    console.print(f"v{current.version}: serving it until {coordinator.spec.round.copies_wanted()} other peer(s) hold a "
                  f"copy; Ctrl-C {'again' if again else 'twice'} to leave now", highlight=False)
    try:
        coordinator.hold()
    except KeyboardInterrupt:
        console.print(f"[yellow]warning:[/] left without waiting for copies of v{current.version}: once no other peer "
                      "holds it, it cannot be pulled", highlight=False)
