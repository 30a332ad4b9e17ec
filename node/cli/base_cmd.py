"""`skillswarm base build`: build (or reuse from the cache) the nano base model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from skillswarm.node.cli.common import JsonOpt, console, err_console, fail, print_json, table
from skillswarm.skills.nano.recipe import DEFAULT_RECIPE, NanoRecipe, pin_plugins

app = typer.Typer(help="The nano base model (built here, no model hub needed).", no_args_is_help=True)


def build_with_progress(out: Path | None = None, recipe: NanoRecipe | None = None, force: bool = False) -> Path:
    """Build the nano model of `recipe` (default: the default recipe), or find it cached, with a progress
    bar on stderr; returns its directory."""
    from skillswarm.skills.nano.build import build_base, cached_path, is_built, pinned_build

    recipe = pin_plugins(recipe or DEFAULT_RECIPE)
    if (is_built(cached_path(recipe)) or pinned_build(recipe) is not None) and not force:
        return build_base(out, recipe=recipe)  # from the cache, or the package's build: nothing to train
    columns = (TextColumn("[bold]warm-up"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))

    def show(step: int, total: int, info: dict[str, float]) -> None:
        text = f"loss {info['loss']:.3f} " + " ".join(f"{k} {v:.0%}" for k, v in info.items() if k != "loss")
        bar.update(task, completed=step, info=text)

    # The bar's total is the step cap; the warm-up usually stops sooner, once every skill is calibrated.
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task("warm-up", total=recipe.steps, info="")
        return build_base(out, recipe=recipe, force=force, progress=show)


def build_recipe(seed: int = DEFAULT_RECIPE.seed, steps: int | None = None, with_code: bool = False, skills: list[str] | None = None,
                 with_plugins: bool = False) -> NanoRecipe:
    """The recipe the options ask for: the default recipe's settings plus the added skills, each plugin
    pinned to its installed version (so the cache key changes with it)."""
    from skillswarm.skills.registry import get_skill, plugin_names

    added = ["code"] if with_code else []
    if with_plugins:
        plugins = plugin_names()
        if not plugins:
            fail("--with-plugins: no third-party skill is installed (see `skillswarm skills list`)")
        for name in plugins:
            if get_skill(name).reference is None:
                err_console.print(f"skipping plugin skill {name}: it has no reference player to warm up on", highlight=False)
            else:
                added.append(name)
    added += skills or []
    return pin_plugins(DEFAULT_RECIPE.with_skills(added).with_(seed=seed, steps=steps))


@app.command("build")
def build(
    out: Annotated[Optional[Path], typer.Option(help="Also copy the model here (default: only the cache).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and the warm-up data.")] = DEFAULT_RECIPE.seed,
    steps: Annotated[Optional[int], typer.Option(help="Cap on warm-up steps (default: the recipe's).", min=1)] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when the recipe is cached; overwrite --out.")] = False,
    with_code: Annotated[bool, typer.Option("--with-code", help="Also warm up the `code` skill (its tasks run in "
                                                               "the sandbox; about 1.8x the build time).")] = False,
    skill: Annotated[Optional[list[str]], typer.Option(
        "--skill", help="Also warm up this skill (e.g. an installed plugin's) through its reference player, at "
                        f"data-mix weight {NanoRecipe.added_weight:g}; repeatable.")] = None,
    with_plugins: Annotated[bool, typer.Option("--with-plugins", help="Also warm up every installed plugin skill "
                                                                     "that has a reference player.")] = False,
    pin: Annotated[bool, typer.Option("--pin", help="Make this build of the default recipe the one the package "
                                                   "ships (skills/nano/pinned/; for maintainers, after a recipe "
                                                   "change, with --force).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build the nano base model: char-level tokenizer, small Llama, short warm-up on the built-in skills
    (and any skill added with --skill, --with-plugins or --with-code)."""
    from skillswarm.skills.nano.build import build_info, cached_path, is_built, pin_build, pinned_build

    recipe = build_recipe(seed, steps, with_code, skill, with_plugins)
    if pin and recipe != pin_plugins(DEFAULT_RECIPE):
        fail("--pin ships the default recipe's build only: drop --seed, --steps, --skill, --with-code and --with-plugins")
    cached = is_built(cached_path(recipe)) and not force
    shipped = not cached and not force and pinned_build(recipe) is not None
    start = time.monotonic()
    if not cached and not shipped and not json_out:
        err_console.print(f"building the nano base model (recipe {recipe.hash()[:12]}, skills {', '.join(recipe.skills)}, "
                          f"{recipe.steps} warm-up steps)", highlight=False)
    path = build_with_progress(out, recipe, force)
    info = build_info(path)
    if pin:
        pin_build(cached_path(recipe))
    plugins = recipe.as_dict().get("plugins")
    # cached: it was in the cache already; shipped: the cache was filled from the package's build, not trained here
    result = {"path": str(path), "cached": cached, "shipped": shipped, "seconds": round(time.monotonic() - start, 2),
              "skills": list(recipe.skills), **({"plugins": plugins} if plugins else {}),
              **{k: info[k] for k in ("recipe_hash", "weights_hash", "parameters", "steps", "final_loss",
                                      "validation_accuracy", "build_seconds")},
              # by kind of task, for skills with more than one (absent from builds made before kinds existed)
              **({"validation_by_kind": info["validation_by_kind"]} if info.get("validation_by_kind") else {}),
              # the float kernels it was trained on (absent from builds made before they were pinned)
              **({"kernels": info["kernels"]} if info.get("kernels") else {})}
    if json_out:
        print_json(result)
        return
    console.print(table(None, ["field", "value"], [[k, v] for k, v in result.items()]))
