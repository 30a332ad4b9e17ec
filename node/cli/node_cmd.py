"""`skillswarm node run`: a worker that trains one skill shard and publishes its deltas."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from skillswarm.node.cli.common import KeyOpt, console
from skillswarm.node.cli.options import field_option, given
from skillswarm.node.cli.swarm_opts import AnnounceOpt, AutoRelayOpt, HostOpt, NetworkOpt, PeersOpt, PortOpt
from skillswarm.node.rl.config import WorkerSettings

app = typer.Typer(help="Run a worker node.", no_args_is_help=True)


@app.command("run")
def run(
    ctx: typer.Context,
    network: NetworkOpt,
    skill: Annotated[str, typer.Option(help="The skill shard to train (one of the network's skills).")],
    peers: PeersOpt = None,
    settings: Annotated[Optional[Path], typer.Option(help="Training settings file (TOML, or JSON for a .json name; "
                                                     "fields as the options below); options given override it.",
                                                     show_default=False)] = None,
    engine: str = field_option(WorkerSettings, "engine"),
    lora: bool = field_option(WorkerSettings, "lora"),
    steps_per_round: Optional[int] = field_option(WorkerSettings, "steps_per_round"),
    minutes_per_round: Optional[float] = field_option(WorkerSettings, "minutes_per_round"),
    rounds: Annotated[Optional[int], typer.Option(help="Stop after this many rounds (default: run until Ctrl-C).")] = None,
    group_size: int = field_option(WorkerSettings, "group_size"),
    batch: int = field_option(WorkerSettings, "batch"),
    lr: float = field_option(WorkerSettings, "lr"),
    threads: Optional[int] = field_option(WorkerSettings, "threads"),
    eval_n: int = field_option(WorkerSettings, "eval_n"),
    retain: float = field_option(WorkerSettings, "retain"),
    wait_timeout: Annotated[Optional[float], typer.Option(help="Give up when no new checkpoint comes for this many seconds.")] = None,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 0,
    announce: AnnounceOpt = None,
    auto_relay: AutoRelayOpt = False,
    key: KeyOpt = None,
    progress: Annotated[bool, typer.Option(help="Show training progress bars.")] = True,
    report_to: Optional[list[str]] = field_option(WorkerSettings, "report_to"),
) -> None:
    """Join the network, pull the latest trusted checkpoint, train rounds of GRPO on SKILL and publish
    each round's delta. Ctrl-C finishes the current step and exits cleanly; a restart resumes."""
    from skillswarm.node.rl.config import load_settings, override
    from skillswarm.node.network.session import open_session, stop_on_signals
    from skillswarm.node.roles.worker import Worker, WorkerOptions
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.skills.registry import check_network

    chosen = override(load_settings(settings) if settings is not None else WorkerSettings(),
                      given(ctx, WorkerSettings), "node run")
    check_network(load_spec(network), [skill])  # before joining: a wrong plugin version must not start a peer
    with stop_on_signals() as stop, open_session(network, key=key, peers=peers, host=host, port=port,
                                                 announce=announce or (), auto_relay=auto_relay) as s:
        console.print(f"worker [bold]{s.identity.peer_id}[/] on [bold]{skill}[/] in network {s.spec.network}; "
                      f"listening on {', '.join(s.dht.visible_maddrs()[:2])}", highlight=False)

        def event(kind: str, data: dict) -> None:
            if kind == "pulled":
                console.print(f"pulled checkpoint v{data['version']}")
            elif kind == "published":
                console.print(f"published delta for v{data['version']} ({data['blob'][:12]}): held-out accuracy "
                              f"{data['accuracy_before']} -> {data['accuracy_after']}")

        worker = Worker(s.spec, s.identity, s.dht, s.store, s.blobs,
                        WorkerOptions(skill=skill, settings=chosen, progress=progress), on_event=event)
        worker.start_heartbeat()
        done = worker.run(stop, max_rounds=rounds, wait_timeout=wait_timeout)
        served = s.dht.served_bytes()
    console.print(f"stopped after {done} round(s); uploaded {served / 1e6:.1f} MB to peers.")
