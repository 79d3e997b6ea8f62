"""The fused Triton ghost-norm kernel (dpkern.ghost.triton_norms) against the PyTorch
reference (dpkern.ghost.norms.outer_norm_sq, Gram path) and a float64 einsum.

Run in their own process: ``TRITON_INTERPRET=1 python -m pytest -m triton
tests/test_ghost_triton.py`` (small shapes: the interpreter is slow); on a CUDA machine
without the variable they run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from dpkern.backends import triton_interpret

pytestmark = pytest.mark.triton

triton_norms = pytest.importorskip("dpkern.ghost.triton_norms")


@pytest.fixture
def device():
    if torch.cuda.is_available() and not triton_interpret():
        return torch.device("cuda")
    if not triton_interpret():
        pytest.skip("run with TRITON_INTERPRET=1 (tests/run.sh does) or on CUDA")
    return torch.device("cpu")


def exact(out, inp):
    return torch.einsum("btp,btd->bpd", out.double(), inp.double()).square().sum((1, 2))


# T: one partial tile, several tiles with a ragged last one; P: below / above BLOCK_K
@pytest.mark.parametrize("B,T,P0,P1", [(2, 5, 7, 3), (3, 37, 40, 18), (1, 16, 16, 16)])
def test_kernel_matches_reference(device, B, T, P0, P1):
    from dpkern.ghost.norms import outer_norm_sq

    out = torch.randn(B, T, P0, device=device)
    inp = torch.randn(B, T, P1, device=device)
    got = triton_norms.gram_norm_sq(out, inp, block_t=16, block_k=16)
    ref = outer_norm_sq(out, inp, method="gram")
    assert got.dtype == torch.float32 and got.shape == (B,)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.double(), exact(out, inp), rtol=1e-5, atol=0)


def test_kernel_strides_dtypes_and_determinism(device):
    base = torch.randn(2, 20, 24, device=device)
    out = base[:, :, :18]  # non-contiguous rows
    inp = torch.randn(2, 9, 20, device=device).transpose(1, 2)  # [2, 20, 9], strided
    got = triton_norms.gram_norm_sq(out, inp, block_t=16, block_k=16)
    torch.testing.assert_close(got.double(), exact(out, inp), rtol=1e-5, atol=0)
    again = triton_norms.gram_norm_sq(out, inp, block_t=16, block_k=16)
    assert torch.equal(got, again)  # no atomics: bit-identical reruns
    half = triton_norms.gram_norm_sq(out.bfloat16(), inp.bfloat16(), block_t=16, block_k=16)
    torch.testing.assert_close(
        half.double(), exact(out.bfloat16(), inp.bfloat16()), rtol=1e-5, atol=0
    )  # bf16 inputs, fp32 accumulation


def test_kernel_edge_cases(device):
    z = triton_norms.gram_norm_sq(
        torch.zeros(0, 4, 3, device=device), torch.zeros(0, 4, 5, device=device)
    )
    assert z.shape == (0,)
    with pytest.raises(ValueError, match="block_t"):
        triton_norms.gram_norm_sq(torch.zeros(1, 4, 3), torch.zeros(1, 4, 5), block_t=24)
    with pytest.raises(ValueError, match=r"\[B, T, P0\]"):
        triton_norms.gram_norm_sq(torch.zeros(1, 4, 3), torch.zeros(1, 5, 5))


def test_ghost_clipping_uses_kernel(device, monkeypatch):
    """GhostClipping(backend="triton") runs the kernel and gives the reference's sums."""
    import dpkern
    from dpkern.ghost import GhostClipping

    calls = []
    kernel = triton_norms.gram_norm_sq
    monkeypatch.setattr(
        triton_norms, "gram_norm_sq", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 20), torch.nn.Tanh(), torch.nn.Linear(20, 18)
    ).to(device)
    x = torch.randn(3, 6, 24, device=device)  # T(d+p) <= dp: the Gram path
    results = []
    for backend in ("torch", "triton"):
        opt = dpkern.DPSGD(
            model.parameters(),
            lr=0.1,
            max_grad_norm=0.5,
            noise_multiplier=0.0,
            expected_batch_size=3,
            seed=0,
            backend="torch",
        )
        # keep_bytes=0: every parameter takes the ghost route (no kept per-sample gradients)
        with GhostClipping(model, opt, backend=backend, keep_bytes=0) as gc:
            results.append(gc.clipped_sums(model(x).square().sum((1, 2))))
    (s_ref, n_ref), (s_tri, n_tri) = results
    assert len(calls) == 2  # both weights take the Gram path
    torch.testing.assert_close(n_tri, n_ref, rtol=1e-5, atol=0)
    for a, b in zip(s_tri, s_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _raw_kernel(out, inp, block_t=32, block_k=32):
    """The kernel's unclamped per-sample sums (gram_norm_sq's two launches, no clamp)."""
    B, T, P0 = out.shape
    n_tiles = triton_norms.triton.cdiv(T, block_t)
    partial = torch.empty(B, n_tiles, dtype=torch.float32, device=out.device)
    res = torch.zeros(B, dtype=torch.float32, device=out.device)
    triton_norms._ghost_norm_kernel[(B, n_tiles)](
        out,
        inp,
        partial,
        T,
        P0,
        inp.shape[2],
        *out.stride(),
        *inp.stride(),
        n_tiles,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
    )
    triton_norms._sum_rows_kernel[(B,)](partial, res, n_tiles, BLOCK=16)
    return res


def test_kernel_rounding_negative_is_clamped(device):
    """Two tokens with inputs a, a + 1e-3 e and output gradients v, -v: the per-sample
    gradient is ~0 but the Gram terms ~|a|^2 |v|^2 cancel, and float32 rounding makes the
    sum negative for some samples; sqrt of it was a NaN (a finite sample reported
    non-finite). The kernel's result is clamped at 0."""
    g = torch.Generator().manual_seed(0)
    B, d, p = 64, 64, 64
    a = torch.randn(B, 1, d, generator=g) * 30
    inp = torch.cat([a, a + 1e-3 * torch.randn(B, 1, d, generator=g)], 1).to(device)
    v = torch.randn(B, 1, p, generator=g)
    out = torch.cat([v, -v], 1).to(device)
    raw = _raw_kernel(out, inp)
    assert (raw < 0).any()
    got = triton_norms.gram_norm_sq(out, inp)
    assert got.dtype == torch.float32 and (got >= 0).all()
    torch.testing.assert_close(got, raw.clamp_min(0), rtol=0, atol=0)
    bad = out.clone()
    bad[1, 0, 0] = float("nan")
    assert torch.isnan(triton_norms.gram_norm_sq(bad, inp)[1])  # NaN stays non-finite


def test_kernel_float64_inputs_keep_float64(device):
    """Float64 inputs (a float64 model) are not narrowed to the kernel's float32."""
    out = torch.randn(3, 9, 7, dtype=torch.float64, device=device)
    inp = torch.randn(3, 9, 5, dtype=torch.float64, device=device)
    got = triton_norms.gram_norm_sq(out, inp)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, exact(out, inp), rtol=1e-12, atol=0)
