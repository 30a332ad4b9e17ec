"""`skillswarm base build`: build (or reuse from the cache) the nano base model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from skillswarm.node.cli.common import JsonOpt, console, err_console, print_json, table

app = typer.Typer(help="The nano base model (built here, no model hub needed).", no_args_is_help=True)


def build_with_progress(out: Path | None = None, seed: int = 0, steps: int | None = None, force: bool = False,
                        with_code: bool = False) -> Path:
    """Build the nano model (or find it cached) with a progress bar on stderr; returns its directory."""
    from skillswarm.skills.nano.build import build_base, cached_path, is_built
    from skillswarm.skills.nano.recipe import CODE_RECIPE, DEFAULT_RECIPE

    recipe = (CODE_RECIPE if with_code else DEFAULT_RECIPE).with_(seed=seed, steps=steps)
    if is_built(cached_path(recipe)) and not force:
        return build_base(out, seed=seed, recipe=recipe)
    columns = (TextColumn("[bold]warm-up"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))

    def show(step: int, total: int, info: dict[str, float]) -> None:
        text = f"loss {info['loss']:.3f} " + " ".join(f"{k} {v:.0%}" for k, v in info.items() if k != "loss")
        bar.update(task, completed=step, info=text)

    # The bar's total is the step cap; the warm-up usually stops sooner, once every skill is calibrated.
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task("warm-up", total=recipe.steps, info="")
        return build_base(out, seed=seed, recipe=recipe, force=force, progress=show)


@app.command("build")
def build(
    out: Annotated[Optional[Path], typer.Option(help="Also copy the model here (default: only the cache).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and the warm-up data.")] = 0,
    steps: Annotated[Optional[int], typer.Option(help="Cap on warm-up steps (default: the recipe's).", min=1)] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when the recipe is cached; overwrite --out.")] = False,
    with_code: Annotated[bool, typer.Option("--with-code", help="Also warm up the `code` skill (its tasks run in "
                                                               "the sandbox; about 1.8x the build time).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build the nano base model: char-level tokenizer, small Llama, short warm-up on the built-in skills."""
    from skillswarm.skills.nano.build import build_info, cached_path, is_built
    from skillswarm.skills.nano.recipe import CODE_RECIPE, DEFAULT_RECIPE

    recipe = (CODE_RECIPE if with_code else DEFAULT_RECIPE).with_(seed=seed, steps=steps)
    cached = is_built(cached_path(recipe)) and not force
    start = time.monotonic()
    if not cached and not json_out:
        err_console.print(f"building the nano base model (recipe {recipe.hash()[:12]}, {recipe.steps} warm-up steps)")
    path = build_with_progress(out, seed, steps, force, with_code)
    info = build_info(path)
    result = {"path": str(path), "cached": cached, "seconds": round(time.monotonic() - start, 2),
              **{k: info[k] for k in ("recipe_hash", "weights_hash", "parameters", "steps", "final_loss",
                                      "validation_accuracy", "build_seconds")}}
    if json_out:
        print_json(result)
        return
    console.print(table(None, ["field", "value"], [[k, v] for k, v in result.items()]))
