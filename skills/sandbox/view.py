"""What a sandbox sees of the host: the Python runtime, read-only, and nothing else.

The view is the interpreter binary, its standard library (with any site-packages inside it hidden),
and the directories of the shared libraries the interpreter and its extension modules link against
(found with `ldd`), each at its host path. Host symlinks on the way to them (`/lib -> usr/lib` on
merged-/usr systems) are recreated so the dynamic loader finds what it looks for. No home, no project,
no virtualenv, no cache (so no keys and no model weights), no /etc beyond the loader's cache.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from skillswarm.protocol.errors import SkillswarmError


class SandboxError(SkillswarmError):
    """The sandbox cannot run on this machine (bubblewrap missing, namespaces disabled, runtime not found)."""


@dataclass(frozen=True)
class RuntimeView:
    """The host paths a sandbox gets, all read-only and at their host paths.

    `interpreter`: the real Python binary; `dirs`: directories bound whole; `files`: single files bound;
    `symlinks`: (target, link) pairs recreating host symlinks; `hidden`: directories inside `dirs` that
    are covered by an empty read-only tmpfs (the base interpreter's site-packages)."""

    interpreter: str
    dirs: tuple[str, ...]
    files: tuple[str, ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()
    hidden: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, object]:
        return {"interpreter": self.interpreter, "dirs": list(self.dirs), "files": list(self.files),
                "symlinks": [list(s) for s in self.symlinks], "hidden": list(self.hidden)}


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def shared_libraries(binaries: list[str]) -> list[str]:
    """The shared libraries (and the ELF interpreter) `binaries` load, as `ldd` resolves them."""
    try:
        out = subprocess.run(["ldd", *binaries], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}).stdout
    except FileNotFoundError as e:
        raise SandboxError("the sandbox needs `ldd` (package libc-bin on Debian/Ubuntu, glibc elsewhere) to find "
                           "the Python runtime's shared libraries") from e
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" (", 1)[0]
        elif line.startswith("/") and " (0x" in line:  # the ELF interpreter: /lib64/ld-linux-x86-64.so.2 (0x...)
            target = line.split(" (", 1)[0]
        else:
            continue
        if target.startswith("/"):
            libs.append(target)
    return sorted(set(libs))


class _Builder:
    """Collects directories to bind and the host symlinks that lead to them."""

    def __init__(self) -> None:
        self.dirs: set[str] = set()
        self.symlinks: dict[str, str] = {}

    def walk(self, path: str, depth: int = 0) -> str:
        """Record each symlink met on the way to `path` (and on the way to its targets); return its real path."""
        current = "/"
        for part in Path(path).parts[1:]:
            step = os.path.join(current, part)
            if os.path.islink(step) and depth < 40:
                self.symlinks[step] = os.readlink(step)
                current = self.walk(os.path.join(current, self.symlinks[step]), depth + 1)
            else:
                current = os.path.normpath(step)
        return os.path.realpath(current)

    def add_dir(self, path: str) -> None:
        """Bind `path` at its real location, reachable through the same symlinks as on the host."""
        self.dirs.add(self.walk(path))

    def add_file(self, path: str) -> None:
        """Make `path` reachable: bind its directory, following the symlinks of the file itself."""
        seen = 0
        while True:
            self.add_dir(os.path.dirname(path))
            if not os.path.islink(path) or seen > 40:
                break
            link = os.path.join(os.path.realpath(os.path.dirname(path)), os.readlink(path))
            path, seen = os.path.normpath(link), seen + 1


@functools.lru_cache(maxsize=None)
def runtime_view() -> RuntimeView:
    """The view of this interpreter's runtime (computed once per process)."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not os.path.isfile(interpreter):
        raise SandboxError(f"cannot find the Python interpreter binary ({interpreter}) to run in the sandbox")
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
            "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    dynload = sysconfig.get_config_var("DESTSHARED") or os.path.join(paths["platstdlib"], "lib-dynload")
    stdlib = {os.path.realpath(p) for p in (paths["stdlib"], paths["platstdlib"], dynload) if p and os.path.isdir(p)}
    if not stdlib:
        raise SandboxError(f"cannot find the standard library of {interpreter}")
    builder = _Builder()
    for d in sorted(stdlib):
        builder.add_dir(d)
    for lib in shared_libraries([interpreter, *sorted(glob.glob(os.path.join(dynload, "*.so")))]):
        builder.add_file(lib)
    dirs = sorted(builder.dirs)
    dirs = tuple(d for d in dirs if not any(d != o and _inside(d, o) for o in dirs))  # a parent binds its children
    files = [interpreter] if not any(_inside(interpreter, d) for d in dirs) else []
    if os.path.isfile("/etc/ld.so.cache"):
        files.append("/etc/ld.so.cache")  # where the loader looks first; lists library paths, nothing else
    site = set()
    for scheme in {sysconfig.get_default_scheme(), "posix_prefix"}:
        site |= {sysconfig.get_paths(scheme, vars=base)[k] for k in ("purelib", "platlib")}
    site |= {os.path.join(p, name) for p in stdlib for name in ("site-packages", "dist-packages")}
    hidden = tuple(sorted({os.path.realpath(p) for p in site if os.path.isdir(p)
                           and any(_inside(os.path.realpath(p), d) for d in dirs)}))
    # a symlink inside a bound directory is there already (and its mount is read-only)
    symlinks = tuple(sorted((target, link) for link, target in builder.symlinks.items()
                            if not any(_inside(link, d) for d in dirs)))
    return RuntimeView(interpreter, dirs, tuple(files), symlinks, hidden)
