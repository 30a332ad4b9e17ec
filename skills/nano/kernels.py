"""The float kernels the nano build runs on: pinned, so that one recipe gives the same weights on every
x86-64 CPU with AVX2 (Intel or AMD, AVX2 or AVX-512), not one base per CPU model.

torch picks its vectorised kernels by the CPU (ATen's AVX2 or AVX-512 code, MKL's code paths), and their
sums round differently; over a warm-up of a thousand steps those last-bit differences grow into another
model (the same recipe gave calc 57.3% held-out on one 2-core machine and 46.7% on another, and RL could
improve calc on the first only). Pinning ATen to its AVX2 kernels, MKL to its conditional numerical
reproducibility mode (`MKL_CBWR=COMPATIBLE`), oneDNN to AVX2 and every library to one thread removes that.
These variables are read when torch and MKL load, so the build runs in a process of its own
(`skillswarm.skills.nano.build_process`). Elsewhere (ARM, or an x86 CPU without AVX2) nothing is pinned and
the build record says so.
"""

from __future__ import annotations

import platform
from pathlib import Path

# What the build's own process is started with on a CPU that has AVX2.
PINNED_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
PINNED_LABEL = "x86-64 avx2, MKL_CBWR=COMPATIBLE, 1 thread"


def has_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this is an x86-64 CPU with AVX2 (read from /proc/cpuinfo; False where it cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx2" in flags.split()


def build_env(base: dict[str, str], cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[dict[str, str], str]:
    """The environment for the build's process (`base` plus the pins, where the CPU `cpuinfo` describes takes
    them) and a label of the kernels it gets, for the build record."""
    if has_avx2(cpuinfo):
        return {**base, **PINNED_ENV}, PINNED_LABEL
    return {**base, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, f"native ({platform.machine() or 'unknown CPU'}), 1 thread"
