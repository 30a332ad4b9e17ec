"""The sandbox's seccomp filter: a classic-BPF program that bubblewrap installs (`--seccomp FD`) just
before it starts the interpreter.

It makes four promises the namespaces alone do not: no new processes (fork, vfork, clone without
CLONE_THREAD; clone3 answers ENOSYS so the C library falls back to clone, whose flags a filter can
read), no sockets but AF_UNIX ones, none of the kernel interfaces sandboxes are usually broken
through (ptrace, namespaces and mounts, bpf, io_uring, userfaultfd, perf, keyrings, modules, kexec),
and none of those that hold kernel memory or a host-wide table beyond the run's rlimits: Linux AIO
(io_setup reserves from the host's fs.aio-max-nr, which one run could fill, and the host's own
io_setup then fails), System V message queues, semaphores and shared memory (a run's IPC namespace
allows 32,000 queues of 16 KiB each, and detached shared memory escapes RLIMIT_AS), POSIX message
queues, and inotify (its instances count against the host user's fs.inotify.max_user_instances).
A denied call fails with EPERM (EAFNOSUPPORT for socket families), so the program sees an ordinary
OSError. A call made through another ABI (x32, or 32-bit code on a 64-bit kernel) kills the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64 each).
_NR, _ARCH, _ARG0_LO = 0, 4, 16
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_ERRNO = 0x00050000
CLONE_THREAD = 0x00010000
AF_UNIX = 1

# Syscall numbers of what is denied, per architecture (from the kernel's unistd headers; the test checks
# them against /usr/include when it is there). x86_64 has fork and vfork; arm64 only clone.
DENIED: dict[str, dict[str, int]] = {
    "x86_64": {
        "fork": 57, "vfork": 58, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "acct": 163,
        "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103, "quotactl": 179, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "lookup_dcookie": 212, "fanotify_init": 300, "uselib": 134, "vhangup": 153,
        "ioperm": 173, "iopl": 172, "modify_ldt": 154, "personality": 135, "pidfd_getfd": 438, "kcmp": 312,
        # kernel memory and host-wide tables a run could take from the host (see the module docstring)
        "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
        "io_pgetevents": 333, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65,
        "semctl": 66, "semtimedop": 220, "shmget": 29, "shmat": 30, "shmdt": 67, "shmctl": 31, "mq_open": 240,
        "inotify_init": 253, "inotify_init1": 294,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219,
        "add_key": 217, "request_key": 218, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "acct": 89, "swapon": 224, "swapoff": 225,
        "reboot": 142, "syslog": 116, "quotactl": 60, "open_by_handle_at": 265, "name_to_handle_at": 264,
        "lookup_dcookie": 18, "fanotify_init": 262, "vhangup": 58, "personality": 92, "pidfd_getfd": 438, "kcmp": 272,
        "io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4, "io_pgetevents": 292,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191, "semtimedop": 192,
        "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197, "mq_open": 180, "inotify_init1": 26,
    },
}
# (AUDIT_ARCH_*, clone, clone3, socket) per architecture.
_ARCHES = {"x86_64": (0xC000003E, 56, 435, 41), "aarch64": (0xC00000B7, 220, 435, 198)}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine() -> str:
    """This machine's architecture, in the names `DENIED` uses."""
    m = platform.machine().lower()
    return _ALIASES.get(m, m)


def supported(arch: str | None = None) -> bool:
    """Whether a filter exists for `arch` (default: this machine)."""
    return (arch or machine()) in _ARCHES


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes:
    """The filter for `arch` (default: this machine), as the bytes of a `struct sock_filter` array."""
    arch = arch or machine()
    if arch not in _ARCHES:
        raise ValueError(f"no seccomp filter for architecture {arch!r} (have: {', '.join(_ARCHES)})")
    audit, clone, clone3, socket = _ARCHES[arch]
    denied = sorted(DENIED[arch].values())
    eperm, enosys, eafno = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS, _ERRNO | errno.EAFNOSUPPORT
    head = [_ins(_LD_W_ABS, _ARCH), _ins(_JEQ, audit, 1, 0), _ins(_RET, _KILL_PROCESS), _ins(_LD_W_ABS, _NR)]
    if arch == "x86_64":  # the x32 ABI shares the arch value; its numbers carry bit 30
        head += [_ins(_JGE, 0x40000000, 0, 1), _ins(_RET, _KILL_PROCESS)]
    tail = [
        _ins(_JEQ, clone3, 0, 1), _ins(_RET, enosys),
        _ins(_JEQ, clone, 0, 2), _ins(_LD_W_ABS, _ARG0_LO), _ins(_JSET, CLONE_THREAD, 5, 4),  # a thread, or EPERM
        _ins(_JEQ, socket, 0, 4), _ins(_LD_W_ABS, _ARG0_LO), _ins(_JEQ, AF_UNIX, 2, 0), _ins(_RET, eafno),
        _ins(_RET, eperm), _ins(_RET, _ALLOW),
    ]
    # layout of `tail`: 0 jeq clone3, 1 ENOSYS, 2 jeq clone, 3 ld arg0, 4 jset thread, 5 jeq socket,
    # 6 ld arg0, 7 jeq AF_UNIX, 8 EAFNOSUPPORT, 9 EPERM, 10 ALLOW (jumps count from the next instruction).
    # Each denied number jumps forward to the shared EPERM, tail[9].
    assert len(denied) + 8 <= 255, "a BPF jump reaches at most 255 instructions: split the denied list"
    checks = [_ins(_JEQ, nr, len(denied) - i + 8, 0) for i, nr in enumerate(denied)]
    return b"".join(head + checks + tail)
