"""`skillswarm node run`: a worker that trains one skill shard and publishes its deltas."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from skillswarm.node.cli.common import KeyOpt, console
from skillswarm.node.cli.swarm_opts import AnnounceOpt, AutoRelayOpt, HostOpt, NetworkOpt, PeersOpt, PortOpt
from skillswarm.node.rl.config import TrainConfig, default_of
from skillswarm.node.rl.engines.base import DEFAULT_ENGINE


def _d(name: str) -> Any:
    """An option's default: TrainConfig's, the one place it is stated."""
    return default_of(TrainConfig, name)


app = typer.Typer(help="Run a worker node.", no_args_is_help=True)


@app.command("run")
def run(
    network: NetworkOpt,
    skill: Annotated[str, typer.Option(help="The skill shard to train (one of the network's skills).")],
    peers: PeersOpt = None,
    engine: Annotated[str, typer.Option(help="Inference engine: hf (CPU or GPU) or vllm (GPU, the vllm extra).")] = DEFAULT_ENGINE,
    lora: Annotated[bool, typer.Option(help="Train LoRA adapters instead of all weights.")] = False,
    steps_per_round: Annotated[Optional[int], typer.Option(help="Optimizer steps per round (default: the network's).")] = None,
    minutes_per_round: Annotated[Optional[float], typer.Option(help="Also end each round's training after this many minutes (whichever comes first).", min=0.01)] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Stop after this many rounds (default: run until Ctrl-C).")] = None,
    group_size: Annotated[int, typer.Option(help="Episodes per task (GRPO group).", min=2)] = _d("group_size"),
    batch: Annotated[int, typer.Option(help="Tasks per optimizer step.", min=1)] = _d("batch"),
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: chosen by model size).")] = None,
    eval_n: Annotated[int, typer.Option(help="Held-out episodes evaluated before and after each round (0: none).",
                                        min=0)] = _d("eval_n"),
    retain: Annotated[float, typer.Option(help="Weight of the KL that keeps the network's other skills where the round "
                                          "started (0: train the shard alone).", min=0.0)] = _d("retain"),
    wait_timeout: Annotated[Optional[float], typer.Option(help="Give up when no new checkpoint comes for this many seconds.")] = None,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 0,
    announce: AnnounceOpt = None,
    auto_relay: AutoRelayOpt = False,
    key: KeyOpt = None,
    progress: Annotated[bool, typer.Option(help="Show training progress bars.")] = True,
    report_to: Annotated[Optional[list[str]], typer.Option(help="Also send each round's training metrics to tensorboard "
                                                           "or wandb (one tracker run per round); repeatable.")] = None,
) -> None:
    """Join the network, pull the latest trusted checkpoint, train rounds of GRPO on SKILL and publish
    each round's delta. Ctrl-C finishes the current step and exits cleanly; a restart resumes."""
    from skillswarm.node.session import open_session, stop_on_signals
    from skillswarm.node.worker import Worker, WorkerOptions
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.skills.registry import check_network

    check_network(load_spec(network), [skill])  # before joining: a wrong plugin version must not start a peer
    extra = {k: v for k, v in {"group_size": group_size, "batch": batch, "threads": threads, "eval_n": eval_n,
                               "retain": retain, "report_to": tuple(report_to or ()) or None}.items() if v is not None}
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
                        WorkerOptions(skill=skill, engine=engine, lora=lora, steps_per_round=steps_per_round,
                                      minutes_per_round=minutes_per_round,
                                      train=extra, progress=progress), on_event=event)
        worker.start_heartbeat()
        done = worker.run(stop, max_rounds=rounds, wait_timeout=wait_timeout)
    console.print(f"stopped after {done} round(s).")
