"""dpkern.grad_sample.compute_grad_sample against a per-example autograd loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpkern.grad_sample import compute_grad_sample


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.conv = torch.nn.Conv1d(4, 6, 3, padding=1)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.frozen(self.head(self.norm(h).relu().mean(1)))


@pytest.mark.parametrize("B,chunk", [(1, None), (5, None), (7, 3)])
def test_matches_per_example_loop(B, chunk):
    torch.manual_seed(B)
    net = Net()
    tokens = torch.randint(0, 11, (B, 9))
    y = torch.randint(0, 3, (B,))
    losses = compute_grad_sample(net, F.cross_entropy, tokens, y, chunk_size=chunk)
    assert not hasattr(net.frozen.weight, "grad_sample")
    for i in range(B):
        net.zero_grad()
        loss = F.cross_entropy(net(tokens[i:i + 1]), y[i:i + 1])
        loss.backward()
        assert losses[i].item() == pytest.approx(loss.item(), rel=1e-5)
        for name, p in net.named_parameters():
            if p.requires_grad:
                assert p.grad_sample.shape == (B, *p.shape)
                torch.testing.assert_close(p.grad_sample[i], p.grad, rtol=1e-4, atol=1e-6,
                                           msg=name)


def test_empty_batch_and_errors():
    net = Net()
    losses = compute_grad_sample(net, F.cross_entropy, torch.zeros(0, 9, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long))
    assert losses.shape == (0,)
    assert net.head.weight.grad_sample.shape == (0, 3, 6)
    with pytest.raises(ValueError, match="batch size"):
        compute_grad_sample(net, F.cross_entropy, torch.zeros(2, 9, dtype=torch.long),
                            torch.zeros(3, dtype=torch.long))
