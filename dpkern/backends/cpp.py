"""The C++ CPU backend: :mod:`dpkern.backends.reference`'s functions, run by ``dpkern._C``.

Same names and signatures as the reference (``philox_words``, ``gaussian_noise``,
``normal_from_words``, ``per_sample_norms``, ``whitened_norms``, ``accumulate``, ``step``,
``macadam_update_scale``, ``supports``); same results within the tolerances of SPEC
section 6. The update rules are ``update_<name>`` in csrc/rules.h; their codes come from
the extension's own table (``_C.rule_codes()``), looked up by the registry's name.

The extension sees raw data pointers, so this module checks every buffer before calling in:
CPU, dense, the right dtype and size, and contiguous. Anything wrong is a ``ValueError``
naming the tensor, raised before any write (parameters and states stay untouched).

- Written buffers (parameters, optimizer states, accumulation buffers) must be contiguous:
  the kernels update them in place, and a silent copy would drop the update.
- Read-only inputs are taken as they come: a non-contiguous ``grad_sample`` (or
  ``summed``, ``clip_factors``) is copied to a contiguous tensor first. That copy is the
  only allocation proportional to B x d, and only for such inputs.

Importing this module raises ``ImportError`` when ``dpkern._C`` was not built; the backend
registry (:mod:`dpkern.backends`) relies on that. ``set_num_threads`` sets the number of
OpenMP threads the kernels use (the noise and every result are the same for any number).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import _C  # ImportError when the extension was not built
from .. import rules
from ..hyper import DPStep, Hyper
from ..keys import reveal

__all__ = [
    "philox_words",
    "gaussian_noise",
    "normal_from_words",
    "rounding_bits",
    "stochastic_round_bf16",
    "per_sample_norms",
    "whitened_norms",
    "accumulate",
    "step",
    "macadam_update_scale",
    "supports",
    "set_num_threads",
    "get_num_threads",
]

# Storage dtypes the kernels read and write (csrc/common.h, enum DType).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_increment_version = getattr(torch.autograd.graph, "increment_version", None)


def _rule_tables() -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """{rule name: code} of the rules the extension implements and {rule name: its kernel
    states in the order of the extension's state pointers}, checked against the registry:
    every name registered, codes distinct, the same state names (whitening rules: with
    exp_avg and scale in the slots the whitened sum reads)."""
    codes = dict(_C.rule_codes())
    order = {name: tuple(states) for name, states in _C.rule_states().items()}
    if set(order) != set(codes) or len(set(codes.values())) != len(codes):
        raise ImportError(f"dpkern._C: inconsistent rule tables {codes} / {order}")
    for name in codes:
        spec = rules.get(name)  # ValueError: the extension knows a rule the registry does not
        if sorted(order[name]) != sorted(spec.kernel_state_names):
            raise ImportError(
                f"dpkern._C: rule {name!r} has states {order[name]}, the registry "
                f"{spec.kernel_state_names}"
            )
        if spec.whitening and order[name][:1] + order[name][3:4] != ("exp_avg", "scale"):
            raise ImportError(f"dpkern._C: whitening rule {name!r}: exp_avg / scale slots")
    return codes, order


_RULE_CODES, _STATE_ORDER = _rule_tables()
_MAX_STATES = _C.max_states()


def supports(rule: str) -> bool:
    """Whether the extension implements the update rule ``rule`` (``dpkern.rules``)."""
    return rule in _RULE_CODES


def supports_rms_clip(rule: str) -> bool:
    """Whether the extension implements ``update_rms_clip`` (SPEC 10.9) for ``rule``."""
    return rule in _RMS_CLIP_RULES and supports(rule)


_RMS_CLIP_RULES = ("adamw", "adamw_bc", "adafactor")


def set_num_threads(n: int) -> None:
    """Threads used by the C++ kernels; ``n <= 0`` restores OpenMP's default."""
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    return _C.get_num_threads()


# --------------------------------------------------------------------------------------
# Buffer checks: every failure is a ValueError raised before the kernel runs.
# --------------------------------------------------------------------------------------
def _common(t, what: str) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: backend='cpp' needs CPU tensors, got device {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{what}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{what}: conjugate / negative views are not supported")


def _shape_ok(t: Tensor, shape, what: str) -> None:
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _output(t, what: str, shape, dtypes) -> Tensor:
    """A tensor the kernel writes in place: checked, never copied."""
    _common(t, what)
    if t.dtype not in dtypes:
        raise ValueError(f"{what}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _shape_ok(t, shape, what)
    if not t.is_contiguous():
        raise ValueError(
            f"{what}: must be contiguous (it is updated in place); got strides "
            f"{t.stride()} for shape {tuple(t.shape)}"
        )
    return t


def _input(t, what: str, shape, dtypes) -> Tensor:
    """A tensor the kernel only reads: checked, made contiguous if needed (a copy)."""
    _common(t, what)
    if t.dtype not in dtypes:
        raise ValueError(f"{what}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _shape_ok(t, shape, what)
    return t.contiguous()


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


_F32 = (torch.float32,)
_FLOATS = tuple(_DTYPE_CODES)


def _clip(clip_factors, batch_size: int) -> Tensor:
    return _input(clip_factors, "clip_factors", (batch_size,), _F32)


def _grad_samples(grad_samples, shapes, batch_size: int | None, what="grad_samples"):
    """Checked per-sample gradients ([B, *shape], contiguous) and their common B."""
    out = []
    for k, (gs, shape) in enumerate(zip(grad_samples, shapes, strict=True)):
        if gs is None:
            out.append(None)
            continue
        _common(gs, f"{what}[{k}]")
        if gs.dim() < 1:
            raise ValueError(f"{what}[{k}]: expected shape [B, *{tuple(shape)}], got a 0-d tensor")
        if batch_size is None:
            batch_size = gs.shape[0]
        out.append(_input(gs, f"{what}[{k}]", (batch_size, *shape), _FLOATS))
    return out, batch_size


def _hyper_dict(hyper: Hyper) -> dict:
    """The rule's code (by name) and every field of its dataclass by name: floats, bools,
    strings (the extension maps those by name too and refuses keys it does not know);
    except ``update_rms_clip``, which the host turns into pass B's scale (SPEC 10.9).

    Raises NotImplementedError for a rule the extension does not implement."""
    code = _RULE_CODES.get(hyper.rule)
    if code is None:
        raise NotImplementedError(
            f"dpkern backend='cpp' has no kernel for the update rule {hyper.rule!r} "
            "(use backend='torch' or 'auto')"
        )
    d = {"rule": code}
    for f in dataclasses.fields(hyper):
        if f.name == "update_rms_clip":  # the host forms the scale (SPEC 10.9)
            continue
        value = getattr(hyper, f.name)
        d[f.name] = value if isinstance(value, (bool, str)) else float(value)
    return d


def _keyed(fn, *args):
    """``fn(*args)`` for an extension entry point whose arguments hold the noise key: a
    pybind11 signature mismatch (TypeError) lists every argument ("Invoked with: ..."),
    the key among them, so it is re-raised without them, and this frame drops them."""
    try:
        return fn(*args)
    except TypeError:
        pass
    args = None  # (no frame of the traceback holds the key)
    raise TypeError(
        f"dpkern._C.{getattr(fn, '__name__', 'kernel')}: the arguments did not match the "
        "extension's signature (not shown: they hold the noise key); rebuild dpkern "
        "(pip install -e .) so that the extension matches this Python code"
    ) from None


def _dp_tuple(dp: DPStep) -> tuple:
    return (
        reveal(dp.key),
        dp.step,
        dp.stream,
        float(dp.noise_std),
        float(dp.expected_batch_size),
        float(dp.noise_var_avg),
        dp.noise_step,
        bool(dp.stochastic_rounding),
    )


def _states(hyper: Hyper, states: dict, params) -> list[list[Tensor | None]]:
    """Checked kernel states of each parameter, in the extension's slot order, by name
    (fp32, contiguous, each shaped as its StateSpec says; None where the hyper-parameters
    do not need it)."""
    spec = rules.of(hyper)
    if len(spec.kernel_states) > _MAX_STATES:
        raise NotImplementedError(f"dpkern._C holds at most {_MAX_STATES} states per rule")
    out = [[] for _ in params]
    for name in _STATE_ORDER[hyper.rule]:
        st = spec.state(name)
        if not st.is_needed(hyper):
            for row in out:
                row.append(None)
            continue
        if name not in states or len(states[name]) != len(params):
            raise ValueError(f"states[{name!r}]: expected one tensor per parameter ({len(params)})")
        for k, (s, p) in enumerate(zip(states[name], params, strict=True)):
            out[k].append(_output(s, f"states[{name!r}][{k}]", st.shape_for(p.shape), _F32))
    return out


def _bump(tensors) -> None:
    """Tell autograd that these tensors were modified in place (as copy_() would)."""
    if _increment_version is not None:
        for t in tensors:
            if t is not None:
                _increment_version(t)


# --------------------------------------------------------------------------------------
# Noise stream v1 (SPEC section 3)
# --------------------------------------------------------------------------------------
def philox_words(index: Tensor, *, key: int, step: int, stream: int = 0) -> Tensor:
    """int64 ``[n, 4]``: the Philox words (r0, r1, r2, r3) of global element indices ``index``."""
    index = _input(index, "index", None, (torch.int64,))
    if index.dim() != 1:
        raise ValueError(f"index: expected a 1-d tensor, got shape {tuple(index.shape)}")
    if index.numel() and int(index.min()) < 0:
        raise ValueError("index: global element indices must be >= 0")
    out = torch.empty((index.numel(), 4), dtype=torch.int64)
    _keyed(_C.philox_words, _ptr(index), index.numel(), reveal(key), step, stream, _ptr(out))
    return out


def gaussian_noise(
    numel: int, *, key: int, step: int, offset: int = 0, stream: int = 0, device=None
) -> Tensor:
    """z for global elements ``offset ... offset + numel - 1``: float32 ``[numel]``."""
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: backend='cpp' needs CPU tensors, got device {device}")
    if numel < 0 or offset < 0 or offset + numel > 2**64:
        raise ValueError(f"invalid numel={numel} / offset={offset}")
    out = torch.empty(numel, dtype=torch.float32)
    _keyed(_C.gaussian_noise, _ptr(out), numel, reveal(key), step, offset, stream)
    return out


def normal_from_words(words: Tensor) -> Tensor:
    """The word -> normal transform alone: int64 ``[n, 4]`` words -> float32 ``[n, 2]``
    (z of lane 0, lane 1). For tests of SPEC section 3's ``transform_cases``."""
    w = _input(words, "words", None, (torch.int64,))
    if w.dim() != 2 or w.shape[1] != 4:
        raise ValueError(f"words: expected shape [n, 4], got {tuple(w.shape)}")
    w = (w & 0xFFFFFFFF).to(torch.int32)  # the same 32-bit patterns, as the kernel reads them
    out = torch.empty((w.shape[0], 2), dtype=torch.float32)
    _C.normal_from_words(_ptr(w), w.shape[0], _ptr(out))
    return out


# --------------------------------------------------------------------------------------
# The rounding stream (SPEC section 3.2)
# --------------------------------------------------------------------------------------
def rounding_bits(numel: int, *, key: int, step: int, offset: int = 0, device=None) -> Tensor:
    """rho_j of global elements ``offset ... offset + numel - 1``: int64 ``[numel]`` in
    [0, 2**16) (``reference.rounding_bits``)."""
    _check_device(device)
    if numel < 0 or offset < 0 or offset + numel > 2**64:
        raise ValueError(f"invalid numel={numel} / offset={offset}")
    out = torch.empty(numel, dtype=torch.int64)
    _keyed(_C.rounding_bits, _ptr(out), numel, reveal(key), step, offset)
    return out


def stochastic_round_bf16(x: Tensor, *, key: int, step: int, offset: int = 0) -> Tensor:
    """float32 ``x`` rounded stochastically to bfloat16 (``reference.stochastic_round_bf16``)."""
    x = _input(x.detach(), "x", None, _F32)
    if offset < 0 or offset + x.numel() > 2**64:
        raise ValueError(f"invalid offset={offset}")
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _keyed(_C.stochastic_round_bf16, _ptr(x), x.numel(), reveal(key), step, offset, _ptr(out))
    return out


# --------------------------------------------------------------------------------------
# Pass 1: per-sample norms (SPEC sections 2 and 7)
# --------------------------------------------------------------------------------------
def _flat(gs: Tensor | None, numel: int) -> tuple:
    return (_ptr(gs), _DTYPE_CODES[gs.dtype] if gs is not None else 0, numel)


def _check_batch(batch_size: int) -> int:
    if not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"invalid batch_size={batch_size!r}: expected an int >= 0")
    return batch_size


def _check_device(device) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: backend='cpp' needs CPU tensors, got device {device}")


def per_sample_norms(grad_samples: list[Tensor | None], batch_size: int, device) -> Tensor:
    """n_i = sqrt(sum_p ||grad_sample_p[i]||^2), fp32 accumulation: float32 ``[B]``."""
    _check_batch(batch_size)
    _check_device(device)
    shapes = [
        gs.shape[1:] if isinstance(gs, Tensor) and gs.dim() >= 1 else () for gs in grad_samples
    ]
    gss, _ = _grad_samples(grad_samples, shapes, batch_size)
    out = torch.empty(batch_size, dtype=torch.float32)
    flats = [_flat(gs, gs.shape[1:].numel()) for gs in gss if gs is not None]
    _C.per_sample_norms(flats, batch_size, _ptr(out))
    return out


def whitened_norms(
    grad_samples: list[Tensor | None],
    exp_avgs: list[Tensor],
    scales: list[Tensor],
    bias_correction1: float,
    batch_size: int,
    device,
) -> Tensor:
    """||w_i|| over all coordinates (DP-MacAdam pass 1): float32 ``[B]``."""
    _check_batch(batch_size)
    _check_device(device)
    if not (len(grad_samples) == len(exp_avgs) == len(scales)):
        raise ValueError("grad_samples, exp_avgs and scales must have the same length")
    ms = [_input(m, f"exp_avgs[{k}]", None, _F32) for k, m in enumerate(exp_avgs)]
    bs = [
        _input(b, f"scales[{k}]", m.shape, _F32)
        for k, (b, m) in enumerate(zip(scales, ms, strict=True))
    ]
    gss, _ = _grad_samples(grad_samples, [m.shape for m in ms], batch_size)
    out = torch.empty(batch_size, dtype=torch.float32)
    _C.whitened_norms(
        [_flat(gs, m.numel()) for gs, m in zip(gss, ms, strict=True)],
        [_ptr(m) for m in ms],
        [_ptr(b) for b in bs],
        float(bias_correction1),
        batch_size,
        _ptr(out),
    )
    return out


# --------------------------------------------------------------------------------------
# Pass 2 (SPEC sections 2, 4, 5, 7)
# --------------------------------------------------------------------------------------
def _param_tuple(data, numel, offset, gs, summed, states) -> tuple:
    return (
        _ptr(data),
        _DTYPE_CODES[data.dtype],
        numel,
        offset,
        _ptr(gs),
        _DTYPE_CODES[gs.dtype] if gs is not None else 0,
        _ptr(summed),
        [_ptr(s) for s in states],
        *rules.factor_sizes(data.shape),
        data.dim(),  # a factored rule (DP-Adafactor) factors >= 2-D parameters only
    )


def _batch_of(grad_samples, clip_factors) -> int:
    if clip_factors is not None:
        _common(clip_factors, "clip_factors")
        if clip_factors.dim() != 1:
            raise ValueError(f"clip_factors: expected shape [B], got {tuple(clip_factors.shape)}")
        return clip_factors.shape[0]
    for gs in grad_samples:
        if gs is not None:
            raise ValueError("clip_factors is None but a grad_sample was given")
    return 0


def accumulate(
    hyper: Hyper,
    dp: DPStep,
    grad_samples: list[Tensor | None],
    clip_factors: Tensor,
    buffers: list[Tensor],
    states: dict[str, list[Tensor]],
) -> None:
    """buffers[k] += sum_i c_i x_i (x = per-sample gradient, or whitened for MacAdam)."""
    if len(grad_samples) != len(buffers):
        raise ValueError("grad_samples and buffers must have the same length")
    if clip_factors is None:
        raise ValueError("clip_factors: required by accumulate")
    batch = _batch_of(grad_samples, clip_factors)
    bufs = [_output(b, f"buffers[{k}]", None, _F32) for k, b in enumerate(buffers)]
    clip = _clip(clip_factors, batch)
    gss, _ = _grad_samples(grad_samples, [b.shape for b in bufs], batch)
    rows = [[] for _ in bufs]
    hyper_dict = _hyper_dict(hyper)  # NotImplementedError for a rule without a kernel
    if rules.of(hyper).whitening:  # reads exp_avg and scale (whitening), writes no state
        read = ("exp_avg", "scale")
        for name in read:
            if name not in states or len(states[name]) != len(bufs):
                raise ValueError(f"states[{name!r}]: expected one tensor per buffer ({len(bufs)})")
        rows = [
            [
                _input(states[n][k], f"states[{n!r}][{k}]", b.shape, _F32) if n in read else None
                for n in _STATE_ORDER[hyper.rule]
            ]
            for k, b in enumerate(bufs)
        ]
    params = [
        _param_tuple(b, b.numel(), 0, gs, None, row)
        for b, gs, row in zip(bufs, gss, rows, strict=True)
    ]
    _keyed(_C.accumulate, hyper_dict, _dp_tuple(dp), params, _ptr(clip), batch)
    _bump(bufs)


def step(
    hyper: Hyper,
    dp: DPStep,
    params: list[Tensor],
    grad_samples: list[Tensor | None],
    clip_factors: Tensor | None,
    summed: list[Tensor | None],
    states: dict[str, list[Tensor]],
    offsets: list[int],
) -> float:
    """One DP step of one parameter group, in place on ``params`` and ``states``.

    Returns the group's partial sum of sqrt(S_hat_j) for DP-MacAdam (0.0 otherwise)."""
    return _step(_hyper_dict(hyper), hyper, dp, params, grad_samples, clip_factors, summed,
                 states, offsets)  # fmt: skip


def rms_clip_moments(
    hyper: Hyper,
    dp: DPStep,
    params: list[Tensor],
    grad_samples: list[Tensor | None],
    clip_factors: Tensor | None,
    summed: list[Tensor | None],
    states: dict[str, list[Tensor]],
    offsets: list[int],
) -> tuple[float, tuple]:
    """update_rms_clip's pass A (SPEC 10.9, ``reference.rms_clip_moments``): the shared
    prologue and the moments, no parameter write. Returns (the group's sum of U^2, the
    pending pass B for :func:`rms_clip_apply`)."""
    if not supports_rms_clip(hyper.rule):
        raise NotImplementedError(
            f"dpkern backend='cpp' does not implement update_rms_clip for {hyper.rule!r}"
        )
    hd = {**_hyper_dict(hyper), "rms_phase": 1.0}
    # DP-Adafactor (a tensor phase): pass A leaves U in an fp32 scratch per parameter,
    # kept here for pass B (the kernel's slot after the states)
    scratch = None
    if hyper.rule == "adafactor":
        scratch = [torch.empty(p.shape, dtype=torch.float32) for p in params]
    uu = _step(hd, hyper, dp, params, grad_samples, clip_factors, summed, states, offsets,
               scratch)  # fmt: skip
    return uu, (hyper, dp, params, states, offsets, scratch)


def rms_clip_apply(pending, scale: float) -> None:
    """update_rms_clip's pass B (SPEC 10.9), s = ``scale``, no noise drawn: DP-AdamW(-BC)
    p <- p (1 - lr wd) - ((lr s) m_hat) / denom from the stored moments; DP-Adafactor
    p <- p (1 - lr wd) - ((alpha_t / denom) s) U from pass A's U."""
    hyper, dp, params, states, offsets, scratch = pending
    hd = {**_hyper_dict(hyper), "rms_phase": 2.0, "rms_scale": float(scale)}
    none = [None] * len(params)
    _step(hd, hyper, dp, params, none, None, none, states, offsets, scratch)


def _step(hyper_dict, hyper, dp, params, grad_samples, clip_factors, summed, states, offsets,
          scratch=None):  # fmt: skip
    n = len(params)
    if not (len(grad_samples) == len(summed) == len(offsets) == n):
        raise ValueError(
            f"params ({n}), grad_samples ({len(grad_samples)}), summed "
            f"({len(summed)}) and offsets ({len(offsets)}) must match"
        )
    ps = [_output(p, f"params[{k}]", None, _FLOATS) for k, p in enumerate(params)]
    batch = _batch_of(grad_samples, clip_factors)
    clip = _clip(clip_factors, batch) if clip_factors is not None else None
    gss, _ = _grad_samples(grad_samples, [p.shape for p in ps], batch)
    sums = [
        None if s is None else _input(s, f"summed[{k}]", p.shape, _F32)
        for k, (s, p) in enumerate(zip(summed, ps, strict=True))
    ]
    st = _states(hyper, states, ps)
    if scratch is not None:  # a tensor phase's g_hat / U buffer, in the slot after the states
        for row, buf in zip(st, scratch, strict=True):
            row.append(buf)
    end = 0
    for k, (off, p) in enumerate(zip(offsets, ps, strict=True)):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"offsets[{k}]: expected an int >= 0, got {off!r}")
        end = max(end, off + p.numel())
    if end > 2**64:
        raise ValueError("offsets: the noise index space ends at 2**64")
    _check_distinct(ps, st)
    tuples = [
        _param_tuple(p, p.numel(), off, gs, s, row)
        for p, off, gs, s, row in zip(ps, offsets, gss, sums, st, strict=True)
    ]
    out = _keyed(_C.step, hyper_dict, _dp_tuple(dp), tuples, _ptr(clip), batch)
    _bump(ps)
    _bump(s for row in st for s in row)
    return out


def _check_distinct(params, states) -> None:
    """Written buffers must not share memory (an aliased state would be updated twice)."""
    seen = {}
    for k, (p, row) in enumerate(zip(params, states, strict=True)):
        for what, t in [(f"params[{k}]", p)] + [
            (f"state {j} of params[{k}]", s) for j, s in enumerate(row)
        ]:
            if t is None or t.numel() == 0:
                continue
            ptr = t.data_ptr()
            if ptr in seen:
                raise ValueError(f"{what} shares memory with {seen[ptr]}")
            seen[ptr] = what


def macadam_update_scale(
    hyper: Hyper, dp: DPStep, exp_vars: list[Tensor], scales: list[Tensor], sqrt_sum: float
) -> None:
    """b <- S_hat^(1/4) * (sum_j S_hat_j^(1/2))^(1/2) for every parameter (t >= 2)."""
    if len(exp_vars) != len(scales):
        raise ValueError("exp_vars and scales must have the same length")
    ss = [_input(s, f"exp_vars[{k}]", None, _F32) for k, s in enumerate(exp_vars)]
    bs = [
        _output(b, f"scales[{k}]", s.shape, _F32)
        for k, (b, s) in enumerate(zip(scales, ss, strict=True))
    ]
    if dp.step < 2:
        return
    _C.macadam_update_scale(
        _hyper_dict(hyper),
        _dp_tuple(dp),
        [_ptr(s) for s in ss],
        [_ptr(b) for b in bs],
        [b.numel() for b in bs],
        float(sqrt_sum),
    )
    _bump(bs)
