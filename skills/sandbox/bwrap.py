"""The bubblewrap command line that confines one run, and the error that says how to make it work.

bubblewrap (`bwrap`) is the unprivileged sandbox Flatpak is built on: small, audited, packaged by every
distribution, and it needs no daemon and no root. Each run gets new user, mount, pid, network, ipc, uts
and cgroup namespaces; a root filesystem that is an empty read-only tmpfs holding only the runtime view
(`view.py`), a minimal read-only /dev and a size-capped tmpfs work dir (`--size N --tmpfs`; where it
can, the launcher of `launch.py` binds a tmpfs it mounted with an inode cap too in its place); no
capabilities (`--cap-drop ALL`, which matters when the caller is root); no further user namespaces
(`--disable-userns` from bubblewrap 0.8; the seccomp filter refuses them anyway); a new session (no terminal to inject keystrokes into); the seccomp filter
(`seccomp.py`); and death with its parent. Inside, the program runs as uid/gid 65534 with an empty
environment but for LANG, HOME, TMPDIR and PATH.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from skillswarm.skills.sandbox.view import RuntimeView, SandboxError

MIN_VERSION = (0, 7, 0)
WORKDIR = "/sandbox"
SANDBOX_UID = 65534
ENV = {"LANG": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": WORKDIR, "PATH": "/usr/bin:/bin"}

INSTALL_HINT = ("install bubblewrap: `sudo apt-get install bubblewrap` (Debian, Ubuntu), `sudo dnf install bubblewrap` "
                "(Fedora, RHEL), `sudo pacman -S bubblewrap` (Arch) or `apk add bubblewrap` (Alpine); "
                "`make install` does it on Debian and Ubuntu when run as root")
USERNS_HINT = ("bubblewrap could not create its namespaces. Unprivileged user namespaces must be enabled: "
               "`sudo sysctl -w kernel.unprivileged_userns_clone=1` (older Debian) or `sudo sysctl -w "
               "user.max_user_namespaces=15000`; on Ubuntu 23.10+ install bubblewrap from apt (it ships the "
               "AppArmor profile that allows it); inside Docker run the container with `--security-opt "
               "seccomp=unconfined --security-opt apparmor=unconfined` (or run the node outside it)")


@functools.lru_cache(maxsize=None)
def bwrap_path() -> str:
    """The bwrap binary (`SKILLSWARM_BWRAP` overrides the PATH lookup); a clear error when it is missing."""
    path = os.environ.get("SKILLSWARM_BWRAP") or shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)
    if not path or not os.access(path, os.X_OK):
        raise SandboxError(f"the python sandbox needs bubblewrap (bwrap), which is not installed; {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=None)
def bwrap_version() -> str:
    """`bwrap --version`, e.g. `bubblewrap 0.8.0`."""
    try:
        out = subprocess.run([bwrap_path(), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        raise SandboxError(f"cannot run {bwrap_path()}: {e.strerror}; {INSTALL_HINT}") from e
    return (out.stdout or out.stderr).strip()


def version_tuple() -> tuple[int, ...]:
    """bwrap's version as numbers; a clear error below 0.7 (the first with a size-capped tmpfs, `--size`)."""
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", bwrap_version())
    version = tuple(int(x or 0) for x in found.groups()) if found else (0, 0, 0)
    if version < MIN_VERSION:
        raise SandboxError(f"{bwrap_path()} is bubblewrap {'.'.join(map(str, version))}; the sandbox needs 0.7 or newer "
                           "(Debian 12, Ubuntu 23.04, Fedora 37 and later ship one); install a newer bubblewrap")
    return version


def command(view: RuntimeView, argv: list[str], *, code_fd: int, info_fd: int, disk_bytes: int,
            seccomp_fd: int | None) -> list[str]:
    """The bwrap command that runs `argv` (the interpreter first) in a fresh sandbox; `code_fd` is
    copied to WORKDIR/main.py, `info_fd` receives bwrap's JSON with the sandbox init's pid."""
    cmd = [bwrap_path(), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
           "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
           "--clearenv", "--info-fd", str(info_fd)]
    if version_tuple() >= (0, 8):  # the seccomp filter refuses new user namespaces too; this is a second lock
        cmd.append("--disable-userns")
    for key, value in ENV.items():
        cmd += ["--setenv", key, value]
    for d in view.dirs:
        cmd += ["--ro-bind", d, d]
    for f in view.files:
        cmd += ["--ro-bind", f, f]
    for target, link in view.symlinks:
        cmd += ["--symlink", target, link]
    for d in view.hidden:
        cmd += ["--tmpfs", d, "--remount-ro", d]
    cmd += ["--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(disk_bytes), "--tmpfs", WORKDIR, "--file", str(code_fd), f"{WORKDIR}/main.py",
            "--chdir", WORKDIR, "--remount-ro", "/"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    return cmd + ["--", *argv]


def explain_failure(stderr: str) -> str:
    """The message for a sandbox that did not start: what bwrap said, and what to do about it."""
    said = " ".join(line.strip() for line in stderr.strip().splitlines()[-3:]) or "no message"
    hint = USERNS_HINT if any(s in stderr for s in ("namespace", "uid map", "Operation not permitted", "setting up"))\
        else "check that the Python runtime's files are readable, or run `skillswarm sandbox check`"
    return f"the python sandbox did not start (bwrap: {said}); {hint}"
