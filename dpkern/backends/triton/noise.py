"""The noise stream v1 (SPEC section 3) as Triton helpers, and its two public entry points;
the rounding stream (SPEC section 3.2) likewise.

``philox`` is exactly ``tl.philox(K, c0, c1, c2, c3)`` with the SPEC's counter words;
``radius_angle`` is the SPEC's float32 word -> (R, theta) transform, operation for
operation as in ``reference.normal_from_words`` (never ``tl.randn``, whose uniform is
floored at 1e-7 and cuts the tail at 5.68 sigma).

One Philox call serves two elements (the pair k = j >> 1: lane 0 takes R cos theta, lane 1
R sin theta), so ``tile_normals`` draws a tile whose first global index is even, half as
many Philox calls and transcendentals as elements, and interleaves the two lanes with
``tl.join`` + ``tl.reshape``. Callers whose tensor starts at an odd global index shift
their tile by one element (the "phase", see ``_common``). The value of an element depends
on (key, step, stream, global index) only: never on the block size, grid or launch split.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...hyper import ROUNDING_STREAM
from . import _common as C

_TWO_M32 = tl.constexpr(2.0**-32)
_TWO_M64 = tl.constexpr(2.0**-64)
_TWO_M96 = tl.constexpr(2.0**-96)
_TWO_M97 = tl.constexpr(2.0**-97)
# 2*pi rounded to float32, as the reference multiplies by it
_TWO_PI_F32 = tl.constexpr(float(torch.tensor(2 * math.pi, dtype=torch.float32)))

_INT_ARGS = ["key_lo", "key_hi", "c2", "c3"]


@triton.jit
def philox(k, key_lo, key_hi, c2, c3):
    """Philox-4x32-10 words of pair indices ``k`` (int64 tensor): counter
    (k mod 2**32, k >> 32, c2, c3), key K = key_hi * 2**32 + key_lo (SPEC section 3)."""
    c0 = k.to(tl.uint32)  # truncation: k mod 2**32
    c1 = (k >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    seed = (key_hi.to(tl.uint64) << 32) | key_lo.to(tl.uint64)
    return tl.philox(seed, c0, c1, zero + c2.to(tl.uint32), zero + c3.to(tl.uint32))


@triton.jit
def _uniform(a, b, c):
    """((f32(a) 2^-32 + f32(b) 2^-64) + f32(c) 2^-96) + 2^-97 in float32, in this order."""
    u = a.to(tl.float32) * _TWO_M32 + b.to(tl.float32) * _TWO_M64
    u = u + c.to(tl.float32) * _TWO_M96
    return u + _TWO_M97


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _cos_sin(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        c = libdevice.cos(x)
        s = libdevice.sin(x)
    else:
        c = tl.cos(x)
        s = tl.sin(x)
    return c, s


@triton.jit
def radius_angle(r0, r1, r2, r3, LIBDEVICE: tl.constexpr):
    """(R, theta) of SPEC section 3 from the Philox words (uint32 tensors)."""
    U = _uniform(r0, r1, r3)
    # 32-bit complements (V = 1 - U) as XOR: the interpreter of triton 3.7 fails on ~uint32
    V = _uniform(r0 ^ 0xFFFFFFFF, r1 ^ 0xFFFFFFFF, r3 ^ 0xFFFFFFFF)
    big = r0 >= 2147483648
    # -ln U where U is small; for U near 1, -log1p(-V) through log only (Goldberg).
    # Lanes of the other branch get harmless stand-in values (no log(0), no 0/0).
    w = tl.where(big, 1.0 - V, 0.5)
    exact = w == 1.0
    den = tl.where(exact, 1.0, 1.0 - w)
    l_hi = tl.where(exact, V, tl.math.div_rn((-_log(w, LIBDEVICE)) * V, den))
    l_lo = -_log(tl.where(big, 0.5, U), LIBDEVICE)
    L = tl.where(big, l_hi, l_lo)
    R = tl.math.sqrt_rn(2.0 * L)
    theta = _TWO_PI_F32 * (r2.to(tl.float32) * _TWO_M32)
    return R, theta


@triton.jit
def tile_normals(g0, key_lo, key_hi, c2, c3, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """z of the global indices g0 .. g0 + BLOCK - 1 (g0 even, int64): float32 [BLOCK]."""
    k = (g0 >> 1) + tl.arange(0, BLOCK // 2).to(tl.int64)
    r0, r1, r2, r3 = philox(k, key_lo, key_hi, c2, c3)
    R, theta = radius_angle(r0, r1, r2, r3, LIBDEVICE)
    c, s = _cos_sin(theta, LIBDEVICE)
    return tl.reshape(tl.join(R * c, R * s), [BLOCK])


# --------------------------------------------------------------------------------------
# Kernels of the public noise functions (tests and users that want raw noise)
# --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_INT_ARGS + ["n"])
def _philox_words_kernel(idx_ptr, out_ptr, n, key_lo, key_hi, c2, c3, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    idx = tl.load(idx_ptr + offs, mask=m, other=0)
    r0, r1, r2, r3 = philox(idx >> 1, key_lo, key_hi, c2, c3)
    out = out_ptr + offs * 4
    tl.store(out + 0, r0.to(tl.int64), mask=m)  # uint32 -> int64 zero-extends
    tl.store(out + 1, r1.to(tl.int64), mask=m)
    tl.store(out + 2, r2.to(tl.int64), mask=m)
    tl.store(out + 3, r3.to(tl.int64), mask=m)


@triton.jit(do_not_specialize=_INT_ARGS + ["numel", "offset", "phase"])
def _gaussian_noise_kernel(
    out_ptr,
    numel,
    offset,
    phase,
    key_lo,
    key_hi,
    c2,
    c3,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    e0 = tl.program_id(0).to(tl.int64) * BLOCK - phase  # tile starts at an even global index
    z = tile_normals(offset + e0, key_lo, key_hi, c2, c3, BLOCK, LIBDEVICE)
    e = e0 + tl.arange(0, BLOCK)
    tl.store(out_ptr + e, z, mask=(e >= 0) & (e < numel))


@triton.jit(do_not_specialize=["n"])
def _words_to_normal_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = words_ptr + offs * 4
    r0 = tl.load(w + 0, mask=m, other=0).to(tl.uint32)
    r1 = tl.load(w + 1, mask=m, other=0).to(tl.uint32)
    r2 = tl.load(w + 2, mask=m, other=0).to(tl.uint32)
    r3 = tl.load(w + 3, mask=m, other=0).to(tl.uint32)
    R, theta = radius_angle(r0, r1, r2, r3, LIBDEVICE)
    c, s = _cos_sin(theta, LIBDEVICE)
    tl.store(out_ptr + offs * 2, R * c, mask=m)
    tl.store(out_ptr + offs * 2 + 1, R * s, mask=m)


def _default_device(device):
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() and not C.INTERPRETED else "cpu")


def philox_words(index: torch.Tensor, *, key: int, step: int, stream: int = 0) -> torch.Tensor:
    """The Philox words (r0, r1, r2, r3) of global element indices ``index`` (int64
    ``[n]``): int64 ``[n, 4]`` holding values in [0, 2**32)."""
    dev = C.check_device(index.device)
    index = C.readonly(index.to(torch.int64)).reshape(-1)
    n = index.numel()
    out = C.empty((n, 4), torch.int64, dev)
    if n:
        block = C.config().step_block
        _philox_words_kernel[(C.cdiv(n, block),)](
            index,
            out,
            n,
            *C.key_words(key),
            *C.step_words(step, stream),
            BLOCK=block,
            num_warps=C.config().num_warps,
        )
    return out


def gaussian_noise(
    numel: int, *, key: int, step: int, offset: int = 0, stream: int = 0, device=None
) -> torch.Tensor:
    """z for global elements ``offset ... offset + numel - 1``: float32 ``[numel]``."""
    dev = C.check_device(_default_device(device))
    out = C.empty((numel,), torch.float32, dev)
    if numel:
        block = C.config().step_block
        phase = offset & 1
        _gaussian_noise_kernel[(C.cdiv(numel + phase, block),)](
            out,
            numel,
            offset,
            phase,
            *C.key_words(key),
            *C.step_words(step, stream),
            BLOCK=block,
            LIBDEVICE=C.LIBDEVICE,
            num_warps=C.config().num_warps,
        )
    return out


def normal_from_words(words: torch.Tensor) -> torch.Tensor:
    """The word -> standard normal transform alone: int64 ``[n, 4]`` Philox words ->
    float32 ``[n, 2]``, the z of lane 0 and lane 1 (``reference.normal_from_words``)."""
    dev = C.check_device(words.device)
    words = C.readonly(words.to(torch.int64))
    n = words.shape[0]
    out = C.empty((n, 2), torch.float32, dev)
    if n:
        _words_to_normal_kernel[(C.cdiv(n, 256),)](words, out, n, BLOCK=256, LIBDEVICE=C.LIBDEVICE)
    return out


# --------------------------------------------------------------------------------------
# The rounding stream (SPEC section 3.2)
# --------------------------------------------------------------------------------------
@triton.jit
def tile_rounding_bits(g0, key_lo, key_hi, c2, c3, BLOCK: tl.constexpr):
    """rho of the global indices g0 .. g0 + BLOCK - 1 (g0 even, int64; c3 of the rounding
    stream): w >> 16 with w = r0 (lane 0) or r2 (lane 1) of the pair's Philox words, as
    uint32 [BLOCK] in [0, 2**16). The pairs are laid out as ``tile_normals`` lays them."""
    k = (g0 >> 1) + tl.arange(0, BLOCK // 2).to(tl.int64)
    r0, r1, r2, r3 = philox(k, key_lo, key_hi, c2, c3)
    return tl.reshape(tl.join(r0 >> 16, r2 >> 16), [BLOCK])


@triton.jit
def rounding_bits_at(g, key_lo, key_hi, c2, c3):
    """rho of the global indices ``g`` (any int64 tensor, any parity): uint32, one Philox
    call per element (for callers whose tiles do not start at an even index)."""
    r0, r1, r2, r3 = philox(g >> 1, key_lo, key_hi, c2, c3)
    return tl.where((g & 1) == 0, r0, r2) >> 16


@triton.jit(do_not_specialize=_INT_ARGS + ["numel", "offset"])
def _stochastic_round_kernel(
    x_ptr, out_ptr, bits_ptr, numel, offset, key_lo, key_hi, c2, c3, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    rho = rounding_bits_at(offset + offs, key_lo, key_hi, c2, c3)
    tl.store(bits_ptr + offs, rho.to(tl.int64), mask=m)
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, C.to_bf16_sr(x, rho), mask=m)


def _round(x: torch.Tensor, key, step: int, offset: int):
    dev = C.check_device(x.device)
    x = C.readonly(x.detach().to(torch.float32)).reshape(-1)
    n = x.numel()
    out = C.empty((n,), torch.bfloat16, dev)
    bits = C.empty((n,), torch.int64, dev)
    if n:
        block = C.config().step_block
        _stochastic_round_kernel[(C.cdiv(n, block),)](
            x,
            out,
            bits,
            n,
            offset,
            *C.key_words(key),
            *C.step_words(step, ROUNDING_STREAM),
            BLOCK=block,
            num_warps=C.config().num_warps,
        )
    return out, bits


def rounding_bits(numel: int, *, key: int, step: int, offset: int = 0, device=None):
    """rho_j of global elements ``offset ... offset + numel - 1``: int64 ``[numel]``
    (``reference.rounding_bits``)."""
    dev = C.check_device(_default_device(device))
    return _round(torch.zeros(numel, dtype=torch.float32, device=dev), key, step, offset)[1]


def stochastic_round_bf16(x: torch.Tensor, *, key: int, step: int, offset: int = 0):
    """float32 ``x`` rounded stochastically to bfloat16 (``reference.stochastic_round_bf16``)."""
    return _round(x, key, step, offset)[0].reshape(x.shape)
