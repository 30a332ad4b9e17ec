"""Options shared by the commands that join a network as a long-running node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

NetworkOpt = Annotated[Path, typer.Option("--network", help="Network file (from `skillswarm net init`).")]
PeersOpt = Annotated[Optional[list[str]], typer.Option(
    "--peers", help="Multiaddr of a running peer (…/p2p/<peer id>); repeatable. Default: the network file's bootstrap.")]
HostOpt = Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface; 127.0.0.1: this machine only).")]
PortOpt = Annotated[int, typer.Option(help="TCP port to listen on (0: any free port).")]
AnnounceOpt = Annotated[Optional[list[str]], typer.Option(
    "--announce", help="Public multiaddr others should dial (behind NAT with a forwarded port); repeatable.")]
AutoRelayOpt = Annotated[bool, typer.Option("--auto-relay", help="Behind NAT without a forwarded port: reachable through relays.")]
