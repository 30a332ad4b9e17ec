"""Record a benchmark's figures: run a command that prints one JSON object (any bench's `--json`, or
`skillswarm demo --json`) and save it under `bench/results/NAME.json` with what reproduces and dates it:
the command, the commit, the machine and the date. `bench/render.py` turns the saved files into
docs/results.md and the README's headline table, so no figure is pasted by hand.

    .venv/bin/python bench/record.py sandbox -- .venv/bin/python bench/sandbox.py --json
    .venv/bin/python bench/record.py poison -- .venv/bin/python bench/poison.py --json

The command's stderr passes through; its stdout must hold one JSON object (the last one printed, when it
prints lines before it). Nothing is saved when the command fails or prints no JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


class RecordError(Exception):
    """A recording that cannot be made, with what to do about it."""


def last_json_object(text: str) -> dict[str, Any]:
    """The last JSON object in a command's stdout: the whole text, or the last line or block that parses."""
    try:
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    found: dict[str, Any] | None = None
    for start in (m.start() for m in re.finditer(r"(?m)^\{", text)):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            found = value
    if found is None:
        raise RecordError("the command printed no JSON object on stdout: give the bench its --json flag")
    return found


def _commit() -> str:
    """HEAD's commit, marked `-dirty` when the work tree differs from it (figures of uncommitted code)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30).stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return head + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, GPU, and the Python and torch builds."""
    info: dict[str, Any] = {"cpu": _cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(),
                            "os": platform.platform(terse=True), "python": platform.python_version()}
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"], info["gpu"] = None, None
    return info


def envelope(name: str, command: list[str], figures: dict[str, Any], seconds: float, commit: str) -> dict[str, Any]:
    """The saved record: the figures with the command, commit, machine, date and wall time that produced them."""
    return {"name": name, "command": shlex.join(command), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": round(seconds, 1), "machine": machine(), "figures": figures}


def save(record: dict[str, Any], out_dir: Path) -> Path:
    """Write `NAME.json` atomically (a temp name, then a rename): an interrupted save leaves the old file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{record['name']}.json"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{record['name']}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def run(name: str, command: list[str], out_dir: Path = RESULTS) -> Path:
    """Run `command`, parse its JSON figures and save them as `out_dir/NAME.json`."""
    import time
    if not NAME.fullmatch(name):
        raise RecordError(f"bad name {name!r}: use lower-case letters, digits, '-' and '_' (like `sandbox`)")
    if not command:
        raise RecordError("no command given: put it after `--`, like `record.py sandbox -- .venv/bin/python bench/sandbox.py --json`")
    commit = _commit()  # the code the command starts with, whatever changes while it runs
    start = time.perf_counter()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    except OSError as e:
        raise RecordError(f"cannot run {command[0]}: {e.strerror or e}") from None
    if done.returncode != 0:
        raise RecordError(f"the command exited {done.returncode}; nothing saved")
    return save(envelope(name, command, last_json_object(done.stdout), time.perf_counter() - start, commit),
                out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the record's name: bench/results/NAME.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that prints one JSON object")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where records go (default bench/results)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        path = run(args.name, command, args.out)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"saved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", file=sys.stderr)


if __name__ == "__main__":
    main()
