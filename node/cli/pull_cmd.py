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
    json: JsonOpt = False,
) -> None:
    """Pull a checkpoint signed by a trusted coordinator into OUT (config, tokenizer, safetensors, plus
    manifest.msgpack (signed) and manifest.json); every file is verified by hash."""
    from skillswarm.node.pull import export, find_checkpoint, pull
    from skillswarm.node.session import open_session

    with open_session(network, peers=peers, host="0.0.0.0", client_mode=True, ephemeral_key=True) as s:
        manifest = find_checkpoint(s.dht, s.spec, version)
        if manifest is None:
            which = "any checkpoint" if version is None else f"checkpoint v{version}"
            fail(f"no {which} signed by a trusted coordinator of {s.spec.network} was found")
        pull(s.dht, s.spec, manifest, s.store, s.blobs, progress=not json)
        export(s.store, manifest.version, out)
    if json:
        print_json({"version": manifest.version, "weights_hash": manifest.weights_hash, "out": str(out),
                    "files": [f.path for f in manifest.files]})
    else:
        console.print(f"pulled checkpoint v{manifest.version} ({manifest.weights_hash[:12]}) into [bold]{out}[/]")
