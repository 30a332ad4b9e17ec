"""Arithmetic whose bits feed a published hash, written so that every CPU, torch build, thread count and
chunk size gives the same bits.

A verifier on another machine recomputes a coordinator's merge and must get the same weights hash. The
merge is therefore built only from operations IEEE 754 defines exactly (one rounding, to nearest even):
elementwise +, -, *, /, casts to wider or equal formats, comparisons, sign and selection ops, and exact
selection/sorting of values. Such an op gives the same bits on x86 (any SIMD width), ARM and in scalar
code. What is *not* exact and is kept out of hashed paths:

- matrix products and BLAS (`@`, matmul): their summation order depends on shape, kernel and CPU;
- floating-point reductions (`sum`, `norm`, `mean`): their order depends on vector width and threads;
- fused multiply-add, which rounds once where mul-then-add rounds twice;
- narrowing casts done by hardware instructions whose subnormal handling is mode-dependent.

This module holds the exact replacements: the LoRA product as ordered rank-1 updates, sums of squares
computed exactly in integers (so norms and the clipping factors derived from them are the same
everywhere), a bit-level float32 -> bfloat16 cast, signed-zero canonicalization for sort-based
aggregators, and a check that the process does not flush subnormals to zero.
"""

from __future__ import annotations

import math
import struct
from decimal import Decimal, localcontext

import torch

from skillswarm.protocol.errors import MergeError

_EXP_BUCKETS = 256  # one per float32 biased exponent (0 = subnormal, 255 = inf/nan)
_BLOCK = 1 << 15  # elements per step of the exact sums: their int64 temporaries stay in the CPU's cache
_LORA_BLOCK = 1 << 18  # output elements per block of the LoRA product (fewer, larger calls measured faster)


def lora_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B @ A in float32 as the rank-1 updates B[:, k] * A[k, :] added in order k = 0 .. r-1, each product
    and each sum rounded once. Row i depends only on B[i] and A, so any row range gives the same bits as
    the same rows of the whole product (a matmul does not promise that: its order depends on shape and CPU)."""
    b, a = b.to(torch.float32), a.to(torch.float32)
    (m, r), n = b.shape, a.shape[1]
    out = torch.zeros((m, n), dtype=torch.float32)
    if r == 0 or n == 0:
        return out
    rows = max(1, _LORA_BLOCK // n)  # a block of rows takes all r updates before the next block
    term = torch.empty((min(rows, m), n), dtype=torch.float32)
    for i in range(0, m, rows):
        bb, block = b[i:i + rows], out[i:i + rows]
        t = term[:block.shape[0]]
        torch.mul(bb[:, 0:1], a[0:1, :], out=block)
        for k in range(1, r):
            torch.mul(bb[:, k:k + 1], a[k:k + 1, :], out=t)  # separate kernels: never fused into an FMA
            block.add_(t)
    return out


def _split(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values as int32 (exponent, integer mantissa) with |x| = mant * 2^(exp - 150) exactly; exp >= 1
    (a subnormal scales like exponent 1, without the implicit bit). `signed`: the mantissa carries x's sign."""
    bits = x.view(torch.int32)
    exp = bits >> 23
    exp &= 0xFF
    mant = bits & 0x7FFFFF
    mant |= (exp != 0).to(torch.int32) << 23  # the implicit bit of normal numbers
    if signed:
        mant = torch.where(bits < 0, -mant, mant)
    return exp.clamp_min_(1), mant


class ProductSum:
    """The exact sum of products x_i * y_i of float32 values, rounded once when read: the same float for any
    order, chunking, thread count or machine. With x = mx * 2^(ex - 150) for an integer |mx| < 2^24, each
    product is mx*my * 2^(ex + ey - 300); the integer (|mx*my| < 2^48) is split into a signed high and a
    24-bit low part, summed per exponent in int64 (exact for up to 2^39 terms per exponent), and the
    buckets are combined as one Python integer. Partial sums (one per thread, say) `merge` exactly."""

    _BUCKETS = 2 * _EXP_BUCKETS

    def __init__(self) -> None:
        self._hi = torch.zeros(self._BUCKETS, dtype=torch.int64)
        self._lo = torch.zeros(self._BUCKETS, dtype=torch.int64)
        self._nan = self._inf = False

    def add(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Add sum(x * y) (y None: sum(x * x)); any float dtype, widened to float32 (float64 rounded to it)."""
        fx = x.detach().to(torch.float32).contiguous().reshape(-1)
        fy = fx if y is None else y.detach().to(torch.float32).contiguous().reshape(-1)
        if fx.shape != fy.shape:
            raise ValueError(f"products of tensors of different sizes: {fx.numel()} and {fy.numel()}")
        if y is not None and not (bool(torch.isfinite(fx).all()) and bool(torch.isfinite(fy).all())):
            self._nan = True  # a product with an inf or a nan has no finite sum
        specials = int(self._hi[2 * 255])  # squares of inf and nan land in bucket 510, and only they do
        for i in range(0, fx.numel(), _BLOCK):
            ex, mx = _split(fx[i:i + _BLOCK], signed=y is not None)
            if y is None:
                where, prod = ex.mul_(2), mx.to(torch.int64)
                prod.mul_(prod)
            else:
                ey, my = _split(fy[i:i + _BLOCK], signed=True)
                where, prod = ex.add_(ey), mx.to(torch.int64).mul_(my)
            self._hi.index_add_(0, where, prod >> 24)  # arithmetic shift: floor, so hi * 2^24 + lo == prod
            self._lo.index_add_(0, where, prod.bitwise_and_(0xFFFFFF))
        if y is None and int(self._hi[2 * 255]) != specials:
            self._inf = True
            self._nan = self._nan or bool(torch.isnan(fx).any())

    def merge(self, other: "ProductSum") -> None:
        """Add another partial sum into this one (exact: integer buckets)."""
        self._hi += other._hi
        self._lo += other._lo
        self._nan, self._inf = self._nan or other._nan, self._inf or other._inf

    def value(self) -> float:
        """The sum, correctly rounded to float64 (inf if a square was infinite, nan for nan or inf * y)."""
        if self._nan:
            return math.nan
        if self._inf:
            return math.inf
        total = 0
        for b, (hi, lo) in enumerate(zip(self._hi.tolist(), self._lo.tolist())):
            if hi or lo:
                total += ((hi << 24) + lo) << b
        return math.ldexp(float(total), -300)  # int -> float rounds once; scaling by 2^-300 is exact here


class SquareSum(ProductSum):
    """The exact sum of squares (see ProductSum), and the L2 norm it gives."""

    def add(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Add the squares of every element of `x`."""
        super().add(x, None)

    def norm(self) -> float:
        """sqrt of the sum (IEEE sqrt is correctly rounded, so this is machine-independent too)."""
        return math.sqrt(self.value())


def dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """The exactly computed, once-rounded dot product of two same-size tensors."""
    s = ProductSum()
    s.add(x, y)
    return s.value()


def l2_norm(*xs: torch.Tensor) -> float:
    """The exact-then-rounded L2 norm of one or more tensors taken together."""
    s = SquareSum()
    for x in xs:
        s.add(x)
    return s.norm()


_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640629")
_PREC = 50  # decimal digits: far more than a float64 needs, and pure-Python arithmetic, the same everywhere


def _series(x: Decimal, first: Decimal, step: "object") -> Decimal:
    total, term, k = first, first, 1
    while True:
        term = step(term, k)  # type: ignore[operator]
        if term == 0 or abs(term) < abs(total) * Decimal(10) ** (-_PREC - 2):
            return total
        total += term
        k += 1


def exact_sin(x: float) -> float:
    """sin(x), correctly rounded in practice and the same on every machine (libm's sin is not promised to
    be): a 50-digit decimal Taylor series after reduction into [-pi, pi]."""
    with localcontext() as ctx:
        ctx.prec = _PREC
        d = Decimal(x) % (2 * _PI)
        d = d - 2 * _PI if d > _PI else d + 2 * _PI if d < -_PI else d
        sq = d * d
        return float(_series(d, d, lambda t, k: -t * sq / ((2 * k) * (2 * k + 1))))


def _atan(d: Decimal) -> Decimal:
    halvings = 0
    while abs(d) > Decimal("0.05"):
        d = d / (1 + (1 + d * d).sqrt())  # atan(x) = 2 atan(x / (1 + sqrt(1 + x^2)))
        halvings += 1
    sq = d * d
    return _series(d, d, lambda t, k: -t * sq * (2 * k - 1) / (2 * k + 1)) * (2 ** halvings)


def exact_acos(c: float) -> float:
    """acos(c) for c in [-1, 1], machine-independent like `exact_sin`."""
    if not -1.0 <= c <= 1.0:
        raise ValueError(f"acos of {c} outside [-1, 1]")
    with localcontext() as ctx:
        ctx.prec = _PREC
        d = Decimal(c)
        if abs(d) == 1:
            return 0.0 if d > 0 else float(_PI)
        return float(_PI / 2 - _atan(d / (1 - d * d).sqrt()))


def to_float32(x: float) -> float:
    """x rounded to the nearest float32 (IEEE conversion), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding to nearest even on the bit pattern (NaN -> one quiet NaN). Integer
    ops only, so subnormals round like every other value whatever the CPU's bf16 instructions do."""
    f = x.detach().to(torch.float32).contiguous()
    bits = f.view(torch.int32)
    nan = torch.isnan(f)
    if bool(nan.any()):  # the one pattern whose rounding would overflow int32: make every NaN 0x7FC00000
        bits = bits.masked_fill(nan, 0x7FC00000)
    # bits + 0x7FFF + lsb never overflows now; the arithmetic >> 16 leaves a negative value's top half
    # sign-extended, which fits int16 with the right bit pattern.
    r = bits >> 16
    r.bitwise_and_(1).add_(0x7FFF).add_(bits).bitwise_right_shift_(16)
    return r.to(torch.int16).view(torch.bfloat16)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, with the one narrowing cast that hardware may do differently (to bfloat16) done
    bit-exactly; float16 narrowing is IEEE conversion (F16C, FCVT or software agree), widening is exact."""
    if dtype == torch.bfloat16 and x.dtype in (torch.float32, torch.float64):
        return to_bfloat16(x)
    return x.to(dtype)


def canonical_zeros(x: torch.Tensor) -> torch.Tensor:
    """Turn -0.0 into +0.0 in place (x + 0.0 does exactly that under round-to-nearest), so that sorting,
    which cannot tell the two zeros apart, puts the same bits in every position on every machine."""
    return x.add_(0.0)


def check_float_environment() -> None:
    """Refuse to merge in a process that flushes subnormals to zero (FTZ/DAZ: torch.set_flush_denormal(True),
    or a library built with -ffast-math): its merges would differ from every other machine's."""
    bits = torch.full((1 << 17,), 0x00400000, dtype=torch.int32)  # 2^-127, a subnormal, built from its bits;
    same = torch.equal((bits.view(torch.float32) * 1.0).view(torch.int32), bits)  # big enough for worker threads
    if not same:
        raise MergeError("this process flushes subnormal floats to zero (torch.set_flush_denormal(True), or a "
                         "library built with -ffast-math); its merges would not match other machines'. Merge in a "
                         "process without it (e.g. `skillswarm merge` from a shell)")


__all__ = ["ProductSum", "SquareSum", "canonical_zeros", "cast", "check_float_environment", "dot", "exact_acos",
           "exact_sin", "l2_norm", "lora_product", "to_bfloat16", "to_float32"]
