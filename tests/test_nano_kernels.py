"""The nano build runs in a process of its own on pinned float kernels: on one CPU, one recipe gives the same
weights whatever the environment's SIMD, MKL path or thread count, and its errors reach the caller as clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skillswarm.protocol.errors import ModelError, SkillError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.skills.nano.build import build_base, build_info
from skillswarm.skills.nano.kernels import PINNED_LABEL, build_env, has_avx2
from skillswarm.skills.nano.recipe import NanoRecipe

# Small enough to build in seconds; 20 steps are enough for other kernels to give other bits.
SHORT = NanoRecipe(steps=20, batch_size=4, hidden_size=32, layers=1, heads=2, intermediate_size=64, max_positions=256)
# Its weights hash on pinned kernels, measured on an AMD EPYC with AVX-512 and on this project's Intel Xeon dev
# machine. CI on 2026-12-05 built 023d8b86... on its CPU with the same pins (here == other held there), so
# bit-equality across CPU models is not yet true: the test asserts what holds everywhere (this CPU's pinned
# build ignores the environment's kernel settings) and reports GOLDEN only as a comparison.
GOLDEN = "6568cae7c75ad74fd1e03c3a5e2f2a3830d40a70791e16598413102fd298af6e"

needs_avx2 = pytest.mark.skipif(not has_avx2(), reason="the pinned kernels are x86-64 AVX2 ones; this CPU has none")


@needs_avx2
def test_the_pinned_build_ignores_the_environments_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = build_base(tmp_path / "here", recipe=SHORT, cache=False)
    # What another machine would run unpinned: ATen without SIMD, MKL restricted to AVX2, two threads.
    for name, value in {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "2",
                        "MKL_NUM_THREADS": "2"}.items():
        monkeypatch.setenv(name, value)
    other = build_base(tmp_path / "other", recipe=SHORT, cache=False)
    assert weights_hash(here) == weights_hash(other)
    info = build_info(here)
    assert info["kernels"] == PINNED_LABEL and info["cpu_capability"] == "AVX2"
    assert info["weights_hash"] == weights_hash(here)
    if info["weights_hash"] != GOLDEN:  # a figure for the cross-CPU gap, not a failure (see GOLDEN's comment)
        print(f"pinned nano build on this CPU: {info['weights_hash']} (EPYC/Xeon reference {GOLDEN})")


def _unpinned_hash(out: Path, capability: str) -> str:
    """The weights hash of SHORT trained with no pins but ATen's `capability` (what a CPU of that kind
    picks by itself)."""
    code = ("import json, sys; from pathlib import Path; from skillswarm.skills.nano.build_process import train_into; "
            "from skillswarm.skills.nano.recipe import NanoRecipe; "
            "print(train_into(Path(sys.argv[1]), NanoRecipe.from_dict(json.loads(sys.argv[2])), None)['weights_hash'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ONEDNN_"))}
    proc = subprocess.run([sys.executable, "-c", code, str(out), json.dumps(SHORT.as_dict())], capture_output=True,
                          text=True, timeout=300, env={**env, "ATEN_CPU_CAPABILITY": capability}, check=True)
    return proc.stdout.split()[-1]


@needs_avx2
def test_without_the_pins_the_cpus_kernels_change_the_weights(tmp_path: Path) -> None:
    # The control: why the pins exist. Both capabilities run on every AVX2 CPU.
    assert _unpinned_hash(tmp_path / "a", "avx2") != _unpinned_hash(tmp_path / "b", "default")


def test_a_cpu_without_avx2_is_not_pinned_and_the_record_says_so(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx\n")
    assert not has_avx2(cpuinfo)
    env, label = build_env({"PATH": "/bin"}, cpuinfo)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} and label.startswith("native")
    avx2 = tmp_path / "cpuinfo-avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n")
    env, label = build_env({"PATH": "/bin"}, avx2)
    x86 = has_avx2(avx2)  # False on a CPU that is not x86-64, whatever its cpuinfo says
    assert (env.get("ATEN_CPU_CAPABILITY") == "avx2") == x86 and (label == PINNED_LABEL) == x86


def test_an_error_in_the_build_process_arrives_as_itself_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(SkillError, match="over the nano model's 16 positions"):
        build_base(tmp_path / "m", recipe=SHORT.with_(max_positions=16), cache=False)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".nano-build-*"))


def test_recipes_round_trip_through_json() -> None:
    pinned = SHORT.with_(seed=3).with_skills(["code"]).with_(plugins=(("code", "2", "x", "1.0"),))
    assert NanoRecipe.from_dict(json.loads(json.dumps(pinned.as_dict()))) == pinned
    assert NanoRecipe.from_dict(SHORT.as_dict()).hash() == SHORT.hash()
    with pytest.raises(ModelError):
        NanoRecipe.from_dict({**SHORT.as_dict(), "steps": 0})
