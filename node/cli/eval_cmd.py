"""`skillswarm eval`: a model's held-out accuracy on one skill."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from skillswarm.node.cli.common import JsonOpt, console, err_console, fail, print_json, table
from skillswarm.node.rl.config import EVAL_N


def default_model() -> Path:
    from skillswarm.node.cli.base_cmd import build_with_progress
    from skillswarm.skills.nano.build import default_model_dir, is_built

    path = default_model_dir()
    if not is_built(path):
        err_console.print("no --model given and the default nano model is not built yet: building it now (once)")
    return build_with_progress()


def eval_cmd(
    skill: Annotated[str, typer.Option(help="Skill to evaluate (see `skillswarm skills list`).")],
    model: Annotated[Optional[Path], typer.Option(help="Model directory (HF format). Default: the nano base model.")] = None,
    n: Annotated[int, typer.Option("--n", help="Held-out tasks to run (the first N of the fixed split).", min=1)] = EVAL_N,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).", min=0.0)] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the environments and of sampling.")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: 1 for small models, else all).", min=1)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a skill's held-out split on a model; print accuracy, mean reward and outcome counts."""
    import torch

    from skillswarm.node.rl.engines.hf import HFEngine, auto_threads
    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.skills.registry import get_skill

    sk = get_skill(skill)
    model_dir = model if model is not None else default_model()
    engine = HFEngine.load(model_dir)
    if engine.device.type == "cpu":
        torch.set_num_threads(threads or auto_threads(engine.model))
    columns = (TextColumn(f"[bold]eval {sk.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("eval", total=n)
        result = evaluate(engine, sk, n, seed, temperature=temperature, on_done=lambda _: bar.advance(task))
    broken = result.outcomes.get("env_error", 0) == result.n
    if json_out:
        print_json(result.as_json())
    else:
        _print_result(sk.name, model_dir, result)
    if broken:  # nothing was measured: the skill's environment failed on every task (its bug, not the model's)
        fail(f"every episode of {sk.name} ended in env_error: the skill's environment or rubric failed, so there is no "
             "accuracy to report; rerun with -v to see its errors")


def _print_result(name: str, model_dir: Path, result: Any) -> None:
    console.print(f"[bold]{escape(name)}[/] on {escape(str(model_dir))}: accuracy [bold]{result.accuracy:.1%}[/] "
                  f"({round(result.accuracy * result.n)}/{result.n}), mean reward {result.mean_reward:.3f}, "
                  f"{result.seconds:.1f}s", highlight=False)
    console.print(table("outcomes", ["outcome", "episodes"], [[k, v] for k, v in result.outcomes.items()]))
    if result.by_kind:
        console.print(table("by kind of task", ["kind", "episodes", "accuracy"],
                            [[escape(k), int(v["n"]), f"{v['accuracy']:.1%}"] for k, v in result.by_kind.items()]))
    if result.rubric:
        console.print(table("rubric (mean per episode; weight-0 metrics included)", ["reward function", "mean"],
                            [[k, f"{v:.4g}"] for k, v in result.rubric.items()]))
