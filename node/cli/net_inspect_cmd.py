"""`skillswarm net skills | deltas | checkpoints`: what the network has learned, from a short-lived
client peer (tables, or `--json`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, print_json, table
from skillswarm.node.cli.net_cmd import NetworkOpt, PeersOpt, ago, observer
from skillswarm.node.network.view import checkpoints_view, deltas_view, skills_view
from skillswarm.protocol.identity import fingerprint
from skillswarm.protocol.netspec import load_spec


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def skills_cmd(network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None, json: JsonOpt = False) -> None:
    """Each skill shard: its contributors (workers online), their latest progress, and the latest merged score."""
    spec = load_spec(network)
    with observer(spec, peers) as dht:
        view = skills_view(dht, spec)
    out = view["skills"]
    if json:
        print_json(view)
        return
    rows = []
    for o in out:
        best = o["contributors"][0] if o["contributors"] else None
        rows.append([o["skill"], o["workers_online"], len(o["contributors"]),
                     "-" if best is None else f"{best['mean_reward']:.3f} (v{best['checkpoint_version']}, step {best['steps']})",
                     "-" if best is None else ago(best["updated_s"]),
                     "-" if o["merged_accuracy"] is None else f"{_pct(o['merged_accuracy'])} (v{o['merged_version']})"])
    console.print(table(f"skills of {spec.network}", ["skill", "workers online", "contributors", "latest reward",
                                                       "updated", "merged accuracy"], rows))


def deltas_cmd(
    network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None,
    version: Annotated[Optional[int], typer.Option(help="Base version (default: the latest and the one before).")] = None,
    json: JsonOpt = False,
) -> None:
    """Deltas per base version with their screening result (from the manifest that merged them)."""
    spec = load_spec(network)
    with observer(spec, peers) as dht:
        view = deltas_view(dht, spec, version)
    out = view["deltas"]
    if json:
        print_json(view)
        return
    rows = [[f"v{o['base_version']}", o["skill"], o["author"], o["blob"][:12], f"{o['size'] / 1e6:.1f} MB", o["codec"],
             f"{o['norm']:.3g}", f"{_pct(o['accuracy_before'])} -> {_pct(o['accuracy_after'])}",
             o["screening"] + (f": {o['reason']}" if o["reason"] else "")] for o in out]
    console.print(table(f"deltas in {spec.network}", ["base", "skill", "author", "blob", "size", "codec", "norm",
                                                       "held-out", "screening"], rows))


def checkpoints_cmd(network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None, json: JsonOpt = False) -> None:
    """Checkpoint history (trusted coordinators only): parents, merge method, deltas in and out, per-skill metrics."""
    spec = load_spec(network)
    with observer(spec, peers) as dht:
        view = checkpoints_view(dht, spec)
    if json:
        print_json(view)
        return
    rows = [[f"v{c['version']}", "-" if c["parent_version"] is None else f"v{c['parent_version']}", c["weights_hash"][:12],
             _method(c), len(c["included"]), len(c["rejected"]),
             ", ".join(f"{k} {_pct(m['accuracy'])}" for k, m in sorted(c["metrics"].items())) or "-",
             fingerprint(c["author"]), ago(time.time() - c["created"])] for c in view["checkpoints"]]
    console.print(table(f"checkpoints of {spec.network}", ["version", "parent", "weights", "method", "in", "out",
                                                            "accuracy", "coordinator", "published"], rows))


def _method(c: dict) -> str:
    """A checkpoint's merge method and the lambda it was merged at (which the coordinator may have searched)."""
    if not c["method"]:
        return "base"
    scale = c.get("params", {}).get("lambda")
    return c["method"] if scale is None else f"{c['method']} @ {scale:g}"


def dashboard_cmd(
    network: NetworkOpt = Path("network.toml"), peers: PeersOpt = None,
    host: Annotated[str, typer.Option(help="Address to serve the page on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the page (0: any free port).", min=0, max=65535)] = 8080,
    refresh: Annotated[float, typer.Option(help="Seconds between refreshes of the view.", min=0.5)] = 3.0,
) -> None:
    """A live web page of the network (http://HOST:PORT/): peers by role and shard, each shard's contributors and
    rewards, rounds with their included and rejected deltas, and per-skill accuracy over checkpoint versions."""
    import uvicorn

    from skillswarm.node.cli.net_cmd import join_peers
    from skillswarm.node.network.dashboard import Watcher, create_app
    from skillswarm.node.endpoint.serve import listen_socket

    spec = load_spec(network)
    with observer(spec, peers) as dht:
        watcher = Watcher(dht, spec, join_peers(spec, peers), refresh)
        watcher.start()
        sock = listen_socket(host, port)
        server = uvicorn.Server(uvicorn.Config(create_app(watcher), log_level="warning", access_log=False, lifespan="off"))
        console.print(f"dashboard of {spec.network} at [bold]http://{host}:{sock.getsockname()[1]}/[/] "
                      "(Ctrl-C stops)", highlight=False)
        try:
            server.run(sockets=[sock])
        finally:
            watcher.stop.set()
            sock.close()


def register(app: typer.Typer) -> None:
    """Add these commands to the `net` group (they share its options and its short-lived client peer)."""
    for name, command in (("skills", skills_cmd), ("deltas", deltas_cmd), ("checkpoints", checkpoints_cmd),
                          ("dashboard", dashboard_cmd)):
        app.command(name)(command)
