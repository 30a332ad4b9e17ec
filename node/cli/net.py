"""`skillswarm net ...`: create and inspect network files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer

from skillswarm.node.cli.common import JsonOpt, KeyOpt, console, fail, print_json, table
from skillswarm.protocol.identity import Identity, fingerprint
from skillswarm.protocol.netspec import load_spec, save_spec
from skillswarm.protocol.records import CODECS, MERGE_METHODS, MergePolicy, NetworkSpec, RoundPolicy

app = typer.Typer(help="Create and inspect networks.", no_args_is_help=True)


def _resolve_base(model: str, revision: str | None) -> str:
    """The state-dict hash of the base model's weights: a local directory, or a hub id (downloaded)."""
    from skillswarm.protocol.hashing import weights_hash

    path = Path(model).expanduser()
    if path.exists():
        try:
            return weights_hash(path)
        except FileNotFoundError as e:
            fail(f"{e}; --model must be a Hugging Face model directory with safetensors weights")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"])
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        fail(f"--model {model!r} is not a local directory and could not be fetched from the hub ({type(e).__name__}); "
             "pass a local path (e.g. one made by `skillswarm base build`)")
    return weights_hash(local)


@app.command("init")
def init(
    name: Annotated[str, typer.Option(help="Network name (lower-case letters, digits, . _ -).")],
    model: Annotated[str, typer.Option(help="Base model: a local HF directory or a hub id.")],
    skill: Annotated[list[str], typer.Option(help="A skill shard; repeat for each.")],
    out: Annotated[Path, typer.Option(help="Where to write the network file.")] = Path("network.toml"),
    coordinator: Annotated[Optional[list[str]], typer.Option(help="Trusted coordinator public key (hex); repeatable. Default: yours.")] = None,
    bootstrap: Annotated[Optional[list[str]], typer.Option(help="Bootstrap peer multiaddr; repeatable.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of the base model.")] = None,
    description: Annotated[str, typer.Option(help="One line about the network.")] = "",
    method: Annotated[str, typer.Option(help=f"Merge method: {', '.join(MERGE_METHODS)}.")] = "ties",
    density: Annotated[float, typer.Option(help="Fraction of each delta kept by ties/dare/breadcrumbs.")] = 0.2,
    scale: Annotated[float, typer.Option("--lambda", help="Scale of the merged task vector.")] = 1.0,
    codec: Annotated[str, typer.Option(help=f"Delta codec workers publish: {', '.join(CODECS)}.")] = "dense_bf16",
    steps_per_round: Annotated[int, typer.Option(help="Training steps per round.")] = 20,
    min_deltas: Annotated[int, typer.Option(help="Deltas a coordinator waits for before merging.")] = 1,
    max_wait: Annotated[float, typer.Option(help="Seconds a round waits at most.")] = 900.0,
    key: KeyOpt = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a new network file (the genesis: base model and its hash, skills, trusted coordinators, policy)."""
    if out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite it")
    ident = Identity.load_or_create(key)
    base_hash = _resolve_base(model, revision)
    try:
        spec = msgspec.convert(
            {
                "kind": "network", "network": name, "description": description, "base_model": model,
                "base_revision": revision, "base_hash": base_hash, "skills": skill,
                "coordinators": coordinator or [ident.public_key_hex], "bootstrap": bootstrap or [], "codec": codec,
                "round": msgspec.to_builtins(RoundPolicy(steps_per_round=steps_per_round, min_deltas=min_deltas, max_wait_s=max_wait)),
                "merge": {**msgspec.to_builtins(MergePolicy()), "method": method, "density": density, "lambda": scale},
            },
            NetworkSpec,
        )
    except (msgspec.ValidationError, ValueError) as e:
        fail(f"invalid network settings: {e}")
    save_spec(ident.sign_record(spec), out)
    console.print(f"wrote [bold]{out}[/] for network [bold]{name}[/] (base {base_hash[:12]}, {len(skill)} skills)")


@app.command("show")
def show(path: Annotated[Path, typer.Argument(help="Network file.")] = Path("network.toml"), json: JsonOpt = False) -> None:
    """Validate a network file and print what it says."""
    spec = load_spec(path)
    if json:
        print_json(msgspec.to_builtins(spec) | {"signature": spec.signature.hex()})
        return
    rows = [
        ["name", spec.network], ["base model", spec.base_model], ["base hash", spec.base_hash],
        ["skills", ", ".join(spec.skills)],
        ["coordinators", ", ".join(fingerprint(k) for k in spec.coordinators) or "(none: no checkpoint can be trusted)"],
        ["bootstrap", "\n".join(spec.bootstrap) or "(none)"], ["codec", spec.codec],
        ["round", f"{spec.round.steps_per_round} steps, >= {spec.round.min_deltas} deltas, <= {spec.round.max_wait_s:g} s"],
        ["merge", f"{spec.merge.method} (density {spec.merge.density:g}, lambda {spec.merge.scale:g}, "
                  f"within a skill: {spec.merge.aggregator})"],
        ["signed by", fingerprint(spec.author) if spec.signature else "(unsigned)"],
    ]
    console.print(table(f"network {spec.network}", ["field", "value"], rows))
