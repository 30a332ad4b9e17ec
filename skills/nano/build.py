"""Build the nano base model, or reuse the one cached for the same recipe.

The result is a Hugging Face directory (config.json, generation_config.json, model.safetensors,
tokenizer files with the chat template, and `nano_recipe.json`, written last as the completeness
marker) that loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`.
Built models are cached under `<cache dir>/base/nano-<recipe hash>`. The training runs in a process of
its own on pinned float kernels (`build_process`, `kernels`), so a recipe builds the same weights on one CPU
whatever the environment asks for; across CPU models it does not (CI's CPU built the pinned test recipe as
023d8b86..., an AMD EPYC and an Intel Xeon as 6568cae7...). So the default recipe's build ships with the
package (`pinned/`, every file checked against `pinned.json` before use) and fills the cache in place of a
local build: every machine's default base, and so every demo and every network on it, starts from one model.
`force` still trains it here.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import ModelError
from skillswarm.protocol.hashing import sha256_file
from skillswarm.protocol.paths import cache_dir
from skillswarm.skills.nano.build_process import run_build
from skillswarm.skills.nano.recipe import DEFAULT_RECIPE, NanoRecipe, pin_plugins
from skillswarm.skills.nano.warmup import Progress

log = logging.getLogger(__name__)
MARKER = "nano_recipe.json"
PINNED_DIR = Path(__file__).with_name("pinned")  # the default recipe's build, shipped with the package
PINNED_MANIFEST = "pinned.json"  # in PINNED_DIR: {"recipe_hash", "files": {name: sha256}}; not copied out


def cached_path(recipe: NanoRecipe = DEFAULT_RECIPE) -> Path:
    """Where the model of `recipe` lives in the cache."""
    return cache_dir() / "base" / f"nano-{recipe.hash()[:16]}"


def default_model_dir(seed: int | None = None) -> Path:
    """The cached default nano model's directory, of `seed` (default: the recipe's) (it may not be built yet;
    see `build_base`)."""
    return cached_path(DEFAULT_RECIPE if seed is None else DEFAULT_RECIPE.with_(seed=seed))


def is_built(path: Path) -> bool:
    """Whether `path` holds a complete nano model build."""
    return (path / MARKER).is_file()


def build_info(path: Path) -> dict[str, object]:
    """The build record of a nano model directory (recipe, hash, parameters, loss, seconds)."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path} is not a complete nano model build ({e}); rebuild it with `skillswarm base build`") from e


def _install(tmp: Path, target: Path) -> None:
    """Move a finished directory into place (a rename on the same filesystem: all or nothing)."""
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not is_built(out) and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ModelError(f"{out} exists and is not a nano model build; pick another --out (or pass --force)")


def pinned_build(recipe: NanoRecipe, pinned: Path | None = None) -> Path | None:
    """The shipped build of `recipe` (in `pinned`, default PINNED_DIR), when there is one, else None."""
    pinned = PINNED_DIR if pinned is None else pinned
    try:
        manifest = json.loads((pinned / PINNED_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return pinned if manifest.get("recipe_hash") == recipe.hash() else None


def pin_build(source: Path, pinned: Path | None = None) -> Path:
    """Make `source` (a complete build) the shipped one: copy its files into `pinned` (default PINNED_DIR) and
    record their hashes (`skillswarm base build --force --pin`, after a recipe change)."""
    pinned = PINNED_DIR if pinned is None else pinned
    info = build_info(source)
    files = sorted(p.name for p in source.iterdir() if p.is_file() and p.name != PINNED_MANIFEST)
    tmp = Path(tempfile.mkdtemp(prefix=".nano-pin-", dir=pinned.parent))
    try:
        for name in files:
            shutil.copy2(source / name, tmp / name)
        manifest = {"recipe_hash": info["recipe_hash"], "files": {n: sha256_file(tmp / n) for n in files}}
        atomic_write_text(tmp / PINNED_MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _install(tmp, pinned)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pinned


def _install_pinned(pinned: Path, target: Path) -> None:
    """Copy the shipped build into `target`, every file checked against its recorded hash first."""
    manifest = json.loads((pinned / PINNED_MANIFEST).read_text())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".nano-pinned-", dir=target.parent))
    try:
        for name, digest in sorted(manifest["files"].items()):
            shutil.copy2(pinned / name, tmp / name)
            if sha256_file(tmp / name) != digest:
                raise ModelError(f"the nano base shipped in {pinned} is damaged ({name} does not match its hash in "
                                 f"{PINNED_MANIFEST}): reinstall skillswarm, or train it here with "
                                 "`skillswarm base build --force`")
        if not is_built(tmp):
            raise ModelError(f"the nano base shipped in {pinned} has no {MARKER}: reinstall skillswarm")
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("installed the shipped nano model into %s (its files match %s)", target, PINNED_MANIFEST)


def _build_into(target: Path, recipe: NanoRecipe, progress: Progress | None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".nano-build-", dir=target.parent))
    try:
        info = run_build(tmp, recipe, progress)
        atomic_write_text(tmp / MARKER, json.dumps(info, indent=2, sort_keys=True) + "\n")
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built nano model %s in %.1fs (loss %.3f)", target, info["build_seconds"], info["final_loss"])


def build_base(out_dir: Path | None = None, seed: int | None = None, recipe: NanoRecipe | None = None, *, force: bool = False,
               cache: bool = True, progress: Progress | None = None) -> Path:
    """Build the nano base model and return its directory.

    With `cache` (default) the model is built once per recipe into the cache dir and reused; `out_dir`
    then receives a copy. Without it, the model is built straight into `out_dir`. `force` rebuilds
    even when cached. `seed`, when given, overrides the recipe's seed (part of the cache key). Plugin skills are pinned
    to their installed versions first (`pin_plugins`), so another version of a plugin is another build. The
    cache of a recipe the package ships a build of (the default) is filled from that build, unless `force`."""
    recipe = recipe or DEFAULT_RECIPE
    recipe = pin_plugins(recipe if seed is None else recipe.with_(seed=seed))
    out = Path(out_dir).expanduser().resolve() if out_dir is not None else None
    if out is not None:
        _check_out(out, force)
    if not cache:
        if out is None:
            raise ModelError("building without the cache needs an output directory")
        _build_into(out, recipe, progress)
        return out
    source = cached_path(recipe)
    pinned = pinned_build(recipe)
    if not force and not is_built(source) and pinned is not None:
        _install_pinned(pinned, source)
    elif force or not is_built(source):
        _build_into(source, recipe, progress)
    if out is None or out == source.resolve():
        return source
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".nano-copy-", dir=out.parent))
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
