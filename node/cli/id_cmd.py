"""`skillswarm id`: this node's identity (created on first use)."""

from __future__ import annotations

from skillswarm.node.cli.common import JsonOpt, KeyOpt, console, print_json, table
from skillswarm.protocol.identity import Identity, fingerprint


def show_identity(key: KeyOpt = None, json: JsonOpt = False) -> None:
    """Show this node's public key and peer id, creating its key file (0600) on first use."""
    ident = Identity.load_or_create(key)
    info = {
        "public_key": ident.public_key_hex,
        "peer_id": ident.peer_id,
        "fingerprint": fingerprint(ident.public_key_hex),
        "key_file": str(ident.path),
    }
    if json:
        print_json(info)
        return
    console.print(table("identity", ["field", "value"], [[k, v] for k, v in info.items()]))
    console.print("Give [bold]public_key[/] to a network's creator to be trusted as a coordinator.")
