"""`skillswarm pull`: fetch a checkpoint as a Hugging Face directory (verified), with its manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, fail, print_json
from skillswarm.node.cli.swarm_opts import NetworkOpt, PeersOpt


def pull_cmd(
    network: NetworkOpt,
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint to.")],
    version: Annotated[Optional[int], typer.Option(help="Version to pull (default: the latest).")] = None,
    peers: PeersOpt = None,
    adapter: Annotated[bool, typer.Option("--adapter", help="Write a PEFT LoRA adapter on the network's base model "
                                          "instead of full weights: the rank-R SVD of the checkpoint's change to each "
                                          "linear layer (exact when that change has rank <= R, as after merging LoRA "
                                          "deltas whose ranks sum to <= R; else the nearest rank-R change, its error "
                                          "printed); norms and embeddings stay the base's. Load it with "
                                          "PeftModel.from_pretrained(base_model, OUT).")] = False,
    rank: Annotated[Optional[int], typer.Option(help="--adapter: the LoRA rank R (default: the lora codec's).",
                                                min=1)] = None,
    json: JsonOpt = False,
) -> None:
    """Pull a checkpoint signed by a trusted coordinator into OUT (config, tokenizer, safetensors, plus
    manifest.msgpack (signed) and manifest.json); every file is verified by hash. With --adapter, OUT is a
    PEFT adapter directory instead (adapter_config.json, adapter_model.safetensors, manifest.msgpack).
    OUT must be new, empty, or an earlier pull, which is replaced (pull never deletes what it did not write)."""
    from skillswarm.merge.codecs import DEFAULT_PARAMS
    from skillswarm.node.checkpoints.pull import check_out, export, find_checkpoint, pull, share, write_out
    from skillswarm.node.network.session import open_session
    from skillswarm.protocol.errors import SkillswarmError

    if rank is not None and not adapter:
        fail("--rank is the rank of an adapter; add --adapter")
    try:
        check_out(out)  # before fetching anything: refused now, not after a long download
    except SkillswarmError as e:
        fail(str(e))
    rank = rank or int(DEFAULT_PARAMS["lora"]["rank"])
    info = None

    # not a client: while it runs, a pull serves what it holds (pieces as they arrive, then whole files), so pulls
    # that run at the same time fetch from each other and not all from the coordinator
    with open_session(network, peers=peers, host="0.0.0.0", ephemeral_key=True) as s:
        manifest = find_checkpoint(s.dht, s.spec, version)
        if manifest is None:
            which = "checkpoint" if version is None else f"checkpoint v{version}"
            fail(f"no {which} signed by a trusted coordinator of {s.spec.network} was found: has a coordinator published "
                 "one yet? (`skillswarm net checkpoints` lists what is on the network)")
        pull(s.dht, s.spec, manifest, s.store, s.blobs, progress=not json)
        share(s.dht, s.store, s.blobs, manifest)
        if not adapter:
            export(s.store, manifest.version, out)
        else:
            from skillswarm.node.rl.adapter import export_checkpoint_adapter

            if manifest.version == 0:
                fail("v0 is the base model itself; an adapter on it would be empty (pull a later version)")
            genesis = find_checkpoint(s.dht, s.spec, 0)
            if genesis is None:
                fail(f"the genesis checkpoint (the base model) of {s.spec.network} was not found; an adapter needs it")
            pull(s.dht, s.spec, genesis, s.store, s.blobs, progress=not json)
            share(s.dht, s.store, s.blobs, genesis)
            made = []
            write_out(out, lambda new: made.append(export_checkpoint_adapter(
                s.store, s.spec, manifest.version, new, rank, progress=not json)), version=manifest.version)
            info = made[0]
    if json:
        data = {"version": manifest.version, "weights_hash": manifest.weights_hash, "out": str(out),
                "files": [f.path for f in manifest.files]}
        if info is not None:
            data |= {"files": ["adapter_config.json", "adapter_model.safetensors", "manifest.msgpack"],
                     "adapter": {"rank": rank, "base_model": s.spec.base_model, "size": info.size,
                                 "rel_error": info.error}}
        print_json(data)
    elif info is not None:
        console.print(f"pulled checkpoint v{manifest.version} ({manifest.weights_hash[:12]}) as a rank-{rank} PEFT "
                      f"adapter on {s.spec.base_model} into [bold]{out}[/] ({info.size:,} bytes, relative error "
                      f"{info.error:.3g})", highlight=False)
    else:
        console.print(f"pulled checkpoint v{manifest.version} ({manifest.weights_hash[:12]}) into [bold]{out}[/]")
