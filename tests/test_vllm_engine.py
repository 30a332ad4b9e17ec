"""The vllm engine: lazily imported (no vLLM import unless asked), a clear error where it cannot run,
and on a CUDA machine with vLLM installed, generation + a weight update + logprob agreement with hf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from skillswarm.node.rl.engines.vllm import vllm_available
from tests.conftest import ROOT


def test_the_engine_module_does_not_import_vllm() -> None:
    code = ("import sys; import skillswarm.node.rl.engines.vllm, skillswarm.node.rl.engines, skillswarm.node.rl.run; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(vllm_available() is None, reason="vLLM can run here")
def test_a_clear_error_where_vllm_cannot_run(tiny_model_dir: Path) -> None:
    from skillswarm.node.rl.engines import load_engine
    from skillswarm.protocol.errors import ModelError

    with pytest.raises(ModelError, match="cannot start the vllm engine"):
        load_engine("vllm", tiny_model_dir)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(vllm_available() is not None, reason=f"needs CUDA and vLLM ({vllm_available()})")
def test_vllm_generates_takes_weights_and_agrees_with_hf() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_check.py")], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
