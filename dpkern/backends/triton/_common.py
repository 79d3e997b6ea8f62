"""Shared launch machinery of the Triton backend: configuration, device checks, and the
multi-tensor tables that let one launch cover many parameters.

Batching small tensors: pointer tables, not packing
---------------------------------------------------
An LLM has hundreds of parameters, from 1-element biases to 50M-element embeddings. One
launch per tensor would cost ~10-20 us of Python/driver overhead each (several ms per step
for GPT-2's ~150 tensors, more than the whole memory-bound step), and packing small
tensors into one buffer would add a copy of every byte we are trying to read once.
So every kernel here is a *multi-tensor* launch:

- a ``table`` (int64 ``[T, NCOL]``, one row per tensor) holds each tensor's element count,
  its noise offset (SPEC section 3), its noise phase (offset & 1) and the raw addresses of
  its buffers (parameter, grad_sample, summed, up to four states; 0 = absent); kernels
  turn an address back into a typed pointer with ``.to(tl.pointer_type(...))``;
- a ``chunk table`` (int32 ``[n_chunks, 2]``: tensor row, block index in the tensor)
  maps each program of a 1-D grid to one block of one tensor, so a 1-element bias costs
  one program, not one launch, and programs never straddle two tensors.

The chunk table depends only on the element counts (and phases), so it is cached per
parameter list; the address table (a few KiB) is cached by content, so a step whose
tensors kept their addresses copies nothing from the host. Tensors are grouped into launches by dtype (a kernel is
specialised on its pointer types) and by alignment: a group whose every address is
16-byte aligned, every element count a multiple of 16 and every noise offset even gets
``ALIGNED=True``, which lets the kernels promise the compiler 16-byte-aligned rows
(``tl.multiple_of``) so loads and stores vectorise; odd-sized tensors (biases of odd
length, scalars) go to a small unaligned group. GPT-2-sized models land in one or two
launches per kernel.

Nothing here depends on the block size or on how tensors are split into launches except
the launch layout itself: the noise of an element is a function of its global index only.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from .. import triton_interpret
from ...keys import reveal


# --------------------------------------------------------------------------------------
# Configuration (block sizes). Results never depend on it except for the rounding of
# reductions (norms, DP-MacAdam's sum); the noise and every element-wise result are
# bit-identical whatever the configuration (tested).
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    step_block: int = 1024  # elements per program in pass 2 / accumulate / noise
    norm_block: int = 1024  # elements per row per iteration in pass 1
    norm_iters: int = 4  # blocks per program in pass 1 (chunk = block * iters)
    reduce_block: int = 1024  # partial sums per iteration in pass 1's second stage
    rows_unroll: int = 4  # sample rows whose loads are issued together (pass 1, 2)
    num_warps: int = 4
    max_tensors_per_launch: int = 0  # 0: no limit (split only by dtype / alignment)

    def validate(self):
        for name in ("step_block", "norm_block", "reduce_block"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"invalid {name}={v!r}: a power of two >= 16")
        if self.rows_unroll < 1:
            raise ValueError(f"invalid rows_unroll={self.rows_unroll!r}: must be >= 1")
        if self.norm_iters < 1:
            raise ValueError(f"invalid norm_iters={self.norm_iters!r}: must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"invalid num_warps={self.num_warps!r}")
        if self.max_tensors_per_launch < 0:
            raise ValueError(f"invalid max_tensors_per_launch={self.max_tensors_per_launch!r}")


CONFIG = Config()


@contextmanager
def configure(**changes):
    """Temporarily change :data:`CONFIG` (tests, benchmarks): ``with configure(step_block=256):``."""
    global CONFIG
    old = CONFIG
    new = dataclasses.replace(old, **changes)
    new.validate()
    CONFIG = new
    try:
        yield new
    finally:
        CONFIG = old


def config() -> Config:
    return CONFIG


# Debug aid for tests: fill every buffer this backend allocates (outputs and partial
# sums) with NaN / -1 before the kernels run, so an element a kernel forgot shows.
POISON = False


def empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


# --------------------------------------------------------------------------------------
# Device checks
# --------------------------------------------------------------------------------------
@triton.jit
def _probe():
    pass


INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
EMULATE_RNE = tl.constexpr(INTERPRETED)  # see to_dtype_rne
# libdevice (__nv_logf, __nv_cosf, ...) is exact to an ulp on CUDA, where tl.log/tl.cos may
# lower to approximate PTX; the interpreter has no libdevice but its tl.* are numpy's.
LIBDEVICE = not INTERPRETED


def check_device(device) -> torch.device:
    """The device the kernels run on; a clear error for tensors they cannot reach."""
    device = torch.device(device)
    if device.type == ("cpu" if INTERPRETED else "cuda"):
        return device
    if device.type == "cuda":  # the tables hold raw addresses the interpreter reads on the host
        raise RuntimeError(
            "dpkern backend='triton' under TRITON_INTERPRET=1 runs on CPU "
            "tensors only; unset TRITON_INTERPRET to use the GPU"
        )
    if device.type == "cpu":
        hint = (
            "set TRITON_INTERPRET=1 before importing dpkern to run the kernels on CPU "
            "(slow; for tests)"
        )
        if triton_interpret():
            hint = (
                "TRITON_INTERPRET=1 was set after dpkern.backends.triton was imported; "
                "set it before"
            )
        raise RuntimeError(f"dpkern backend='triton' needs CUDA tensors, got CPU tensors: {hint}")
    raise RuntimeError(f"dpkern backend='triton' needs CUDA tensors, got {device.type} tensors")


def first_device(*groups):
    for group in groups:
        for t in group:
            if t is not None:
                return t.device
    return None


# --------------------------------------------------------------------------------------
# Contiguity: read-only inputs are made contiguous (a copy, only if needed); tensors that
# are updated in place and are not contiguous are updated through a contiguous copy that
# is written back (slow path, never taken for ordinary nn.Parameters and our states).
# --------------------------------------------------------------------------------------
class InPlace:
    """Contiguous stand-ins for tensors updated in place; ``finish()`` writes them back."""

    def __init__(self):
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.is_contiguous():
            return t
        c = t.detach().contiguous()
        self._back.append((t, c))
        return c

    def finish(self):
        for t, c in self._back:
            t.detach().copy_(c)
        self._back.clear()


def readonly(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------------------
# Multi-tensor tables
# --------------------------------------------------------------------------------------
# Columns of a table row (int64); kernels index rows with these constants. COL_S0 ..
# COL_S0 + MAX_STATES - 1 are the rule's kernel states in RuleSpec.kernel_states order
# (any shape: "row" / "col" states are addressed with COL_INNER and COL_MATRIX, the
# parameter's trailing dimension and trailing matrix size, dpkern.rules.factor_sizes).
MAX_STATES = 6
COL_NUMEL, COL_NOFF, COL_PHASE, COL_P, COL_G, COL_SUM, COL_S0 = (tl.constexpr(i) for i in range(7))
COL_INNER = tl.constexpr(COL_S0.value + MAX_STATES)
COL_MATRIX = tl.constexpr(COL_INNER.value + 1)
NCOL = tl.constexpr(COL_MATRIX.value + 1)
ALIGN_BYTES = 16

TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float64: tl.float64,
}


def tl_dtype(dtype: torch.dtype):
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dpkern backend='triton': unsupported dtype {dtype}") from None


@dataclasses.dataclass
class Entry:
    """One tensor of a multi-tensor launch. ``bufs`` = (param, grad_sample, summed, *states)."""

    index: int  # position in the caller's list
    numel: int
    noise_offset: int
    bufs: tuple  # tensors or None, in table column order from COL_P
    factors: tuple = (1, 0)  # (inner, matrix) of the parameter (COL_INNER, COL_MATRIX)


@dataclasses.dataclass
class Launch:
    entries: list[Entry]
    dtypes: tuple  # torch dtypes of the typed buffers (group key)
    aligned: bool
    table: torch.Tensor  # int64 [T, NCOL] on the device
    chunks: torch.Tensor  # int32 [n_chunks, 2] on the device
    n_chunks: int


def _is_aligned(e: Entry) -> bool:
    if e.numel % 16 or e.noise_offset & 1:
        return False
    return all(b is None or b.data_ptr() % ALIGN_BYTES == 0 for b in e.bufs)


class _LRU:
    """A small least-recently-used cache of device tables (keys hold the values the table
    is made from, so a hit is always right)."""

    def __init__(self, size: int = 64):
        self.size, self.items = size, OrderedDict()

    def get(self, key, make):
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
            return hit
        value = self.items[key] = make()
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_CHUNKS = _LRU()
_TABLES = _LRU()


def _chunk_table(numels: tuple, phases: tuple, chunk: int, device) -> torch.Tensor:
    """int32 [n_chunks, 2]: (row in the table, block index). A tensor of n elements with
    noise phase f (its first element has an odd global index) spans cdiv(n + f, chunk) blocks.
    Depends on the element counts only: cached per parameter list."""

    def make():
        counts = torch.tensor(
            [(n + f + chunk - 1) // chunk if n else 0 for n, f in zip(numels, phases)],
            dtype=torch.int64,
        )
        total = int(counts.sum())
        if total >= 2**31:
            raise ValueError("dpkern backend='triton': too many blocks for one launch")
        rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
        starts = torch.cumsum(counts, 0) - counts
        blocks = torch.arange(total) - torch.repeat_interleave(starts, counts)
        return torch.stack([rows, blocks], dim=1).to(torch.int32).to(device)

    return _CHUNKS.get((numels, phases, chunk, str(device)), make)


def _device_table(rows: list[list[int]], device) -> torch.Tensor:
    """The address table on the device, cached by content: parameters, states and
    accumulation buffers keep their addresses from step to step (and PyTorch's caching
    allocator often hands grad_samples the same ones), so steady-state steps copy nothing
    from the host."""
    return _TABLES.get(
        (tuple(map(tuple, rows)), str(device)),
        lambda: torch.tensor(rows, dtype=torch.int64).to(device),
    )


def plan(entries: list[Entry], typed: tuple[int, ...], chunk: int, device) -> list[Launch]:
    """Group entries into launches: same dtypes of the buffers at positions ``typed`` (of
    ``bufs``), same alignment class, at most ``max_tensors_per_launch`` each."""
    entries = [e for e in entries if e.numel]
    keys = [
        tuple(e.bufs[i].dtype if e.bufs[i] is not None else None for i in typed) for e in entries
    ]
    # A buffer absent in some entries (grad_sample None) takes the dtype seen elsewhere,
    # so that it does not cost a launch of its own.
    fill = []
    for j in range(len(typed)):
        seen = [k[j] for k in keys if k[j] is not None]
        fill.append(seen[0] if seen else torch.float32)
    groups: "OrderedDict[tuple, list[Entry]]" = OrderedDict()
    for e, k in zip(entries, keys):
        dts = tuple(d if d is not None else f for d, f in zip(k, fill))
        groups.setdefault((dts, _is_aligned(e)), []).append(e)
    limit = CONFIG.max_tensors_per_launch or len(entries) or 1
    launches = []
    for (dts, aligned), es in groups.items():
        for i in range(0, len(es), limit):
            part = es[i : i + limit]
            rows = []
            for e in part:
                row = [e.numel, e.noise_offset, e.noise_offset & 1]
                row += [b.data_ptr() if b is not None else 0 for b in e.bufs]
                row += [0] * (COL_INNER.value - len(row)) + list(e.factors)
                rows.append(row)
            table = _device_table(rows, device)
            chunks = _chunk_table(
                tuple(e.numel for e in part), tuple(e.noise_offset & 1 for e in part), chunk, device
            )
            launches.append(Launch(part, dts, aligned, table, chunks, chunks.shape[0]))
    return launches


def key_words(key: int) -> tuple[int, int]:
    """(K mod 2**32, K >> 32): passed separately so that no kernel argument needs uint64."""
    key = reveal(key)
    return key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF


def step_words(step: int, stream: int) -> tuple[int, int]:
    """Counter words c2, c3 of SPEC section 3."""
    return step & 0xFFFFFFFF, ((stream & 0xFFFF) << 16) | ((step >> 32) & 0xFFFF)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------
# Kernel-side table access (shared by all multi-tensor kernels)
# --------------------------------------------------------------------------------------
@triton.jit
def chunk_row(table, chunks, pid):
    """(table row pointer, block index in the tensor) of program ``pid``, both int64."""
    entry = chunks + pid.to(tl.int64) * 2
    tid = tl.load(entry).to(tl.int64)
    blk = tl.load(entry + 1).to(tl.int64)
    return table + tid * NCOL, blk


@triton.jit
def typed_ptr(row, col, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Column ``col`` of a table row as a pointer to DTYPE (16-byte aligned if ALIGNED)."""
    ptr = tl.load(row + col).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def row_numel(row, ALIGNED: tl.constexpr):
    numel = tl.load(row + COL_NUMEL)
    if ALIGNED:
        numel = tl.multiple_of(numel, 16)
    return numel


@triton.jit
def to_dtype_rne(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """float32 -> DTYPE rounded to nearest even (one rounding on store, as torch's copy_).

    The interpreter converts float32 -> bfloat16 by truncation whatever the requested
    rounding mode, so there (EMULATE) the bits are rounded first and the cast is exact."""
    if EMULATE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def to_bf16_sr(x, rho):
    """float32 -> bfloat16 rounded stochastically with the rounding bits ``rho`` (uint32 in
    [0, 2**16), SPEC 3.2): the high half of bits(x) + rho, as bf16 bits (a bitcast, no
    conversion: the interpreter's float32 -> bfloat16 cast mangles subnormals); a NaN
    becomes the quiet NaN of its high half (sign and top payload bits kept)."""
    bits = x.to(tl.uint32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(nan, (bits >> 16) | 0x40, (bits + rho) >> 16)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
