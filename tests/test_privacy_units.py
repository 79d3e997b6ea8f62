"""Privacy units of several examples (SPEC 8): a user's or a document's examples are summed
and clipped as one row, so one unit moves the released clipped sum by at most C."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import dpkern
from dpkern import data
from dpkern.grad_sample import compute_grad_sample
from dpkern.sampling import PoissonBatchSampler, group_grad_samples, unit_ids_from_keys

C = 1.0


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _clipped_sum(model, x, y, unit_ids, *, group=True):
    """The released clipped sum S of a DP-SGD step without noise (lr = 1, B_e = 1): the
    parameters move by exactly -S."""
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = dpkern.DPSGD(
        params,
        lr=1.0,
        max_grad_norm=C,
        noise_multiplier=0.0,
        expected_batch_size=1.0,
        backend="torch",
        seed=0,
    )
    if x.shape[0]:
        compute_grad_sample(model, F.cross_entropy, x, y)
        if group:
            grouped = group_grad_samples([p.grad_sample for p in params], unit_ids)
            for p, g in zip(params, grouped):
                p.grad_sample = g
    else:
        for p in params:
            p.grad_sample = torch.zeros((0, *p.shape))
    opt.step()
    S = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)])
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    return S


def _users():
    """7 users with 1 to 40 examples, large gradients (every example clipped)."""
    g = torch.Generator().manual_seed(1)
    sizes = [1, 3, 40, 2, 5, 1, 12]
    users = torch.cat([torch.full((n,), u) for u, n in enumerate(sizes)])
    x = 20 * torch.randn(users.numel(), 6, generator=g)
    y = torch.randint(0, 3, (users.numel(),), generator=g)
    return x, y, users, len(sizes)


def test_removing_any_user_moves_the_clipped_sum_by_at_most_c():
    model = _model()
    x, y, users, U = _users()
    full = _clipped_sum(model, x, y, users)
    for u in range(U):
        keep = users != u
        without = _clipped_sum(model, x[keep], y[keep], users[keep])
        assert float((full - without).norm()) <= C * (1 + 1e-5), u
    # the same data clipped per example: the 40-example user moves it by far more than C
    per_example = _clipped_sum(model, x, y, torch.arange(users.numel()), group=False)
    keep = users != 2
    without = _clipped_sum(model, x[keep], y[keep], None, group=False)
    assert float((per_example - without).norm()) > 5 * C


def test_adding_a_user_with_many_examples_moves_it_by_at_most_c():
    model = _model()
    x, y, users, U = _users()
    base = _clipped_sum(model, x, y, users)
    g = torch.Generator().manual_seed(5)
    x_new, y_new = 50 * torch.randn(500, 6, generator=g), torch.randint(0, 3, (500,), generator=g)
    more = _clipped_sum(
        model,
        torch.cat([x, x_new]),
        torch.cat([y, y_new]),
        torch.cat([users, torch.full((500,), U)]),
    )
    assert float((more - base).norm()) <= C * (1 + 1e-5)
    assert float((more - base).norm()) > 0.5 * C  # the user did contribute


def test_group_grad_samples_sums_rows_per_unit_and_drops_padding():
    g = torch.arange(12.0).reshape(6, 2)
    ids = torch.tensor([3, 1, 3, -1, 1, 7])
    (out, none) = group_grad_samples([g, None], ids)
    assert none is None
    assert out.tolist() == [[2 + 8, 3 + 9], [0 + 4, 1 + 5], [10, 11]]  # units 1, 3, 7
    assert out.dtype == torch.float32
    half = group_grad_samples([g.to(torch.bfloat16)], ids)[0]
    assert half.dtype == torch.float32
    assert group_grad_samples([g.double()], ids)[0].dtype == torch.float64
    assert group_grad_samples([g], torch.full((6,), -1))[0].shape == (0, 2)
    with pytest.raises(ValueError, match="unit_ids"):
        group_grad_samples([g], ids.float())
    with pytest.raises(ValueError, match=r"grad_samples\[0\] has shape \[5, 2\]"):
        group_grad_samples([g[:5]], ids)


def test_sampled_user_batches_feed_the_optimizer_one_row_per_user():
    """The custom-loop recipe: sample users, group, step; the optimizer sees B = users."""
    x, y, users, U = _users()
    model = _model()
    params = list(model.parameters())
    sampler = PoissonBatchSampler(users.numel(), 0.5, 5, seed=3, units=users)
    assert sampler.num_units == U and sampler.expected_batch_size == 0.5 * U
    opt = dpkern.DPSGD(
        params,
        lr=0.1,
        max_grad_norm=C,
        noise_multiplier=1.0,
        expected_batch_size=sampler.expected_batch_size,
        backend="torch",
    )
    rows = 0
    for batch in sampler.batches():
        idx = batch.indices
        if idx.numel():
            compute_grad_sample(model, F.cross_entropy, x[idx], y[idx])
            grouped = group_grad_samples([p.grad_sample for p in params], batch.unit_ids)
            for p, gs in zip(params, grouped):
                p.grad_sample = gs
            assert grouped[0].shape[0] == batch.num_units
            rows += batch.num_units
        else:
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape))
        opt.step()
    assert opt.stats["samples"] == rows  # the optimizer counted units, not examples


def test_unit_ids_from_keys():
    ids, names = unit_ids_from_keys(["bo", "al", "bo", 7, "al"])
    assert ids.tolist() == [0, 1, 0, 2, 1] and names == ["bo", "al", 7]
    with pytest.raises(ValueError, match="example 1 is None"):
        unit_ids_from_keys(["a", None])
    with pytest.raises(ValueError, match="not hashable"):
        unit_ids_from_keys([["a"]])


# -- documents and users from files -----------------------------------------------------------
def _jsonl(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_document_blocks_never_clip_separately(tmp_path):
    """Every block cut from one document carries the document's unit: the sampler takes
    all of them or none, and group_grad_samples makes them one clipped row."""
    rows = [{"text": "a" * 300}, {"text": "b" * 50}, {"text": "c" * 130}, {"text": "d" * 10}]
    docs = data.read_documents(_jsonl(tmp_path, rows))
    texts, keys = data.group_units(docs)
    assert keys == [1, 2, 3, 4]
    blocks, unit_of = data.make_unit_blocks([data.byte_encode(t) for t in texts], 64)
    assert unit_of.tolist() == [0, 0, 0, 0, 2, 2]  # no block mixes two documents
    for u, ch in ((0, "a"), (2, "c")):
        assert (blocks[unit_of == u] == ord(ch)).all()
    sampler = PoissonBatchSampler(blocks.shape[0], 0.5, 50, seed=1, units=unit_of)
    for batch in sampler.batches():
        for u in (0, 2):
            got = int((batch.unit_ids == u).sum())
            assert got in (0, int((unit_of == u).sum()))
        g = torch.randn(len(batch), 4)
        assert group_grad_samples([g], batch.unit_ids)[0].shape[0] == batch.num_units


def test_users_from_a_jsonl_field(tmp_path):
    rows = [
        {"text": "x" * 70, "user": "ann"},
        {"text": "y" * 70, "user": 5},
        {"text": "z" * 70, "user": "ann"},
    ]
    docs = data.read_documents(_jsonl(tmp_path, rows), user_field="user")
    texts, keys = data.group_units(docs)
    assert keys == ["ann", 5] and texts[0] == "x" * 70 + data.DOC_SEPARATOR + "z" * 70
    blocks, unit_of = data.make_unit_blocks([data.byte_encode(t) for t in texts], 32)
    assert unit_of.tolist() == [0, 0, 0, 0, 1, 1]
    train, val = data.split_units(unit_of, 0.5)
    assert set(unit_of[train].tolist()).isdisjoint(unit_of[val].tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(6))


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"text": "a"}, {"text": "b", "user": "u"}], r"d.jsonl:1: no \"user\" field"),
        ([{"text": "a", "user": None}], r"d.jsonl:1: no \"user\" field"),
        ([{"text": "a", "user": 1.5}], "string or an integer, not float"),
        ([{"text": "a", "user": ["x"]}], "string or an integer, not list"),
        ([{"text": "a", "user": True}], "string or an integer, not bool"),
    ],
)
def test_bad_user_fields_are_named(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        data.read_documents(_jsonl(tmp_path, rows), user_field="user")


def test_txt_files_have_no_users(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world")
    assert data.read_documents(path) == [("hello world", 0)]
    with pytest.raises(ValueError, match="needs a .jsonl"):
        data.read_documents(path, user_field="user")


def test_split_units_needs_two_units():
    with pytest.raises(ValueError, match="only 1 unit"):
        data.split_units(torch.zeros(5, dtype=torch.int64), 0.1)
    assert len(data.default_documents()) > 50
