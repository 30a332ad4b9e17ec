"""The `skillswarm` entry point: global options, logging, and the command groups that exist."""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, Optional

import typer
from rich.logging import RichHandler

from skillswarm.node.cli import (
    base_cmd,
    coordinator_cmd,
    demo_cmd,
    endpoint_cmd,
    eval_cmd,
    id_cmd,
    merge_cmd,
    net_cmd,
    net_inspect_cmd,
    node_cmd,
    pull_cmd,
    report_cmd,
    sandbox_cmd,
    skills_cmd,
    train_cmd,
)
from skillswarm.node.cli.common import console, err_console, print_error
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.version import PROTOCOL_VERSION, __version__

app = typer.Typer(
    name="skillswarm",
    help="Grow one generalist language model out of many RL specialists, over a peer-to-peer network.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
net_inspect_cmd.register(net_cmd.app)
app.add_typer(net_cmd.app, name="net")
app.add_typer(merge_cmd.app, name="merge")
app.command("id")(id_cmd.show_identity)
app.add_typer(skills_cmd.app, name="skills")
app.add_typer(base_cmd.app, name="base")
app.command("eval")(eval_cmd.eval_cmd)
app.add_typer(node_cmd.app, name="node")
app.add_typer(coordinator_cmd.app, name="coordinator")
app.command("pull")(pull_cmd.pull_cmd)
app.command("demo")(demo_cmd.demo_cmd)
app.command("train")(train_cmd.train_cmd)
app.command("report")(report_cmd.report_cmd)
app.add_typer(sandbox_cmd.app, name="sandbox")
app.add_typer(endpoint_cmd.app, name="endpoint")
app.command("ingest")(endpoint_cmd.ingest_cmd)


def _version(value: bool) -> None:
    if value:
        console.print(f"skillswarm {__version__} (protocol {PROTOCOL_VERSION})", highlight=False)
        raise typer.Exit()


def setup_logging(verbosity: int) -> None:
    """-q: warnings only; default: info; -v: debug for skillswarm; -vv: debug for hivemind too."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    handler = RichHandler(console=err_console, show_path=verbosity > 0, rich_tracebacks=True)
    logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s", force=True)
    logging.getLogger("skillswarm").setLevel(level)
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbosity > 1 else logging.WARNING)


@app.callback()
def main_options(
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="More logging (-vv: network too).")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Warnings and errors only.")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """Global options."""
    setup_logging(-1 if quiet else verbose)


def quiet_flags(command: Any) -> Any:
    """Draw on/off flags in --help as `--json`, not `--json <bool>` (typer's rich help shows every option's type,
    which for a flag reads as if it took a value); `command` is typer's click command, walked with its subcommands."""
    for param in command.params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    help_option = command.get_help_option

    def quiet_help_option(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = quiet_help_option
    for sub in getattr(command, "commands", {}).values():
        quiet_flags(sub)
    return command


def main() -> None:
    """Console-script entry point: run the app, turning our errors into clean messages."""
    # Our commands show their own (rich) progress; Hugging Face's tqdm bars (e.g. "Writing model shards"
    # on every save) would only interleave with it. The variable is read when transformers is imported.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        quiet_flags(typer.main.get_command(app))()
    except SkillswarmError as e:
        print_error(str(e))
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print_error("interrupted")
        raise SystemExit(130) from None
    except Exception as e:  # a bug or an unforeseen input: one line, the traceback only when asked for
        if logging.getLogger("skillswarm").isEnabledFor(logging.DEBUG):
            err_console.print_exception()
        else:
            print_error(f"unexpected {type(e).__name__}: {e} (run with -v for the traceback)")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
