"""`skillswarm endpoint serve` (an OpenAI-compatible, recording endpoint) and `skillswarm ingest`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from skillswarm.node.cli.common import JsonOpt, console, err_console, print_json
from skillswarm.node.endpoint.limits import DEFAULT_HOST, DEFAULT_PORT, StoreLimits
from skillswarm.node.rl.engines.base import DEFAULT_ENGINE

app = typer.Typer(help="Serve a model behind an OpenAI-compatible API and record every call for training.",
                  no_args_is_help=True)
DEFAULT_STORE = Path("runs/endpoint")
_LIMITS = StoreLimits()


@app.command("serve")
def serve_cmd(
    model: Annotated[Optional[Path], typer.Option(help="Model directory (HF format). Default: the nano base.")] = None,
    skill: Annotated[Optional[str], typer.Option(help="Hand out this skill's tasks (GET /v1/tasks) and grade the "
                                                 "trajectories that play them with its rubric.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name the trajectories are recorded under (train with "
                                                "--skill external:NAME). Default: the skill, else 'default'.")] = None,
    store: Annotated[Path, typer.Option(help="Trajectory store directory (groups.jsonl, expired.jsonl).")] = DEFAULT_STORE,
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="Port to listen on.", min=0, max=65535)] = DEFAULT_PORT,
    api_key: Annotated[Optional[str], typer.Option(help="Require `Authorization: Bearer KEY` (default: "
                                                   "SKILLSWARM_API_KEY, else none).", show_default=False)] = None,
    engine: Annotated[str, typer.Option(help="Inference engine: hf or vllm (GPU).")] = DEFAULT_ENGINE,
    max_batch: Annotated[int, typer.Option(help="Most sequences generated in one engine batch.", min=1)] = 64,
    threads: Annotated[Optional[int], typer.Option(help="Torch threads (default: 1 for small models, else all cores).",
                                                   min=1)] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Default token cap of a reply (a request's max_tokens "
                                                          "wins). Default: the rollouts' turn cap.", min=1)] = None,
    deadline: Annotated[float, typer.Option(help="Seconds a trajectory waits for its reward before it expires.",
                                            min=1.0)] = _LIMITS.deadline_s,
    group_idle: Annotated[float, typer.Option(help="Seconds without activity before a finished group of undeclared "
                                              "size closes.", min=0.0)] = _LIMITS.group_idle_s,
) -> None:
    """Serve MODEL at http://HOST:PORT/v1 (/models, /chat/completions, /completions, /feedback, /tasks, /stats).

    Every call is recorded with its exact token ids and sampling logprobs; rewards come from POST
    /v1/feedback or, with --skill, from the skill's rubric. Closed groups land in STORE/groups.jsonl."""
    from skillswarm.node.cli.eval_cmd import default_model
    from skillswarm.node.endpoint.serve import build_service, serve_forever

    if host not in ("127.0.0.1", "localhost", "::1") and not (api_key or os.environ.get("SKILLSWARM_API_KEY")):
        err_console.print(f"[yellow]warning:[/] listening on {escape(host)} without --api-key: anyone who can reach "
                          "this port can use the model and write rewards", highlight=False)
    model_dir = model if model is not None else default_model()
    limits = StoreLimits(deadline_s=deadline, group_idle_s=group_idle)
    service = build_service(model_dir, store, name=name, skill=skill, engine=engine, limits=limits, max_batch=max_batch,
                            max_new_tokens=max_new_tokens)
    if hasattr(service.engine, "model"):  # the hf engine: CPU threads as `eval` sets them
        import torch

        from skillswarm.node.rl.engines.hf import auto_threads

        torch.set_num_threads(threads or auto_threads(service.engine.model))

    def ready(url: str) -> None:
        console.print(f"serving [bold]{escape(service.model_name)}[/] at [bold]{escape(url)}[/] "
                      f"(recording into {escape(str(store))} as {escape(service.store.name)}); Ctrl-C stops", highlight=False)
        console.print(f"train on what it records: skillswarm train --skill external:{escape(service.store.name)} "
                      f"--store {escape(str(store))} --model {escape(str(model_dir))}", highlight=False)

    serve_forever(service, host, port, api_key or os.environ.get("SKILLSWARM_API_KEY"), on_ready=ready)


def ingest_cmd(
    file: Annotated[Path, typer.Argument(help="JSONL: one trajectory per line (messages, reward[, group_id, "
                                         "turn_rewards, correct, reason]).")],
    store: Annotated[Path, typer.Option(help="Trajectory store to add the groups to.")] = DEFAULT_STORE,
    model: Annotated[Optional[Path], typer.Option(help="The model the traces train (its chat template tokenizes "
                                                  "them). Default: the nano base.")] = None,
    name: Annotated[str, typer.Option(help="Name to record them under (train with --skill external:NAME).")] = "default",
    temperature: Annotated[float, typer.Option(help="The sampling temperature the logprobs are computed at (train "
                                               "at the same one).")] = 1.0,
    json_out: JsonOpt = False,
) -> None:
    """Add logged traces with scores to a trajectory store, for `train --skill external:NAME --store STORE`."""
    from skillswarm.node.cli.eval_cmd import default_model
    from skillswarm.node.endpoint.ingest import ingest

    model_dir = model if model is not None else default_model()
    result = ingest(file, store, model_dir, name, temperature)
    data = {"store": str(store), "name": name, "trajectories": result.trajectories, "groups": result.groups,
            "single_trajectory_groups": result.single_groups, "logprobs_from_model": result.scored_with_model}
    if json_out:
        print_json(data)
        return
    console.print(f"ingested {result.trajectories} trajectories in {result.groups} groups into {escape(str(store))} "
                  f"as {escape(name)}", highlight=False)
    if result.single_groups:
        console.print(f"[yellow]{result.single_groups} groups hold one trajectory[/]: GRPO compares trajectories of one "
                      "prompt, so give runs of the same task the same group_id", highlight=False)
    console.print(f"train: skillswarm train --skill external:{escape(name)} --store {escape(str(store))} "
                  f"--model {escape(str(model_dir))}", highlight=False)
