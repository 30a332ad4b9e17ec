"""Golden tests: merges and decodes of fixed inputs must give these exact hashes on every CPU (x86-64 with
any SIMD width, ARM), with every supported torch, any thread count and any chunk size.

IF ONE OF THESE EVER FAILS, IT IS A BUG, NOT A TEST TO UPDATE. A coordinator's checkpoint is checked by
others recomputing it (`coordinator run --verify`); a hash that differs here means an honest coordinator
would look like a cheat on some machines. Find the operation that is not exact (a matmul, a float
reduction, a fused multiply-add, a hardware narrowing cast, a sort that meets -0.0: see merge/exact.py)
and make it exact. Only a deliberate change of a file format or of a method's definition may change
GOLDEN, and its commit must say which figures changed and why.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skillswarm.merge.aggregate import median, trimmed_mean
from skillswarm.merge.exact import SquareSum, canonical_zeros, l2_norm, lora_product, to_bfloat16
from tests.conftest import ROOT
from tests.golden import compute

GOLDEN = {
    "aggregate/clipped_mean": "f57fe1936edb3c59e9a0c6b2d41ff90ae9c242d2a1fcb2680e61bf10ad56f8c2:"
        "67cba91e7c038277ab62c9cecdd85fa157d98067f1df9dab2aec00937e2b910e",
    "aggregate/mean": "db06df3819f5cf6ac9857f14ab8434b527dd2d37cd4a2c6bc515af83a7e26883:"
        "dcb72131f17ad7b0132f1b69602690a1133b16b826740a7140ac7c2bd176d1bb",
    "aggregate/median": "c47e1f532668e9d782823fe6d3f1688ebf019043f805caadfd427e5ef31592b0:"
        "3637eec75cf03e327fa750272041c150e1a1926ad9f6c569392d135c9d62600d",
    "aggregate/trimmed_mean": "eaefaf40eda1bfe5cb2313c338ecc82bec4d2b5ba879fb6d04b8b701ae2e1c48:"
        "86075b03f3490e409efab0089d4d081e92a9c83da3727259487e9162ace40cd3",
    "apply/bf16": "9b1a2d4b7b2338fdc827643b8c1a38ebfbbb5340b103edbe5302f5800c786154",
    "decode/dense_bf16": "b58a44a37f5acab79fb59739d03db59201a8fa8b4202f261f8d11874f7641c02",
    "decode/dense_fp16": "93770cd33d94a9554926e815e61b99db70d8f612a81340feb0d1d675cdd67046",
    "decode/dense_fp32": "3c631b43c42ed6831a9d6441bdf70ce6ab0e017cb0147bb8e31bf2c4e1af70c3",
    "decode/int8": "244b2cbc9727de98e728f69a83ffa9e94330f5c727a85e42723e2a7c3bcc72f9",
    "decode/lora": "19b809e33f034d69b93b2f11ef46ea5e42e730d3772dd0fa8ef406d433090d1c",
    "decode/topk16": "02e254ad7637edabcc016ea53465e3ac286a032b7207a908978c8f024dd98ba8",
    "decode/topk32": "a292dd7638cb82eb418b95251b6c150edaa601dd899a4e6ab2ef5011b4b8be46",
    "decode/topk8": "6a1853d27e2f0f5af733e451879cab8c774d12e8213b1e511fa964af423b2701",
    "file/dense_bf16": "6f63bb3fa880ce53c9b978a872ca2f930dceaa83214ab0673a3bdb751437db0b",
    "file/dense_fp16": "0e69e683755c7d20b43f60ba1795a8a0e2da4a3484eef9b29722c4bc985a292e",
    "file/dense_fp32": "70783f5c7039b8bd7891895e98eb92c7109c1c4e6730a5b775547c6ed2ec0b46",
    "file/int8": "a6ef684639e4e591e5f297b6c43a840d3bf5b25fd1e5ed168793a43d602e79ab",
    "file/lora": "fab6288194aaaf299405a5a7e6e349dd1a8daf165718aaf88a87dd4872bb29e5",
    "file/merged-bf16": "6f96f1ae47e825ebedc6bd83221102c0d2d570019afea7ee564c293fd00f230e",
    "file/topk16": "f6fed756e2f9a9560ff769961d995156593d8a3ff9cb189122535b984d67749f",
    "file/topk32": "dee0e25eeb1c7f8740f0723b6df89cc14f36efe00994c33aa39c77f82381aee3",
    "file/topk8": "9ca62187d9938a002f7a64e92d8ee58f3fa12999933f4257f30904f8a34c2946",
    "merge/bf16-base": "9b1a2d4b7b2338fdc827643b8c1a38ebfbbb5340b103edbe5302f5800c786154:"
        "6f96f1ae47e825ebedc6bd83221102c0d2d570019afea7ee564c293fd00f230e",
    "merge/breadcrumbs": "bb1c73f22768d693735f9fdfafb00d81968b3529461ad6fa497741a122b8a837:"
        "5f9f6d66f8bd47b8c3cb0a4f226b2f9b9a7e1eb36d4edcc6ab0f606e36428e1e",
    "merge/dare_linear": "e79118a8e4574c1ac1cbb9ccd49f19c680ed104c9051d7ab8061680b44450629:"
        "6a0670210e75055e51b1d0113c03ae78e25ea637471d9fd6d8d3cd847dd06b14",
    "merge/dare_ties": "e489f96f0d96b494d14554d7f3132abbc5803f85ba41f74fa93e6bfb2b959e0f:"
        "de10e30483bacc0fd8e510ad15b83439c0c1fca49cecced8db68294f920fa042",
    "merge/fp16-out": "d1824938b8f4509b9ddd78697875dbda5ddeb56d66d60c368e7ea67e55f6f00d:"
        "a6a261b0ed230eafc4b02347af716d802567454e5533e65684ec9fd2aba85724",
    "merge/linear": "0003274a596e0d421d2dad70de7f4b2f2681e34c383363e29bc1a7a77e7f8f15:"
        "7ddac95515a3244d0647f4311c139f659eb7b9ef0e0be9f8a9963022288c8227",
    "merge/task_arithmetic": "509d41bcc4fe5d1e10d3f3ef423895f572feb67f500ede7ecf8cbd547dcbd0f2:"
        "0a9fcf572159ac7b7e76a9fa2fb381c6d8a7950afd3dd6856a767da40474028c",
    "merge/ties": "03d15be10712896a9ba911086127beebe369e5bafa0a885695d81d38834edec7:"
        "8df10f17a18f7c9ade737b65d79cd18c97d4452db51208fbae5d11beb5a34807",
    "norm/dense_bf16": "0x1.9a2f216946dcfp+0",
    "norm/dense_fp16": "0x1.968a27c772609p+0",
    "norm/dense_fp32": "0x1.9a3c24204788fp+0",
    "norm/int8": "0x1.934c4d10f195cp+0",
    "norm/lora": "0x1.21b7d103f40cbp-1",
    "norm/topk16": "0x1.887337d4e6bfcp+0",
    "norm/topk32": "0x1.92245cab4e5c3p+0",
    "norm/topk8": "0x1.7c2ff26f95d81p+0",
    "screen/norms": (
        "0x1.9a3c24204788fp+0,"
        "0x1.9a2f216946dcfp+0,"
        "0x1.968a27c772609p+0,"
        "0x1.887337d4e6bfcp+0,"
        "0x1.92245cab4e5c3p+0,"
        "0x1.934c4d10f195cp+0,"
        "0x1.21b7d103f40cbp-1,"
        "0x1.7c2ff26f95d81p+0"),
}


def _diff(got: dict[str, str]) -> str:
    bad = sorted(k for k in GOLDEN.keys() | got.keys() if GOLDEN.get(k) != got.get(k))
    return "\n".join(f"  {k}: expected {GOLDEN.get(k)}, got {got.get(k)}" for k in bad)


def test_golden_hashes(tmp_path: Path) -> None:
    """Every codec's file and decode, every method, every aggregator, bf16 and fp16 outputs, screening norms;
    each at chunk sizes from one row to whole tensors on one and two threads (compute raises if they differ)."""
    got = compute(tmp_path)
    assert got == GOLDEN, f"bit-stability bug (read this file's docstring before touching GOLDEN):\n{_diff(got)}"


@pytest.mark.slow
def test_golden_hashes_on_other_cpu_kernels_and_one_thread(tmp_path: Path) -> None:
    """The same figures from torch's portable (non-SIMD) kernels on one thread, standing in for another CPU."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.golden"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["capability"] == "DEFAULT" and report["threads"] == 1
    assert report["figures"] == GOLDEN, f"bit-stability bug under portable kernels:\n{_diff(report['figures'])}"


def _bf16_reference(bits: int) -> int:
    """Round a float32 bit pattern to bfloat16 by comparing distances (independent of the bit trick)."""
    f32 = lambda b: struct.unpack("<f", struct.pack("<I", b))[0]  # noqa: E731
    x = f32(bits)
    if math.isnan(x):
        return 0x7FC0
    lo, hi = bits & 0xFFFF0000, (bits & 0xFFFF0000) + 0x10000  # the two bf16 neighbours, toward 0 and away
    if bits == lo:
        return lo >> 16
    # past the largest bf16 lies infinity, which rounding treats as 2^128 (IEEE's unbounded exponent)
    up = math.copysign(2.0 ** 128, x) if hi & 0x7FFFFFFF == 0x7F800000 else f32(hi)
    down_dist, up_dist = abs(x - f32(lo)), abs(up - x)
    if down_dist < up_dist or (down_dist == up_dist and not (lo >> 16) & 1):
        return lo >> 16
    return hi >> 16


def test_bfloat16_cast_rounds_to_nearest_even_on_every_pattern_kind() -> None:
    rng = random.Random(5)
    patterns = [rng.getrandbits(32) for _ in range(20000)]
    for exp in (0, 1, 0x7E, 0xFE, 0xFF):  # subnormals, tiny, ~1, huge, inf/nan
        for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0xFFFF, 0x7F8000, 0x7FFFFF):
            for sign in (0, 1 << 31):
                patterns.append(sign | (exp << 23) | low)
    bits = torch.tensor(patterns, dtype=torch.int64).to(torch.int32)
    got = to_bfloat16(bits.view(torch.float32)).view(torch.int16).tolist()
    want = [_bf16_reference(p) for p in patterns]
    bad = [(hex(p), hex(g & 0xFFFF), hex(w)) for p, g, w in zip(patterns, got, want) if (g & 0xFFFF) != w]
    assert not bad, bad[:5]


def test_square_sums_are_exact_whatever_the_order_and_chunking() -> None:
    rng = random.Random(3)
    values = [rng.uniform(-1, 1) * 2.0 ** rng.randint(-140, 60) for _ in range(5000)] + [0.0, -0.0, 1e-45, 3e38]
    x = torch.tensor(values, dtype=torch.float32)
    exact = math.fsum(float(v) ** 2 for v in x.tolist())  # float32 squares are exact in float64; fsum rounds once
    forward, backward = SquareSum(), SquareSum()
    for i in range(0, x.numel(), 7):
        forward.add(x[i:i + 7])
    backward.add(x.flip(0))
    assert forward.value() == backward.value() == exact
    assert l2_norm(x[:100], x[100:]) == math.sqrt(exact)
    inf = SquareSum()
    inf.add(torch.tensor([1.0, math.inf]))
    nan = SquareSum()
    nan.add(torch.tensor([math.nan, 1.0]))
    assert inf.value() == math.inf and math.isnan(nan.value()) and SquareSum().norm() == 0.0


def test_lora_rows_decode_to_the_bits_of_the_whole_product() -> None:
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(257, 16, generator=g), torch.randn(16, 131, generator=g)
    whole = lora_product(b, a)
    for r0, r1 in [(0, 1), (1, 3), (3, 67), (200, 257), (256, 257)]:
        assert torch.equal(lora_product(b[r0:r1], a), whole[r0:r1])
    want = torch.zeros(257, 131, dtype=torch.float64)
    for k in range(16):
        want = (want + (b[:, k:k + 1].double() * a[k:k + 1, :].double()).float().double()).float().double()
    assert torch.equal(whole, want.float())  # the order and roundings the docstring promises, term by term


def test_sorting_aggregators_do_not_depend_on_which_zero_comes_first() -> None:
    pz, nz = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    one = torch.tensor([0.0, 2.0])
    for xs in ([pz, nz, one], [nz, pz, one], [nz, nz, pz]):
        assert median(xs).view(torch.int32)[0] == 0  # +0.0, never -0.0
        assert trimmed_mean(xs, 0.34).view(torch.int32)[0] == 0
    z = torch.tensor([-0.0, 0.0, -1.0])
    assert canonical_zeros(z).view(torch.int32).tolist() == [0, 0, struct.unpack("<i", struct.pack("<f", -1.0))[0]]


def test_a_process_that_flushes_subnormals_refuses_to_merge(tmp_path: Path) -> None:
    code = ("import torch, sys\nfrom skillswarm.merge.exact import check_float_environment\n"
            "from skillswarm.protocol.errors import MergeError\ncheck_float_environment()\ntorch.set_flush_denormal(True)\n"
            "try:\n    check_float_environment()\nexcept MergeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if "refused" not in out.stdout and not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode")
    assert "refused: this process flushes subnormal floats to zero" in out.stdout, out.stderr
