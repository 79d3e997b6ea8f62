"""Ghost clipping refuses every operation that mixes the samples along dim 0.

The batch layout rule (:mod:`dpkern.ghost.batch`) is an allowlist: a tensor keeps the
samples in dim 0 (LEAD) only through operations known to keep them apart (element-wise
ops whose sample-dependent inputs have the output's rank, row-wise ops along a dim other
than 0, matmuls whose batch operand keeps its dim 0, views that keep dim 0, ...). Any
other operation makes its output's layout unknown, and a trainable parameter (or the
loss) that then depends on it is refused. Each mixing case below sits between the input
and a trainable ``nn.Linear``; the controls keep the samples apart and stay exact against
a one-sample-at-a-time autograd loop.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import case_seed

pytest.importorskip("transformers")  # (test_ghost's helpers need it at import)
from test_ghost import assert_norms_match, ghost_sums  # noqa: E402

B, D_IN, D = 4, 6, 4  # D == B: a reduction over the batch keeps the shape [B, D]


def _centre(h):
    n = h.shape[0]
    return (torch.eye(n) - torch.full((n, n), 1.0 / n)) @ h


def _index(h):
    return torch.tensor([0, 0, 1, 1])[: h.shape[0]]


def _col_index(h):
    return (h[:, 0] > 0).long() + torch.arange(h.shape[0]) % 2  # sample-dependent


def _adv_front(h):
    n = h.shape[0]
    h4 = h[:, None, :, None].expand(n, 2, h.shape[1], 2)
    a, z = torch.arange(n) % 2, torch.zeros(n, dtype=torch.long)
    return h4[:, a, :, z].sum(1)  # non-adjacent advanced indices: [n (index), n, D]


def _conv_unbatched(h):
    w = torch.ones(h.shape[0], h.shape[0], 1) / h.shape[0]
    return F.conv1d(h, w)  # 2-D input: dim 0 is read as channels


class _LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(D, D, batch_first=False)

    def forward(self, h):  # [B, 1, D] time-major: the samples are the time steps
        return self.rnn(h[:, None])[0][:, 0]


#: name -> h [B, D] -> a tensor whose rows mix the samples
MIXING = {
    "centring matmul M @ h": _centre,
    "torch.mm(M, h)": lambda h: torch.mm(torch.ones(h.shape[0], h.shape[0]), h),
    "torch.matmul(M, h)": lambda h: torch.matmul(torch.ones(h.shape[0], h.shape[0]), h),
    "addmm(h, M, h)": lambda h: torch.addmm(h, torch.ones(h.shape[0], h.shape[0]), h),
    "torch.sparse.mm(A, h)": lambda h: torch.sparse.mm(
        torch.ones(h.shape[0], h.shape[0]).to_sparse() / h.shape[0], h
    ),
    "sort(h, 0)": lambda h: torch.sort(h, 0).values,
    "cummax(h, 0)": lambda h: torch.cummax(h, 0).values,
    "cummin(h, 0)": lambda h: torch.cummin(h, 0).values,
    "logcumsumexp(h, 0)": lambda h: torch.logcumsumexp(h, 0),
    "scatter_add dim 0": lambda h: torch.zeros_like(h).scatter_add(
        0, torch.zeros_like(h, dtype=torch.long), h
    ),
    "scatter dim 0": lambda h: torch.zeros_like(h).scatter(
        0, torch.zeros_like(h, dtype=torch.long), h
    ),
    "index_add dim 0": lambda h: torch.zeros_like(h).index_add(0, _index(h), h),
    "index_copy dim 0": lambda h: torch.zeros_like(h).index_copy(
        0, torch.arange(h.shape[0]).flip(0), h
    ),
    "take_along_dim 0": lambda h: torch.take_along_dim(
        h, torch.zeros(h.shape, dtype=torch.long), 0
    ),
    "fft over dim 0": lambda h: torch.fft.fft(h, dim=0).real,
    "ifft over dim 0": lambda h: torch.fft.ifft(h, dim=0).real,
    "fftn": lambda h: torch.fft.fftn(h).real,
    "nanmean(h, 0)": lambda h: h - torch.nanmean(h, 0),
    "median(h, 0)": lambda h: h - torch.median(h, 0).values,
    "var_mean(h, 0)": lambda h: h - torch.var_mean(h, 0)[1],
    "std_mean(h, 0)": lambda h: h - torch.std_mean(h, 0)[0],
    "nansum(h, 0)": lambda h: h - torch.nansum(h, 0),
    "quantile(h, dim=0)": lambda h: h - torch.quantile(h, 0.5, dim=0),
    "mode(h, 0)": lambda h: h - torch.mode(h, 0).values,
    "kthvalue(h, 2, 0)": lambda h: h - torch.kthvalue(h, 2, 0).values,
    "aminmax(h, dim=0)": lambda h: h - torch.aminmax(h, dim=0).min,
    "diff(h, dim=0, prepend)": lambda h: torch.diff(h, dim=0, prepend=h[:1]),
    "roll(h, 1, 0)": lambda h: torch.roll(h, 1, 0),
    "roll(h, 1) (flattened)": lambda h: torch.roll(h, 1),
    "h.norm(1, 0)": lambda h: h / h.norm(1, 0),
    "stack(dim=-3)": lambda h: torch.stack([h] * h.shape[0], dim=-3).sum(1),
    "expand to a new dim 0": lambda h: h.expand(h.shape[0], *h.shape).sum(1),
    "broadcast [K,1,D] - [B,D], K == B": lambda h: (torch.ones(h.shape[0], 1, h.shape[1]) - h).sum(
        1
    ),
    "broadcast: lower-rank operand": lambda h: h[:, :1] - h[:, 0],  # [B,1] - [B] -> [B,B]
    "mse_loss broadcast": lambda h: F.mse_loss(h[:, :1], h[:, 0], reduction="none"),
    "getitem [..., perm] of a 1-D": lambda h: h.sum(1)[..., [3, 2, 1, 0]][:, None].expand(
        -1, h.shape[1]
    ),
    "getitem non-adjacent advanced": _adv_front,
    "getitem sample-dependent column": lambda h: h[:, _col_index(h)],
    "cdist(h, h)": lambda h: torch.cdist(h, h),
    "embedding table of sample rows": lambda h: F.embedding(torch.arange(h.shape[0]).flip(0), h),
    "sdpa on 2-D": lambda h: F.scaled_dot_product_attention(h, h, h),
    "conv1d on an unbatched 2-D": _conv_unbatched,
}


class Head(nn.Module):
    """frozen Linear -> tanh -> mix -> trainable Linear (fine-tuning a head)."""

    def __init__(self, mix, extra=None):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D_IN, D), nn.Linear(D, 3)
        self.extra = extra
        self.l1.requires_grad_(False)
        if extra is not None:
            extra.requires_grad_(False)
        self.mix = mix

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return self.l2(self.extra(h) if self.extra is not None else self.mix(h))


def _truth_mixes(model, x, loss):
    """Sample 0's loss depends on the other samples (the case is not vacuous)."""
    xg = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(loss(model, xg)[0], xg)
    return float(dx[1:].abs().max()) > 0


@pytest.mark.parametrize("verify", ["off", "first"])
@pytest.mark.parametrize("name", list(MIXING))
def test_mixing_op_before_a_trainable_linear_is_refused(name, verify):
    torch.manual_seed(case_seed(list(MIXING).index(name)))
    model = Head(MIXING[name])
    x = torch.randn(B, D_IN)
    with pytest.raises(
        ValueError, match=r"not provably one row per sample in dim 0.*in l2, consuming l2\."
    ) as err:
        ghost_sums(model, x, verify=verify)
    # the message names the operation that mixed the samples, and what to do instead
    assert "The samples were mixed or their rows moved by " in str(err.value)
    assert "per-sample normalisation" in str(err.value)


def test_time_major_lstm_over_the_samples_is_refused():
    torch.manual_seed(case_seed(50))
    model = Head(None, extra=_LSTM())
    with pytest.raises(
        ValueError, match=r"not provably one row per sample in dim 0.*in l2, consuming l2\."
    ):
        ghost_sums(model, torch.randn(B, D_IN))


@pytest.mark.parametrize(
    "name", ["centring matmul M @ h", "sort(h, 0)", "scatter_add dim 0", "fft over dim 0"]
)
def test_mixing_op_after_a_trainable_linear_is_refused(name):
    """The mixing op between a trainable and a frozen Linear: the losses are refused."""
    torch.manual_seed(case_seed(60))
    model = Head(MIXING[name])
    model.l1.requires_grad_(True)
    model.l2.requires_grad_(False)
    x = torch.randn(B, D_IN)
    assert _truth_mixes(model, x, lambda m, x: m(x).square().sum(1))
    with pytest.raises(ValueError, match=r"losses depend on .* without a proven batch"):
        ghost_sums(model, x)


class GCN(nn.Module):
    """One graph convolution, aggregate then transform: ``lin(A @ X)``; nodes = samples."""

    def __init__(self, sparse):
        super().__init__()
        self.lin, self.sparse = nn.Linear(D_IN, 3), sparse

    def forward(self, x):
        n = x.shape[0]
        a = torch.ones(n, n) / n
        return self.lin(torch.sparse.mm(a.to_sparse(), x) if self.sparse else a @ x)


@pytest.mark.parametrize("sparse", [False, True])
def test_gcn_over_the_samples_is_refused(sparse):
    torch.manual_seed(case_seed(70))
    with pytest.raises(
        ValueError, match=r"not provably one row per sample in dim 0.*consuming lin\."
    ):
        ghost_sums(GCN(sparse), torch.randn(8, D_IN))


def test_setitem_copying_a_row_into_another_is_refused():
    def copy_row(h):
        h2 = h.clone()
        h2[0] = h[1]  # sample 0's row now holds sample 1's data
        return h2

    torch.manual_seed(case_seed(90))
    with pytest.raises(ValueError, match=r"not provably one row per sample in dim 0"):
        ghost_sums(Head(copy_row), torch.randn(B, D_IN))


# -- controls: ops that keep the samples apart stay exact ---------------------------------
def _w(*shape):
    g = torch.Generator().manual_seed(7)
    return torch.randn(*shape, generator=g)


CONTROLS = {
    "element-wise": lambda h: torch.where(h > 0, h, 0.1 * h) * _w(D) + h.square() - 1,
    "row softmax": lambda h: h.softmax(-1) + F.normalize(h, dim=-1),
    "row centring": lambda h: h - h.mean(1, keepdim=True),
    "row sort / cummax / logcumsumexp": lambda h: (
        torch.sort(h, 1).values + torch.cummax(h, 1).values + torch.logcumsumexp(h, 1)
    ),
    "row roll / diff": lambda h: torch.roll(h, 1, 1) + torch.diff(h, dim=1, prepend=h[:, :1]),
    "matmul with a weight": lambda h: h @ _w(D, D) + torch.mm(h, _w(D, D)),
    "addmm with a weight": lambda h: torch.addmm(_w(D), h, _w(D, D)),
    "scatter_add / index_add on dim 1": lambda h: (
        torch.zeros_like(h).scatter_add(1, torch.zeros_like(h, dtype=torch.long), h)
        + torch.zeros_like(h).index_add(1, torch.tensor([1, 0, 3, 2]), h)
    ),
    "gather / take_along_dim on dim 1": lambda h: (
        torch.gather(h, 1, torch.zeros_like(h, dtype=torch.long))
        + torch.take_along_dim(h, torch.ones(1, D, dtype=torch.long), 1)
    ),
    "stack / cat on dim 1": lambda h: (
        torch.stack([h, 2 * h], dim=1).sum(1) + torch.cat([h, h], -1)[:, :D]
    ),
    "batched graphs A @ X": lambda h: (_w(2, 2) @ h.reshape(-1, 2, 2)).reshape(-1, D),
    "sdpa on 4-D": lambda h: F.scaled_dot_product_attention(
        h.reshape(-1, 1, 2, 2), h.reshape(-1, 1, 2, 2), h.reshape(-1, 1, 2, 2)
    ).reshape(-1, D),
}


def _sq(m, x):
    return m(x).double().square().sum(1)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_row_keeping_ops_stay_exact(name):
    torch.manual_seed(case_seed(80))
    model = Head(CONTROLS[name])
    assert_norms_match(model, _sq, torch.randn(B, D_IN))


def test_batch_first_lstm_stays_exact():
    class BF(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(D, D, batch_first=True)

        def forward(self, h):
            return self.rnn(h[:, None].expand(-1, 3, -1))[0][:, -1]

    torch.manual_seed(case_seed(81))
    assert_norms_match(Head(None, extra=BF()), _sq, torch.randn(B, D_IN))


def test_pointwise_table_is_torch_pointwise():
    """Every name of the element-wise table is an aten op tagged pointwise by torch."""
    from dpkern.ghost.batch_ops import POINTWISE

    for name in POINTWISE:
        op = getattr(torch.ops.aten, name, None) or getattr(torch.ops.aten, name + "_")
        tagged = [torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads()]
        assert any(tagged), name
