"""What every command shares: the rich console, --json output, option types and error reporting."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
KeyOpt = Annotated[
    Path | None,
    typer.Option("--key", help="Ed25519 key file (default: SKILLSWARM_KEY or the user config dir).", show_default=False),
]


def print_json(obj: Any) -> None:
    """Print machine-readable output on stdout, nothing else."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_error(message: str) -> None:
    """One error line on stderr. The message is printed as text, never as rich markup: errors quote
    user input and peers' addresses (`[/ip4/...]`), which markup would misread or crash on."""
    err_console.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False)


def fail(message: str, code: int = 1) -> None:
    """Report a user-facing error and exit."""
    print_error(message)
    raise typer.Exit(code)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Table:
    """A rich table with the project's look."""
    t = Table(title=title, header_style="bold cyan", title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t
