"""`skillswarm sandbox ...`: run a program the way the `python` tool runs model code, and check that the
sandbox works on this machine."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.panel import Panel

from skillswarm.node.cli.common import JsonOpt, console, fail, print_json, table

app = typer.Typer(help="Run programs in the python tool's sandbox; check the sandbox on this machine.", no_args_is_help=True)

# What `check` runs inside: how the sandbox looks from the inside, every probe answered by the kernel.
_PROBE = r'''
import json, os, socket, sys
def attempt(fn):
    try:
        fn()
        return "allowed"
    except OSError as e:
        return f"denied ({e.strerror})"
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(json.dumps({
    "uid": os.getuid(), "pid": os.getpid(), "hostname": socket.gethostname(), "cwd": os.getcwd(),
    "root": sorted(os.listdir("/")), "env": sorted(os.environ),
    "proc_mounted": os.path.exists("/proc/self"), "fork": attempt(fork),
    "inet_socket": attempt(lambda: socket.socket(socket.AF_INET).close()),
    "write_outside_workdir": attempt(lambda: open("/escape", "w").close()),
    "python": sys.version.split()[0],
}))
'''


def _read_program(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"{file} does not exist")
    except IsADirectoryError:
        fail(f"{file} is a directory; give a Python file")
    except UnicodeDecodeError:
        fail(f"{file} is not UTF-8 text; give a Python source file")
    except OSError as e:
        fail(f"cannot read {file}: {e.strerror}")
    raise AssertionError("unreachable")


@app.command("run")
def run_cmd(
    file: Annotated[Path, typer.Argument(help="The Python program to run.", show_default=False)],
    timeout: Annotated[float, typer.Option(help="Wall-clock limit in seconds (the tool's default: 5).", min=0.1,
                                           max=3600)] = 5.0,
    json_out: JsonOpt = False,
) -> None:
    """Run FILE in the sandbox exactly as the `python` tool would (same limits but the wall clock); print
    whether it ran ok, its stdout and stderr (capped) and the limit that killed it, if one did.
    Exit code: 0 when it ran ok, 3 when it failed or was killed."""
    from skillswarm.skills.sandbox import SandboxLimits, run_python

    limits = replace(SandboxLimits(), wall_seconds=timeout)
    result = run_python(_read_program(file), limits)
    if json_out:
        print_json({**result.as_dict(), "limits": asdict(limits)})
    else:
        status = "[green]ok[/]" if result.ok else "[red]failed[/]"
        console.print(table(None, ["ok", "killed", "exit code", "seconds", "stdout truncated"], [
            [status, result.killed or "-", result.returncode, f"{result.seconds:.3f}", "yes" if result.truncated else "no"]]))
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                console.print(Panel(escape(text.rstrip("\n")), title=name, title_align="left", expand=False))
    if not result.ok:
        raise typer.Exit(3)


@app.command("check")
def check_cmd(json_out: JsonOpt = False) -> None:
    """Start one sandbox and report what it sees and what the kernel denies it (exit code 1 when the
    sandbox cannot start here, with what to install or enable)."""
    import json

    from skillswarm.skills.sandbox import SandboxLimits, run_python, runtime_view
    from skillswarm.skills.sandbox.bwrap import bwrap_path, bwrap_version
    from skillswarm.skills.sandbox.seccomp import machine

    result = run_python(_PROBE, SandboxLimits(wall_seconds=30.0))
    if not result.ok:
        fail(f"the sandbox started but its probe failed: {result.killed or result.stderr.strip()[-300:]}")
    inside: dict[str, Any] = json.loads(result.stdout)
    info = {"bwrap": bwrap_path(), "bwrap_version": bwrap_version(), "seccomp_arch": machine(),
            "view": runtime_view().as_dict(), "inside": inside, "start_seconds": round(result.seconds, 4)}
    if json_out:
        print_json(info)
        return
    console.print(f"sandbox ok: {escape(info['bwrap_version'])} ({escape(info['bwrap'])}), seccomp filter for "
                  f"{info['seccomp_arch']}, one run in {result.seconds * 1000:.0f} ms", highlight=False)
    view = info["view"]
    console.print(table("what the sandbox sees of the host (read-only)", ["kind", "path"],
                        [*[["dir", d] for d in view["dirs"]],
                         *[["file", f] for f in view["files"]], *[["symlink", f"{lnk} -> {t}"] for t, lnk in view["symlinks"]],
                         *[["hidden (empty)", d] for d in view["hidden"]]]))
    console.print(table("inside", ["probe", "result"], [[k, escape(str(v))] for k, v in inside.items()]))
