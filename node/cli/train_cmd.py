"""`skillswarm train`: async multi-turn GRPO on one skill shard; writes the trained model and its delta
(and, with --lora, the PEFT adapter)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, err_console, print_json, table
from skillswarm.node.rl.config import TrainConfig, default_of


def _d(name: str) -> Any:
    """An option's default: TrainConfig's, the one place it is stated."""
    return default_of(TrainConfig, name)


def train_cmd(
    skill: Annotated[str, typer.Option(help="Skill shard to train on (see `skillswarm skills list`), or external:NAME "
                                       "for the trajectories an endpoint records under NAME (with --store or --serve), or "
                                       "verifiers:ENV_ID for an installed verifiers environment's rollouts.")],
    model: Annotated[Optional[Path], typer.Option(help="Starting model directory (HF format). Default: the nano base.")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps (the run also stops at --max-minutes).", min=0)] = _d("steps"),
    out: Annotated[Path, typer.Option(help="Run directory: metrics, checkpoints, trained model, delta.")] = _d("out_dir"),
    lora: Annotated[bool, typer.Option("--lora", help="Train a LoRA adapter (peft) instead of every weight; writes "
                                       "OUT/adapter, a PEFT adapter directory (PeftModel.from_pretrained).")] = False,
    lora_rank: Annotated[int, typer.Option(help="LoRA rank.", min=1)] = _d("lora_rank"),
    group_size: Annotated[int, typer.Option(help="Episodes per task (a group, same environment seed).", min=2)] = _d("group_size"),
    batch: Annotated[int, typer.Option(help="Groups (tasks) per step, and per generation batch.", min=1)] = _d("batch"),
    max_staleness: Annotated[int, typer.Option(help="Drop groups more than S policy versions old.", min=0)] = _d("max_staleness"),
    loss: Annotated[str, typer.Option(help="Loss variant: grpo, dr_grpo or dapo.")] = _d("loss"),
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = _d("lr"),
    warmup_steps: Annotated[int, typer.Option(help="Linear learning-rate warm-up steps.", min=0)] = _d("warmup_steps"),
    beta: Annotated[float, typer.Option(help="KL penalty to the starting policy (0: none).", min=0.0)] = _d("beta"),
    retain_skill: Annotated[Optional[list[str]], typer.Option(help="Keep this skill's behaviour where the run started "
                                                              "(a KL on the starting model's episodes); repeatable.")] = None,
    retain: Annotated[float, typer.Option(help="Weight of that KL (with --retain-skill).", min=0.0)] = _d("retain"),
    eps_low: Annotated[float, typer.Option(help="Clip range below 1.")] = _d("eps_low"),
    eps_high: Annotated[float, typer.Option(help="Clip range above 1 (clip-higher when > eps-low).")] = _d("eps_high"),
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the episodes.")] = _d("temperature"),
    max_new_tokens: Annotated[int, typer.Option(help="Token cap per model turn.", min=1)] = _d("max_new_tokens"),
    max_minutes: Annotated[Optional[float], typer.Option(help="Stop after M minutes of training (or at --steps, if sooner); loading and the first eval do not count.")] = _d("max_minutes"),
    eval_every: Annotated[int, typer.Option(help="Held-out eval every K steps (0: only before and after).", min=0)] = _d("eval_every"),
    eval_n: Annotated[int, typer.Option(help="Held-out tasks per eval (0: no eval).", min=0)] = _d("eval_n"),
    save_every: Annotated[int, typer.Option(help="Run checkpoint every K steps (0: only at the end).", min=0)] = _d("save_every"),
    seed: Annotated[int, typer.Option(help="Seed of task sampling and generation.")] = _d("seed"),
    engine: Annotated[str, typer.Option(help="Inference engine: hf or vllm (GPU).")] = _d("engine"),
    sync: Annotated[bool, typer.Option("--sync", help="Generate and train in lock-step (no overlap), for comparison.")] = False,
    async_mode: Annotated[str, typer.Option(help="Where async generation runs: auto, process or thread.")] = _d("async_mode"),
    threads: Annotated[Optional[int], typer.Option(help="Torch threads per process (default: 1 for small models).")] = _d("threads"),
    codec: Annotated[Optional[str], typer.Option(help="Delta codec (dense_bf16, dense_fp32, topk, int8, lora, ...). "
                                                 "Default: lora with --lora (the adapter itself), else dense_bf16.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    store: Annotated[Optional[Path], typer.Option(help="Trajectory store to train on (`skillswarm endpoint serve --store`, "
                                                  "`skillswarm ingest`); needs --skill external:NAME.")] = None,
    wait: Annotated[float, typer.Option(help="With --store: seconds to wait for new scored groups before the run ends "
                                        "(with --serve: 0 waits as long as the run lasts).", min=0.0)] = _d("store_wait_s"),
    serve: Annotated[Optional[int], typer.Option(help="With --skill external:NAME: serve the policy being trained at "
                                                 "http://127.0.0.1:PORT/v1 (as `endpoint serve`; with NAME a skill, its "
                                                 "tasks and rubric too) and train on what it records.",
                                                 min=0, max=65535)] = None,
    report_to: Annotated[Optional[list[str]], typer.Option(help="Also send the metrics to tensorboard (OUT/tensorboard) "
                                                           "or wandb (extras of the same names); repeatable.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a model on one skill with GRPO (async by default); writes OUT/model and OUT/delta.safetensors
    (with --lora also OUT/adapter, a PEFT adapter directory)."""
    from skillswarm.node.cli.eval_cmd import _default_model
    from skillswarm.node.endpoint.training import endpoint_source
    from skillswarm.node.rl.run import train

    cfg = TrainConfig(model_dir=model if model is not None else _default_model(), skill=skill, steps=steps, out_dir=out,
                      lora=lora, lora_rank=lora_rank, group_size=group_size, batch=batch, max_staleness=max_staleness,
                      loss=loss, lr=lr, warmup_steps=warmup_steps, beta=beta, retain=retain,
                      retain_skills=tuple(retain_skill or ()), eps_low=eps_low, eps_high=eps_high,
                      temperature=temperature, max_new_tokens=max_new_tokens, max_minutes=max_minutes,
                      eval_every=eval_every, eval_n=eval_n, save_every=save_every, seed=seed, engine=engine, sync=sync,
                      async_mode=async_mode, threads=threads, resume=resume, store=store, store_wait_s=wait,
                      serve_port=serve, report_to=tuple(report_to or ()),
                      **({"codec": codec} if codec else {"codec": "lora"} if lora else {}))
    if not json_out:
        err_console.print(f"training [bold]{skill}[/] on {cfg.model_dir} ({cfg.mode()}, {engine}"
                          f"{', LoRA' if lora else ''}) -> {out}", highlight=False)
    result = train(cfg, progress=not json_out, endpoint_source=endpoint_source)
    stats = result.stats
    data = {"run_dir": str(result.run_dir), "model_dir": str(result.model_dir), "metrics": str(result.metrics_path),
            "delta": None if result.delta is None else {"path": str(result.delta.path), "sha256": result.delta.sha256,
                                                        "size": result.delta.size, "codec": result.delta.codec,
                                                        "norm": result.delta.norm},
            "adapter": None if result.adapter_dir is None else str(result.adapter_dir),
            "stats": {f: getattr(stats, f) for f in stats.__struct_fields__}}
    if json_out:
        print_json(data)
        return
    rows = [[f, getattr(stats, f)] for f in stats.__struct_fields__]
    console.print(table(f"trained {skill}: {result.model_dir}", ["stat", "value"], rows))
    if stats.accuracy_before is not None and stats.accuracy_after is not None:
        console.print(f"held-out accuracy {stats.accuracy_before:.1%} -> [bold]{stats.accuracy_after:.1%}[/] "
                      f"({(stats.accuracy_after - stats.accuracy_before) * 100:+.1f} points, n={stats.eval_n})", highlight=False)
    if result.delta is not None:
        console.print(f"delta {result.delta.path} ({result.delta.codec}, {result.delta.size:,} bytes)", highlight=False)
    if result.adapter_dir is not None:
        console.print(f"PEFT adapter {result.adapter_dir} (PeftModel.from_pretrained(base, path))", highlight=False)
    console.print(f"plots: skillswarm report {result.run_dir}", highlight=False)
