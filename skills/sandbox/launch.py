"""How bubblewrap is started: the bounds on the kernel's side that bwrap's own options cannot set.

A run is started through a short launcher (the host's Python, isolated: `-I -S`) that, before it
replaces itself with bwrap (same pid, same descriptors):

- joins the run's own pids cgroup, whose `pids.max` bounds its tasks (threads included) even when the
  node runs as root, for whom the kernel does not enforce RLIMIT_NPROC. The cgroup is a child of the
  node's own cgroup in the hierarchy that has the pids controller (cgroup v1 or v2), made per run and
  removed after it; where no such hierarchy is writable (not root, or a container without one), there
  is none, and RLIMIT_NPROC (a non-root caller) or RLIMIT_AS (root: every thread's stack counts) bounds
  threads.
- mounts the work dir's tmpfs itself, in a mount namespace of its own (private: nothing reaches the
  host's), with `nr_inodes` as well as `size` (bwrap's --tmpfs takes a size only): a run's files,
  directories, symlinks and hard links are bounded, not only their bytes; tmpfs inodes and dentries are
  kernel memory that cannot be reclaimed while they exist. bwrap then binds it on the work dir. Root
  makes the mount namespace directly; another user makes a user namespace too, where this machine
  allows one (probed once per process); elsewhere the work dir is bwrap's size-only tmpfs.

When neither applies the launcher is skipped and bwrap is started directly, as before.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_NAME = "skillswarm-sandbox"  # the node's cgroup's child that holds one cgroup per run
_lock = threading.Lock()

# Runs on the host, as the node's user, before bwrap: argv = procs mode mountpoint options workdir -- bwrap...
# `procs`: the run's cgroup.procs ("" for none); `mode`: "ns" (root: a new mount namespace), "userns" (also
# a new user namespace) or "" (no mount). With no command after "--" it is a probe: exit 0 when it mounted.
LAUNCHER = r'''
import os, sys
procs, mode, mnt, opts, workdir, sep, *cmd = sys.argv[1:]
if procs:
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        sys.stderr.write(f"skillswarm sandbox: cannot join the run's cgroup ({procs}: {e.strerror})\n")
        sys.exit(125)
mounted = False
if mode:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    def check(result):
        if result != 0:
            raise OSError(ctypes.get_errno(), "")
    try:
        if mode == "userns":
            uid, gid = os.getuid(), os.getgid()
            check(libc.unshare(0x10000000 | 0x00020000))  # CLONE_NEWUSER | CLONE_NEWNS
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        else:
            check(libc.unshare(0x00020000))  # CLONE_NEWNS
        check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None))  # MS_REC | MS_PRIVATE: the host sees nothing
        check(libc.mount(b"tmpfs", mnt.encode(), b"tmpfs", 0x2 | 0x4, opts.encode()))  # MS_NOSUID | MS_NODEV
        mounted = True
    except OSError:
        pass
if not cmd:
    sys.exit(0 if mounted else 3)
if mounted:
    for i in range(len(cmd) - 3):
        if cmd[i] == "--size" and cmd[i + 2:i + 4] == ["--tmpfs", workdir]:
            cmd[i:i + 4] = ["--bind", mnt, workdir]
            break
try:
    os.execv(cmd[0], cmd)
except OSError as e:
    sys.stderr.write(f"cannot run {cmd[0]}: {e.strerror}\n")
    sys.exit(127)
'''


def _python() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", LAUNCHER]


_mountpoint: list[str] = []


def mountpoint() -> str:
    """An empty directory of this process's own, on which each run's launcher mounts the run's tmpfs in its
    private mount namespace (concurrent runs share it: each sees only its own mount); removed at exit, and
    made again should a cleaner of the temp dir remove it while the node runs."""
    with _lock:
        if not _mountpoint or not os.path.isdir(_mountpoint[-1]):
            path = tempfile.mkdtemp(prefix="skillswarm-sandbox-")
            creator = os.getpid()
            atexit.register(lambda: os.getpid() == creator and _rmdir(path))  # not at a forked child's exit
            _mountpoint.append(path)
        return _mountpoint[-1]


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def tmpfs_options(disk_bytes: int, disk_files: int) -> str:
    """The work dir's tmpfs options: its bytes, its inodes (files, directories, symlinks and hard links, the
    root and main.py included), owned by the caller (the sandbox's uid maps to it) and private to it."""
    return f"size={disk_bytes},nr_inodes={disk_files},mode=0755"


@functools.lru_cache(maxsize=None)
def mount_mode(bwrap: str) -> str:
    """How the launcher can mount the work dir here (probed once): "ns" as root (with CAP_SYS_ADMIN: not in
    a container that withholds it), "userns" for another user where a user namespace of its own may mount
    a tmpfs (and bwrap is not setuid: a setuid bwrap would lose its privilege inside it), "" where it
    cannot (the work dir is then bwrap's tmpfs, whose inodes are not capped)."""
    if not sys.executable:
        return ""
    try:
        mode = "ns" if os.geteuid() == 0 else "" if os.stat(bwrap).st_mode & stat.S_ISUID else "userns"
        if mode:
            probe = subprocess.run([*_python(), "", mode, mountpoint(), tmpfs_options(1 << 20, 16), "/", "--"],
                                   stdin=subprocess.DEVNULL, capture_output=True, env={}, cwd="/", timeout=30)
            if probe.returncode == 0:
                return mode
    except (OSError, subprocess.SubprocessError):
        pass
    log.info("the sandbox's work dir has no inode limit here: this process cannot mount a tmpfs in a mount "
             "namespace of its own")
    return ""


# ----------------------------------------------------------------------------------------- pids cgroup


def _own_pids_cgroup() -> tuple[Path, int] | None:
    """This process's cgroup in the hierarchy with the pids controller, as a directory, and the cgroup
    version (1 or 2); None where there is none or it is not mounted here."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1 = next((line.split(":", 2)[2] for line in own if "pids" in line.split(":", 2)[1].split(",")), None)
    v2 = next((line.split(":", 2)[2] for line in own if line.startswith("0::")), None)
    for line in mounts:
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[sep + 1], fields[-1].split(",")
        if fstype == "cgroup" and "pids" in options:
            version, path = 1, v1
        elif fstype == "cgroup2":
            version, path = 2, v2
        else:
            continue
        if path is None:
            continue
        if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue
        rel = path[len(root.rstrip("/")):].lstrip("/")
        base = Path(point.replace("\\040", " "), rel)
        if version == 2:
            try:
                if "pids" not in (base / "cgroup.controllers").read_text().split():
                    continue
            except OSError:
                continue
        return base, version
    return None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@functools.lru_cache(maxsize=None)
def pids_parent() -> Path | None:
    """The cgroup that holds one pids cgroup per run, made on first use under this process's own: where
    this process may make it and set a `pids.max` in its children; else None (no cgroup bound here)."""
    found = _own_pids_cgroup()
    if found is None:
        return None
    base, version = found
    parent = base / CGROUP_NAME
    try:
        if version == 2 and "pids" not in (base / "cgroup.subtree_control").read_text().split():
            (base / "cgroup.subtree_control").write_text("+pids")  # refused where this cgroup holds processes
        parent.mkdir(exist_ok=True)
        if version == 2 and "pids" not in (parent / "cgroup.subtree_control").read_text().split():
            (parent / "cgroup.subtree_control").write_text("+pids")
        probe = parent / f"probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        try:
            (probe / "pids.max").write_text("1")
        finally:
            probe.rmdir()
    except OSError as e:
        log.info("the sandbox's runs get no pids cgroup (%s: %s): their threads are bounded by RLIMIT_NPROC "
                 "where the node is not root, by their memory limit only where it is", parent, e.strerror)
        return None
    for stale in parent.glob("run-*"):  # left by a node that died mid-run: empty once its runs ended
        found_pid = re.fullmatch(r"run-(\d+)-\d+", stale.name)
        if found_pid and not _alive(int(found_pid.group(1))):
            _rmdir(str(stale))
    return parent


_runs = itertools.count()
_pending: list[Path] = []  # runs' cgroups that were still busy when their run returned


def new_pids_cgroup(max_tasks: int) -> Path | None:
    """A fresh cgroup for one run whose tasks (bwrap's two included) may number at most `max_tasks`; None
    where this machine has none to give (`pids_parent`)."""
    parent = pids_parent()
    if parent is None:
        return None
    sweep(wait=0)
    path = parent / f"run-{os.getpid()}-{next(_runs)}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(max_tasks))
    except OSError as e:
        log.warning("cannot make the sandbox run's pids cgroup %s (%s); this run's threads are bounded by its "
                    "memory only", path, e.strerror)
        _rmdir(str(path))
        return None
    return path


def release(path: Path) -> None:
    """Remove a run's cgroup once bwrap has exited: now, or (while the kernel still releases the run's last
    tasks, a few milliseconds) at the next run or at exit, rather than wait for it."""
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        with _lock:
            _pending.append(path)


def sweep(wait: float = 1.0) -> None:
    """Remove the runs' cgroups still left, waiting up to `wait` seconds for them to empty."""
    deadline = time.monotonic() + wait
    while True:
        with _lock:
            left = list(_pending)
            _pending.clear()
        busy = []
        for path in left:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(path)
        with _lock:
            _pending.extend(busy)
        if not busy or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


atexit.register(sweep)


def launcher(cmd: list[str], *, workdir: str, disk_bytes: int, disk_files: int, cgroup: Path | None) -> list[str]:
    """`cmd` (a bwrap command line whose work dir is `--size N --tmpfs WORKDIR`) as the launcher runs it:
    in `cgroup` and with an inode-capped work dir where this machine allows them; `cmd` itself where it
    allows neither."""
    mode = mount_mode(cmd[0])
    if not mode and cgroup is None:
        return cmd
    procs = str(cgroup / "cgroup.procs") if cgroup is not None else ""
    return [*_python(), procs, mode, mountpoint() if mode else "", tmpfs_options(disk_bytes, disk_files), workdir,
            "--", *cmd]
