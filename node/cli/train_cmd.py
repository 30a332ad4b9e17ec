"""`skillswarm train`: async multi-turn GRPO on one skill shard; writes the trained model and its delta
(and, with --lora, the PEFT adapter)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, err_console, print_json, table
from skillswarm.node.cli.options import config_from, field_option
from skillswarm.node.rl.config import TrainConfig, default_of


def _opt(name: str, *param_decls: str, **kwargs: object) -> object:
    """The option of TrainConfig's field `name` (its default stated there, once)."""
    return field_option(TrainConfig, name, *param_decls, **kwargs)


def train_cmd(
    ctx: typer.Context,
    skill: Annotated[str, typer.Option(help="Skill shard to train on (see `skillswarm skills list`), or external:NAME "
                                       "for the trajectories an endpoint records under NAME (with --store or --serve), or "
                                       "verifiers:ENV_ID for an installed verifiers environment's rollouts.")],
    model: Annotated[Optional[Path], typer.Option(help="Starting model directory (HF format). Default: the nano base.")] = None,
    steps: int = _opt("steps", help="Optimizer steps (the run also stops at --max-minutes).", min=0),
    out_dir: Path = _opt("out_dir", "--out", help="Run directory: metrics, checkpoints, trained model, delta."),
    lora: bool = _opt("lora", "--lora", help="Train a LoRA adapter (peft) instead of every weight; writes OUT/adapter, a "
                      "PEFT adapter directory (PeftModel.from_pretrained)."),
    lora_rank: int = _opt("lora_rank", help="LoRA rank.", min=1),
    group_size: int = _opt("group_size", help="Episodes per task (a group, same environment seed).", min=2),
    batch: int = _opt("batch", help="Groups (tasks) per step, and per generation batch.", min=1),
    max_staleness: int = _opt("max_staleness", help="Drop groups more than S policy versions old.", min=0),
    loss: str = _opt("loss", help="Loss variant: grpo, dr_grpo or dapo."),
    lr: float = _opt("lr", help="AdamW learning rate."),
    warmup_steps: int = _opt("warmup_steps", help="Linear learning-rate warm-up steps.", min=0),
    beta: float = _opt("beta", help="KL penalty to the starting policy (0: none).", min=0.0),
    retain_skills: Optional[list[str]] = _opt("retain_skills", "--retain-skill", help="Keep this skill's behaviour where "
                                              "the run started (a KL on the starting model's episodes); repeatable."),
    retain: float = _opt("retain", help="Weight of that KL (with --retain-skill).", min=0.0),
    eps_low: float = _opt("eps_low", help="Clip range below 1."),
    eps_high: float = _opt("eps_high", help="Clip range above 1 (clip-higher when > eps-low)."),
    temperature: float = _opt("temperature", help="Sampling temperature of the episodes."),
    max_new_tokens: int = _opt("max_new_tokens", help="Token cap per model turn.", min=1),
    max_minutes: Optional[float] = _opt("max_minutes", help="Stop after M minutes of training (or at --steps, if "
                                        "sooner); loading and the first eval do not count."),
    eval_every: int = _opt("eval_every", help="Held-out eval every K steps (0: only before and after).", min=0),
    eval_n: int = _opt("eval_n", help="Held-out tasks per eval (0: no eval).", min=0),
    save_every: int = _opt("save_every", help="Run checkpoint every K steps (0: only at the end).", min=0),
    seed: int = _opt("seed", help="Seed of task sampling and generation."),
    engine: str = _opt("engine", help="Inference engine: hf or vllm (GPU)."),
    sync: bool = _opt("sync", "--sync", help="Generate and train in lock-step (no overlap), for comparison."),
    async_mode: str = _opt("async_mode", help="Where async generation runs: auto, process or thread."),
    threads: Optional[int] = _opt("threads", help="Torch threads per process (default: 1 for small models)."),
    codec: Annotated[Optional[str], typer.Option(help="Delta codec (dense_bf16, dense_fp32, topk, int8, lora, ...). "
                                                 "Default: lora with --lora (the adapter itself), else "
                                                 f"{default_of(TrainConfig, 'codec')}.")] = None,
    resume: bool = _opt("resume", "--resume", help="Continue the run in --out from its last checkpoint."),
    store: Optional[Path] = _opt("store", help="Trajectory store to train on (`skillswarm endpoint serve --store`, "
                                 "`skillswarm ingest`); needs --skill external:NAME."),
    store_wait_s: float = _opt("store_wait_s", "--wait", help="With --store: seconds to wait for new scored groups "
                               "before the run ends (with --serve: 0 waits as long as the run lasts).", min=0.0),
    serve_port: Optional[int] = _opt("serve_port", "--serve", help="With --skill external:NAME: serve the policy being "
                                     "trained at http://127.0.0.1:PORT/v1 (as `endpoint serve`; with NAME a skill, its "
                                     "tasks and rubric too) and train on what it records.", min=0, max=65535),
    report_to: Optional[list[str]] = _opt("report_to", help="Also send the metrics to tensorboard (OUT/tensorboard) or "
                                          "wandb (extras of the same names); repeatable."),
    json_out: JsonOpt = False,
) -> None:
    """Train a model on one skill with GRPO (async by default); writes OUT/model and OUT/delta.safetensors
    (with --lora also OUT/adapter, a PEFT adapter directory)."""
    from skillswarm.node.cli.eval_cmd import default_model
    from skillswarm.node.endpoint.training import endpoint_source
    from skillswarm.node.rl.run import train

    cfg = config_from(ctx, TrainConfig, model_dir=model if model is not None else default_model(),
                      codec=codec or ("lora" if lora else default_of(TrainConfig, "codec")),
                      retain_skills=tuple(retain_skills or ()), report_to=tuple(report_to or ()))
    if not json_out:
        err_console.print(f"training [bold]{skill}[/] on {cfg.model_dir} ({cfg.mode()}, {engine}"
                          f"{', LoRA' if lora else ''}) -> {out_dir}", highlight=False)
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
