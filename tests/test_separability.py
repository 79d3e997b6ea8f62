"""compute_grad_sample evaluates each sample alone: a forward that mixes samples would give
the gradients of another model in silence, so it is refused at a module's first call
(dpkern.separability.check_separable), before any grad_sample is set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkern.grad_sample import compute_grad_sample

from conftest import case_seed


class _Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x - x.mean(0))


class _BatchAttention(nn.Module):
    """Each sample attends over the other samples of the batch (a [B, B] matmul)."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.q(x)
        return self.out(torch.softmax(h @ h.T, -1) @ h)


class _Separable(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 8), nn.Dropout(p), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _loss(out, y):
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("method", ["vmap", "loop", "auto"])
@pytest.mark.parametrize("cls", [_Centred, _BatchAttention])
def test_a_forward_that_mixes_samples_is_refused_and_nothing_is_set(cls, method):
    torch.manual_seed(case_seed(1))
    model = cls()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError, match=r"forward mixes samples: row \d+'s loss differs"):
        compute_grad_sample(model, _loss, x, y, method=method)
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert model.training  # the check's eval() is undone


def test_separable_models_pass_with_dropout_in_training_mode_and_b_of_one():
    torch.manual_seed(case_seed(2))
    model = _Separable()
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    losses = compute_grad_sample(model, _loss, x, y)
    assert losses.shape == (7,) and model.training
    assert all(p.grad_sample.shape[0] == 7 for p in model.parameters())
    other = _Centred()  # B = 1: nothing to compare, nothing mixed
    compute_grad_sample(other, _loss, x[:1], y[:1])
    assert other.lin.weight.grad_sample.shape == (1, 3, 4)


def test_the_checks_forwards_leave_modes_and_the_rng_as_they_were():
    """The separability checks (compute_grad_sample's and DPTrainer's) forward under
    side_effect_free: a submodule the user put in eval() stays there, and the RNG state
    (dropout masks after the check) is as if the check never ran."""
    from dpkern.separability import side_effect_free

    torch.manual_seed(case_seed(3))
    model = _Separable()
    model.drop.eval()  # the user's choice for one submodule
    x = torch.randn(2, 4)
    before = torch.random.get_rng_state()
    with side_effect_free(model, [x]):
        assert not model.training and not model.drop.training
        torch.rand(5)  # a random draw inside the check
    assert model.training and not model.drop.training
    assert torch.equal(torch.random.get_rng_state(), before)
