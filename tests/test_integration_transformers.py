"""dpkern.integrations.transformers: DPTrainer, the per-sample causal LM loss and the
device-move guard, on tiny Hugging Face models built from configs in code (tests/hf_tiny.py;
no downloads). Each privacy-relevant behaviour has a test that fails when it breaks:
Poisson batches, the sensitivity of a release (removing one sample moves the clipped sum by
at most C), the noise key never in a checkpoint, no exact data-dependent count in the logs,
each sample's loss independent of the others' padding, resume == uninterrupted."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import runpy
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hf_tiny  # noqa: E402  (tests/ is on sys.path)
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

import dpkern  # noqa: E402
from dpkern.ghost import GhostClipping  # noqa: E402
from dpkern.integrations import UpdateCheck, check_trainable_params  # noqa: E402
from dpkern.integrations.transformers import (  # noqa: E402
    NOT_PRIVATE,
    PRIVACY_FILE,
    DPTrainer,
    PoissonMicroBatchSampler,
    PrivacyArguments,
    _EmptySafeCollator,
    per_sample_causal_lm_loss,
)
from dpkern.keys import reveal  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(autouse=True)
def _quiet():
    # dp-accounting's RDP series notes at small sigma; the Trainer's info lines
    logging.getLogger("absl").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


# -- data ------------------------------------------------------------------------------------
def make_data(n: int, max_len: int = 12, seed: int = 0) -> list[dict]:
    """``n`` examples of random token ids (3..V-1) of random lengths 4..max_len."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, max_len + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(3, hf_tiny.V, (length,), generator=g)})
    return out


collate = hf_tiny.collate


def targs(out, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def privacy(**kw) -> PrivacyArguments:
    base = dict(noise_multiplier=1.0, target_delta=1e-3, loss_normalizer=12)
    base.update(kw)
    return PrivacyArguments(**base)


def trainer(model, out, data=None, priv=None, **kw) -> DPTrainer:
    return DPTrainer(
        model=model,
        args=targs(out, **kw),
        train_dataset=make_data(48) if data is None else data,
        data_collator=collate,
        privacy=priv or privacy(),
    )


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def key_bytes(key: int) -> list[bytes]:
    """Every encoding of a 64-bit key a file could plausibly hold (pickle writes ints in
    their shortest little-endian form)."""
    return [
        key.to_bytes(max(1, (key.bit_length() + 7) // 8), "little"),
        key.to_bytes(8, "little"),
        key.to_bytes(8, "big"),
        str(key).encode(),
        f"{key:x}".encode(),
        f"{key:016x}".encode(),
    ]


# -- the per-sample loss ------------------------------------------------------------------
def test_per_sample_loss_is_the_sum_over_own_tokens_over_a_constant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 3:] = -100
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 2:] = 0
    out = per_sample_causal_lm_loss(logits, labels, normalizer=4.0, attention_mask=mask)
    assert out.dtype == torch.float32 and out.shape == (3,)
    for i, valid in enumerate(([1, 2], [1], [1, 2, 3, 4])):
        ref = sum(
            float(torch.nn.functional.cross_entropy(logits[i, t - 1], labels[i, t])) for t in valid
        )
        assert math.isclose(float(out[i]), ref / 4.0, rel_tol=1e-5)
    with pytest.raises(ValueError, match="normalizer"):
        per_sample_causal_lm_loss(logits, labels, normalizer=0)
    with pytest.raises(ValueError, match="labels"):
        per_sample_causal_lm_loss(logits, labels[:, :3])


def _loss_and_norm(model, ids, mask):
    """Per-sample losses and ghost per-sample gradient norms (no optimizer state touched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    probe = dpkern.DPSGD(
        params, lr=0.0, max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=1.0
    )
    labels = ids.masked_fill(mask == 0, -100)
    with GhostClipping(model, probe, verify="off") as gc:
        logits = model(input_ids=ids, attention_mask=mask).logits
        losses = per_sample_causal_lm_loss(logits, labels, normalizer=8, attention_mask=mask)
        _, norms = gc.clipped_sums(losses)
    return losses.detach(), norms


def test_one_samples_padding_changes_neither_anothers_loss_nor_its_gradient_norm():
    """Sample 1 is fixed; sample 0 gets 0 to 5 more padding tokens (its own tokens masked
    out, and the batch padded wider). Sample 1's loss and gradient norm stay the same (to
    float rounding); a loss divided by the batch's realised token count (the HF default)
    changes, so the test can fail."""
    model = hf_tiny.build("llama").model
    g = torch.Generator().manual_seed(1)
    s0 = torch.randint(3, hf_tiny.V, (9,), generator=g)
    s1 = torch.randint(3, hf_tiny.V, (6,), generator=g)
    seen, coupled = [], []
    for extra_pad, kept in ((0, 9), (2, 7), (5, 4)):
        T = 9 + extra_pad
        ids = torch.zeros(2, T, dtype=torch.long)
        mask = torch.zeros(2, T, dtype=torch.long)
        ids[0, :kept], mask[0, :kept] = s0[:kept], 1
        ids[1, :6], mask[1, :6] = s1, 1
        losses, norms = _loss_and_norm(model, ids, mask)
        seen.append((float(losses[1]), float(norms[1])))
        coupled.append(float(losses[1]) * 8 / float(mask[:, 1:].sum()))  # / batch tokens
    for loss, norm in seen[1:]:
        assert math.isclose(loss, seen[0][0], rel_tol=1e-5)
        assert math.isclose(norm, seen[0][1], rel_tol=1e-4)
    assert abs(coupled[2] - coupled[0]) > 1e-2 * abs(coupled[0])  # the coupling it avoids


# -- the sampler ---------------------------------------------------------------------------
def test_poisson_micro_batches_split_each_draw_and_seeded_epochs_repeat():
    s = PoissonMicroBatchSampler(50, 0.2, 4, 3, seed=7)
    assert len(s) == 12
    s.set_epoch(1)
    first = list(s)
    s.set_epoch(1)
    assert list(s) == first  # a seeded epoch is the same however often iterated
    s.set_epoch(2)
    assert list(s) != first
    assert len(first) == 12
    for k in range(4):
        parts = first[3 * k : 3 * k + 3]
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        flat = [i for p in parts for i in p]
        assert flat == sorted(set(flat))  # one draw, each index once
    empty = PoissonMicroBatchSampler(10, 0.01, 30, 2)
    assert any(len(b) == 0 for b in empty)  # Poisson: empty (micro-)batches are drawn


def test_empty_micro_batch_collates_to_zero_rows():
    data = make_data(5)
    empty = _EmptySafeCollator(collate, data)([])
    assert set(empty) == {"input_ids", "attention_mask", "labels"}
    assert all(v.shape[0] == 0 for v in empty.values())


def test_a_padding_free_collator_is_refused_before_any_step(tmp_path):
    """DataCollatorWithFlattening puts a micro-batch's examples in one row: clipping that
    row would bound the group, not each example. Refused at the first batch."""
    from transformers import DataCollatorWithFlattening

    data = make_data(5)
    flat = DataCollatorWithFlattening()
    packed = flat([{"input_ids": d["input_ids"].tolist()} for d in data[:3]])
    assert packed["input_ids"].shape[0] == 1  # 3 examples, 1 row
    with pytest.raises(ValueError, match=r"1 row\(s\) from 3 examples.*one privacy unit"):
        _EmptySafeCollator(flat, data)([{"input_ids": d["input_ids"].tolist()} for d in data[:3]])
    with pytest.raises(ValueError, match="packing keys"):
        _EmptySafeCollator(lambda f: {**collate(f), "cu_seq_lens_q": torch.zeros(2)}, data)(
            data[:2]
        )
    model = hf_tiny.build("llama").model
    before = params_of(model)
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path),
        train_dataset=[{"input_ids": d["input_ids"].tolist()} for d in make_data(48)],
        data_collator=DataCollatorWithFlattening(),
        privacy=privacy(),
    )
    with pytest.raises(ValueError, match="each row must be exactly one example"):
        tr.train()
    assert tr.state.global_step == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


# -- DPTrainer end to end --------------------------------------------------------------------
def _realised_sizes(data_loader_collate, drawn=None):
    """A collator that records each micro-batch's size (and, into ``drawn``, its examples'
    token ids: which examples were drawn, not only how many)."""
    sizes = []

    def counting(features):
        sizes.append(len(features))
        if drawn is not None:
            drawn.append([tuple(f["input_ids"].tolist()) for f in features])
        return data_loader_collate(features)

    return sizes, counting


def test_trainer_end_to_end_epsilon_within_target_and_nothing_leaked(tmp_path):
    """A calibrated run: epsilon is logged with the loss and ends within the target; the
    checkpoint holds the ledger but never the noise key; no grad_norm, no token counts,
    total_flos 0; the model trains and generate() works."""
    model = hf_tiny.build("llama").model
    before = params_of(model)
    target = 3.0
    sizes, counting = _realised_sizes(collate)
    tr = DPTrainer(
        model=model,
        args=targs(
            tmp_path,
            max_steps=4,
            logging_steps=2,
            save_steps=4,
            save_strategy="steps",
            eval_strategy="steps",
            eval_steps=4,
        ),
        train_dataset=make_data(64),
        eval_dataset=make_data(8, seed=9),
        data_collator=counting,
        privacy=PrivacyArguments(target_epsilon=target, target_delta=1e-3, loss_normalizer=12),
    )
    out = tr.train()
    logs = [e for e in tr.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [2, 4]
    eps = [e["epsilon"] for e in logs]
    assert 0 < eps[0] < eps[1] <= target + 1e-6 and eps[1] > 0.9 * target
    assert out.metrics["epsilon"] == eps[1] and tr.state.log_history[-1]["total_flos"] == 0
    assert tr.accountant.steps == 4 and tr.accountant.history[0][1] == 8 / 64
    assert tr.optimizer.optimizer.dp_step == 4  # one release per 2 accumulated micro-batches
    assert any("eval_loss" in e for e in tr.state.log_history)  # evaluation is not recorded
    for entry in tr.state.log_history:
        assert "grad_norm" not in entry and "num_input_tokens_seen" not in entry
    assert len(sizes) >= 8  # 4 steps x 2 micro-batches (Accelerate reads one ahead)
    ck = tmp_path / "checkpoint-4"
    rec = json.loads((ck / PRIVACY_FILE).read_text())
    assert rec["private"] and rec["ledger"]["history"] == [[tr.noise_multiplier, 0.125, 4]]
    assert rec["epsilon"] == pytest.approx(eps[1]) and rec["dp_step"] == 4
    key = reveal(tr.optimizer.optimizer._key)
    for f in ck.rglob("*"):
        if f.is_file():
            blob = f.read_bytes()
            for enc in key_bytes(key):
                assert enc not in blob, f"the noise key is in {f.name}"
    assert "seed" not in torch.load(ck / "optimizer.pt", weights_only=True)["dp"]
    # the exact training loss is logged live, never written to a file that is shared
    tr.save_state()
    tr.create_model_card()
    for state_file in (ck / "trainer_state.json", tmp_path / "trainer_state.json"):
        saved = json.loads(state_file.read_text())["log_history"]
        assert any("epsilon" in e for e in saved)
        assert not any(k in e for e in saved for k in ("loss", "train_loss")), state_file
    assert any("loss" in e for e in tr.state.log_history)  # in memory: still there
    card = (tmp_path / "README.md").read_text()
    assert f"{logs[-1]['loss']:.4f}" not in card and "train_loss" not in card
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    ids = torch.tensor([[5, 6, 7]])
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)
    assert gen.shape == (1, 6) and torch.equal(gen[:, :3], ids)


def _token_mean_loss(outputs, labels):
    """HF-style token averaging over the batch: divides by the batch's token count."""
    logp = torch.log_softmax(outputs.logits[:, :-1].float(), -1)
    y = labels[:, 1:]
    nll = -logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y != -100)
    return nll.sum(1) / (y != -100).sum()


def _batch_scaled_loss(outputs, labels):
    per = per_sample_causal_lm_loss(outputs.logits, labels, normalizer=12)
    return per * per.mean()


@pytest.mark.parametrize("loss_func", [_token_mean_loss, _batch_scaled_loss])
def test_a_loss_that_couples_the_samples_is_refused_before_any_step(tmp_path, loss_func):
    """A per_sample_loss_func dividing by the batch's token count (no gradient couples the
    samples: ghost norms and the first-step check agree) or scaled by the batch mean: one
    sample would move the others' clipped gradients. Refused at the first micro-batch,
    nothing trained."""
    model = hf_tiny.build("llama").model
    before = params_of(model)
    tr = trainer(model, tmp_path, max_steps=2)
    tr.per_sample_loss_func = loss_func
    with pytest.raises(ValueError, match="not separable.*token count"):
        tr.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert tr.accountant.steps == 0


def test_a_batch_averaged_loss_is_refused_saying_why(tmp_path):
    model = hf_tiny.build("llama").model
    tr = trainer(model, tmp_path, max_steps=1)
    tr.per_sample_loss_func = lambda out, y: _token_mean_loss(out, y).mean()
    with pytest.raises(ValueError, match=r"float tensor \[\d+\], got \(\).*do not average"):
        tr.train()
    assert tr.accountant.steps == 0


def test_a_separable_custom_loss_trains(tmp_path):
    """The same token loss divided by a constant passes the separability check."""
    model = hf_tiny.build("llama").model
    tr = trainer(model, tmp_path, max_steps=2)
    tr.per_sample_loss_func = lambda out, y: per_sample_causal_lm_loss(out.logits, y, normalizer=9)
    tr.train()
    assert tr._separable_checked and tr.optimizer.optimizer.dp_step == 2


def test_save_metrics_writes_no_training_loss(tmp_path):
    """run_clm's ``trainer.save_metrics("train", train_result.metrics)``: train_loss (exact,
    un-noised) stays out of train_results.json and all_results.json; epsilon is there."""
    tr = trainer(hf_tiny.build("llama").model, tmp_path, max_steps=2, logging_steps=1)
    out = tr.train()
    assert "train_loss" in out.metrics  # in memory, as Trainer returns it
    tr.save_metrics("train", out.metrics)
    for name in ("train_results.json", "all_results.json"):
        saved = json.loads((tmp_path / name).read_text())
        assert "train_loss" not in saved and "loss" not in saved, name
        assert saved["epsilon"] > 0


def test_schedule_free_trains_across_evaluation_and_saves_the_average(tmp_path):
    """evaluate() sets a schedule-free optimizer to x (Trainer's optimizer.eval()); each
    training step sets it back to y; save_model() writes x and leaves the parameters at
    y; a checkpoint keeps y with the optimizer's train mode (they resume together)."""
    from safetensors.torch import load_file

    model = hf_tiny.build("llama").model
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=1),
        train_dataset=make_data(48),
        eval_dataset=make_data(8, seed=9),
        data_collator=collate,
        privacy=privacy(optimizer="dp-adamw-schedulefree"),
    )
    tr.train()
    opt = tr.optimizer.optimizer
    assert opt.dp_step == 3 and sum("eval_loss" in e for e in tr.state.log_history) == 3
    opt.train()  # (the last evaluate() left x in place)
    y = params_of(model)
    tr.save_model(str(tmp_path / "final"))
    for n, p in model.named_parameters():  # back at y (the x <-> y swaps round in float32)
        torch.testing.assert_close(p, y[n], rtol=1e-6, atol=1e-7, msg=n)
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    opt.eval()
    x = params_of(model)
    opt.train()
    assert max(float((x[n] - y[n]).abs().max()) for n in x) > 1e-4  # x, y differ: 3 steps
    for n, t in saved.items():
        torch.testing.assert_close(t, x[n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_model_saved_by_an_earlier_run_says_its_ledger_starts_at_zero(tmp_path):
    """save_model writes the privacy record beside the model; a new DPTrainer on a model
    loaded from there warns that its ledger starts at zero (composition is the user's)."""
    tr = trainer(hf_tiny.build("llama").model, tmp_path / "run", max_steps=1)
    tr.train()
    tr.save_model(str(tmp_path / "final"))
    rec = json.loads((tmp_path / "final" / PRIVACY_FILE).read_text())
    assert rec["dp_step"] == 1 and rec["ledger"]["history"]
    again = type(tr.model).from_pretrained(str(tmp_path / "final"))
    with pytest.warns(UserWarning, match="ledger starts at zero.*composition"):
        trainer(again, tmp_path / "run2")
    rec["private"] = False  # a seeded run's record: no guarantee to compose with
    (tmp_path / "final" / PRIVACY_FILE).write_text(json.dumps(rec))
    with pytest.warns(UserWarning, match="ledger starts at zero.*was not private") as seen:
        trainer(again, tmp_path / "run4")
    assert "composition" not in str(seen[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer(hf_tiny.build("llama").model, tmp_path / "run3")  # a fresh model: no note


def test_logs_are_the_same_whatever_the_poisson_draws(tmp_path):
    """Two secure runs draw different batches (checked); trainer_state.json's log history
    differs only in the loss and timings: no exact data-dependent count is logged (an
    include_num_input_tokens_seen or the Trainer's token-counting total_flos would differ)."""
    states, draws = [], []
    for run in range(2):
        draws.append([])
        _, counting = _realised_sizes(collate, draws[-1])
        tr = DPTrainer(
            model=hf_tiny.build("llama").model,
            args=targs(tmp_path / str(run), max_steps=2, logging_steps=2),
            train_dataset=make_data(64),
            data_collator=counting,
            privacy=privacy(),
        )
        tr.train()
        states.append(
            [
                {k: v for k, v in e.items() if not any(w in k for w in ("loss", "runtime", "per_"))}
                for e in tr.state.log_history
            ]
        )
    # the drawn examples, not only the sizes: equal sizes happen by chance (CI drew
    # [5, 6, 3, 3, 4] twice); equal example sets from 64 with fresh keys do not
    assert draws[0] != draws[1]
    assert states[0] == states[1]


def test_resume_through_checkpoints_equals_the_uninterrupted_run(tmp_path):
    """With a noise seed (a reproducible run that says it is not private), resuming from
    checkpoint-2 gives the same parameters, optimizer step and ledger as the 4-step run;
    a checkpoint without the ledger, and a private resume of it, are refused."""
    priv = privacy(noise_seed=1234)
    data = make_data(24)  # B_e = 8: 3 steps per epoch, so the run crosses an epoch
    kw = dict(max_steps=4, save_steps=2, save_strategy="steps")
    with pytest.warns(UserWarning, match=NOT_PRIVATE):
        full = trainer(hf_tiny.build("llama").model, tmp_path / "full", data, priv, **kw)
    full.train()
    final = full.state.log_history[-1]
    assert "epsilon" not in final and final["epsilon_if_noise_key_were_secret"] > 0
    rec = json.loads((tmp_path / "full" / "checkpoint-2" / PRIVACY_FILE).read_text())
    assert rec["private"] is False and rec["privacy"] == NOT_PRIVATE and "epsilon" not in rec

    with pytest.warns(UserWarning, match=NOT_PRIVATE):
        again = trainer(hf_tiny.build("llama").model, tmp_path / "resumed", data, priv, **kw)
    # checkpoint-4 of the same run exists: resuming from checkpoint-2 abandons it (warned)
    with pytest.warns(UserWarning, match=r"later checkpoints exist \(.*checkpoint-4\)"):
        again.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert again.noise_multiplier == full.noise_multiplier
    # equal up to float rounding: ghost clipping picks each parameter's exact route (Gram
    # or kept per-sample gradient) per step, and the two round differently
    for (n, p), q in zip(full.model.named_parameters(), again.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    assert again.optimizer.optimizer.dp_step == 4
    assert again.accountant.history == full.accountant.history == [[1.0, 8 / 24, 4]]

    broken = tmp_path / "broken"
    os.rename(tmp_path / "full" / "checkpoint-2", broken)
    (broken / PRIVACY_FILE).rename(tmp_path / "ledger.json")
    with pytest.warns(UserWarning, match=NOT_PRIVATE):
        t = trainer(hf_tiny.build("llama").model, tmp_path / "x", data, priv, **kw)
    with pytest.raises(ValueError, match="no dpkern_privacy.json"):
        t.train(resume_from_checkpoint=str(broken))
    (tmp_path / "ledger.json").rename(broken / PRIVACY_FILE)
    t = trainer(hf_tiny.build("llama").model, tmp_path / "y", data, privacy(), **kw)
    with pytest.raises(ValueError, match="not private and cannot become so"):
        t.train(resume_from_checkpoint=str(broken))


def test_later_checkpoints_are_named_only_when_they_exist(tmp_path):
    import warnings

    from dpkern.integrations.transformers.records import warn_later_checkpoints

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / PRIVACY_FILE).write_text(json.dumps({"dp_step": step}))
    (tmp_path / "checkpoint-9").mkdir()  # not a DPTrainer checkpoint: ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_later_checkpoints(tmp_path / "checkpoint-4", {"dp_step": 4}, tmp_path)
    with pytest.warns(UserWarning, match=r"step 2\) while later checkpoints exist"):
        warn_later_checkpoints(tmp_path / "checkpoint-2", {"dp_step": 2}, tmp_path / "other")


def test_a_resumed_calibrated_run_keeps_sigma_or_recalibrates_the_rest(tmp_path, monkeypatch):
    """Same plan: the checkpoint's sigma, bit for bit (no recalibration). A longer plan:
    the sigma for the remaining steps such that the whole ledger meets the target; here
    the ledger is 10 steps at sigma 2 and the target what 20 such steps spend, so the
    answer is sigma 2 again."""
    import dpkern.integrations.transformers.plan as hft_plan
    from dpkern.accounting import get_epsilon

    q, delta = 0.05, 1e-3
    target = get_epsilon(2.0, q, 20, delta)
    data = make_data(160)  # B_e = 8: q = 0.05
    priv = PrivacyArguments(target_epsilon=target, target_delta=delta)
    rec = {
        "ledger": {"accountant": "rdp", "history": [[2.0, q, 10]]},
        "dataset_size": 160,
        "planned_steps": 20,
        "target_epsilon": target,
        "target_delta": delta,
        "sample_rate": q,
        "noise_multiplier": 2.0,
    }

    def refuse(*a, **k):
        raise AssertionError("recalibrated")

    tr = trainer(hf_tiny.build("llama").model, tmp_path, data, priv, max_steps=20)
    tr._resume_record = rec
    monkeypatch.setattr(hft_plan, "get_noise_multiplier", refuse)
    monkeypatch.setattr(hft_plan, "calibrate_extension", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the same plan: no recalibration, nothing said)
        assert tr._calibrate()["noise_multiplier"] == 2.0 and tr.accountant.steps == 10
    monkeypatch.undo()
    tr = trainer(hf_tiny.build("llama").model, tmp_path, data, priv, max_steps=20)
    tr._resume_record = {**rec, "planned_steps": 30, "noise_multiplier": 2.5}
    with pytest.warns(UserWarning, match=r"steps 30 -> 20.*recalibrated 2\.5 -> 2 for"):
        sigma = tr._calibrate()["noise_multiplier"]
    assert sigma == pytest.approx(2.0, rel=2e-4)
    tr._resume_record = {**rec, "dataset_size": 161}
    with pytest.raises(ValueError, match="not the same data"):
        tr._calibrate()


def test_peft_lora_trains_only_lora_and_generates(tmp_path):
    """get_peft_model: the optimizer, the norms and the noise hold exactly the LoRA
    parameters; the frozen base is bit-for-bit untouched, every LoRA tensor moves."""
    tiny = hf_tiny.lora_llama()
    if tiny is None:
        pytest.skip("peft not installed")
    model = tiny.model
    before = params_of(model)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    tr = trainer(model, tmp_path, max_steps=2)
    tr.train()
    opt = tr.optimizer.optimizer
    ids = {id(p) for p in opt.trainable_params()}
    assert ids == {id(p) for n, p in model.named_parameters() if n in lora}
    assert sum(p.numel() for p in opt.trainable_params()) == sum(
        p.numel() for n, p in model.named_parameters() if n in lora
    )
    for n, p in model.named_parameters():
        if n in lora:
            assert not torch.equal(p, before[n]), f"{n} did not move"
        else:
            assert torch.equal(p, before[n]), f"frozen {n} changed"
    gen = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert gen.shape == (1, 5)


@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_bf16_trains_through_the_same_path(tmp_path, mode):
    """bfloat16 weights, or fp32 weights under Accelerate's bf16 autocast (bf16=True):
    float32 losses, the first-step check at bf16 tolerance, float32 optimizer states, every
    parameter moves."""
    model = hf_tiny.build("llama").model
    if mode == "bf16 weights":
        model = model.to(torch.bfloat16)
    before = params_of(model)
    tr = trainer(model, tmp_path, max_steps=1, bf16=mode == "bf16 autocast")
    out = tr.train()
    assert math.isfinite(out.training_loss)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    state = next(iter(tr.optimizer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_stochastic_rounding_reaches_the_optimizer(tmp_path):
    """PrivacyArguments.stochastic_rounding: the optimizer rounds bf16 weights
    stochastically (SPEC 3.2); a non-bool is refused."""
    model = hf_tiny.build("llama").model.to(torch.bfloat16)
    tr = trainer(model, tmp_path, max_steps=1, priv=privacy(stochastic_rounding=True))
    assert tr.create_optimizer().stochastic_rounding is True
    assert trainer(model, tmp_path, max_steps=1).create_optimizer().stochastic_rounding is False
    with pytest.raises(ValueError, match="stochastic_rounding"):
        PrivacyArguments(target_epsilon=1.0, stochastic_rounding=1)


# -- the privacy of a release ---------------------------------------------------------------
def _released_sum(tmp_path, batch, clip):
    tr = trainer(
        hf_tiny.build("llama").model,
        tmp_path,
        priv=privacy(max_grad_norm=clip),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
    )
    tr.create_optimizer()
    tr.training_step(tr.model, batch)
    bufs = tr.optimizer.clipped_sum_buffers()
    return torch.cat([b.flatten() for b in bufs]).double()


def test_removing_one_sample_moves_the_released_sum_by_at_most_C(tmp_path):
    """The clipped sum a DPTrainer micro-batch adds (5 samples, run in chunks of 2) moves by
    at most C when any one sample is removed, and by more than 0."""
    clip = 0.05
    data = make_data(5, seed=3)
    full = _released_sum(tmp_path, collate(data), clip)
    for k in (0, 2, 4):
        rest = collate(data[:k] + data[k + 1 :])
        d = float((full - _released_sum(tmp_path, rest, clip)).norm())
        assert 0 < d <= clip * (1 + 1e-5), (k, d)


def test_an_empty_poisson_batch_still_adds_noise_and_steps(tmp_path):
    tr = trainer(hf_tiny.build("llama").model, tmp_path, gradient_accumulation_steps=1)
    before = params_of(tr.model)
    tr.create_optimizer()
    empty = _EmptySafeCollator(collate, tr.train_dataset)([])
    loss = tr.training_step(tr.model, empty)
    assert float(loss) == 0.0
    tr.optimizer.step()
    assert all(not torch.equal(p, before[n]) for n, p in tr.model.named_parameters())


def test_left_padding_and_a_misplaced_step_are_refused(tmp_path):
    """Left padding would make a sample's positions depend on its batch's longest sample;
    an optimizer step after the wrong number of micro-batches would break the accounting
    of one Poisson batch per step."""
    tr = trainer(hf_tiny.build("llama").model, tmp_path)
    tr.create_optimizer()
    batch = collate(make_data(3))
    flipped = {k: v.flip(1) for k, v in batch.items()}  # the padding now comes first
    with pytest.raises(ValueError, match="not right-padded"):
        tr.training_step(tr.model, flipped)
    tr._micro = 1  # one of the two micro-batches of a logical batch
    with pytest.raises(RuntimeError, match="after 1 micro-batches, expected"):
        tr._before_release()


# -- the silent-non-training trap ----------------------------------------------------------
class _MoveAfterOptimizer(TrainerCallback):
    """What ``model.to(device)`` does on a real device move: new parameter tensors, after
    the optimizer holds the old ones."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        lin = model.model.layers[0].mlp.down_proj
        lin.weight = torch.nn.Parameter(lin.weight.detach().clone())


def test_trainer_refuses_a_model_moved_after_the_optimizer_was_built(tmp_path):
    tr = trainer(hf_tiny.build("llama").model, tmp_path)
    tr.add_callback(_MoveAfterOptimizer())
    with pytest.raises(ValueError, match="moved to another device"):
        tr.train()


class _UndoTheStep(TrainerCallback):
    """Puts one parameter back after the step (as if the optimizer updated another tensor)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.w = model.lm_head.weight
        self.old = self.w.detach().clone()

    def on_optimizer_step(self, args, state, control, **kw):
        with torch.no_grad():
            self.w.copy_(self.old)


def test_trainer_stops_when_a_parameter_did_not_move_in_the_first_step(tmp_path):
    tr = DPTrainer(
        model=hf_tiny.build("llama").model,
        args=targs(tmp_path, max_steps=2),
        train_dataset=make_data(48),
        data_collator=collate,
        callbacks=[_UndoTheStep()],
        privacy=privacy(),
    )
    with pytest.raises(RuntimeError, match=r"did not change in the first step .*lm_head.weight"):
        tr.train()
    assert tr.accountant.steps == 1  # the release happened and is accounted


def test_guard_for_plain_loops():
    model = hf_tiny.build("llama").model
    opt = dpkern.DPSGD(
        model.parameters(), lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4
    )
    check = UpdateCheck(model, opt)  # fine: the optimizer owns the model's parameters
    with pytest.raises(RuntimeError, match="did not change in the first step"):
        check.after_step()  # no step taken: nothing moved
    lin = model.lm_head
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone())  # as a device move does
    with pytest.raises(ValueError, match="moved to another device"):
        check_trainable_params(model, opt)
    with pytest.raises(ValueError, match="moved to another device"):
        UpdateCheck(model, opt)
    opt2 = dpkern.DPSGD(
        [p for n, p in model.named_parameters() if not n.startswith("lm_head")],
        lr=0.1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
    )
    with pytest.raises(ValueError, match=r"not in the optimizer \(lm_head.weight"):
        check_trainable_params(model, opt2)
    opt3 = dpkern.DPSGD(
        model.parameters(), lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4
    )
    check = UpdateCheck(model, opt3)
    ids = torch.randint(3, hf_tiny.V, (2, 5))
    with GhostClipping(model, opt3) as gc:
        logits = model(input_ids=ids).logits
        gc.backward(per_sample_causal_lm_loss(logits, ids))
    opt3.step()
    check.after_step()  # every parameter moved


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing"),
        ({"include_num_input_tokens_seen": True}, "exact data-dependent count"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"train_sampling_strategy": "group_by_length"}, "Poisson"),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": 1}},
            "use_reentrant",
        ),
        ({"neftune_noise_alpha": 5.0}, "couples the samples"),
        ({"skip_memory_metrics": False}, "peak memory"),
        ({"use_liger_kernel": True}, "liger"),
    ],
)
def test_refused_training_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        trainer(hf_tiny.build("llama").model, tmp_path, **kw)


@pytest.mark.parametrize(
    "env,match",
    [
        ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16 mixed precision"),
        ({"ACCELERATE_DYNAMO_BACKEND": "inductor"}, "dynamo backend 'inductor'"),
    ],
)
def test_accelerate_settings_behind_the_training_arguments_are_refused(
    tmp_path, monkeypatch, env, match
):
    """fp16 and torch.compile set by Accelerate's environment (accelerate launch), not by
    TrainingArguments, are refused as their TrainingArguments twins are."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        trainer(hf_tiny.build("llama").model, tmp_path)
    for k in env:
        monkeypatch.delenv(k)
    assert trainer(hf_tiny.build("llama").model, tmp_path).accelerator.mixed_precision == "no"


def test_mixed_precision_other_than_bf16_is_refused():
    import types

    from dpkern.integrations.transformers.checks import _check_accelerator

    for mp in ("fp8", "fp16"):
        with pytest.raises(ValueError, match=f"{mp} mixed precision"):
            _check_accelerator(types.SimpleNamespace(mixed_precision=mp))
    for mp in ("no", "bf16"):
        _check_accelerator(types.SimpleNamespace(mixed_precision=mp))


def test_refused_trainer_arguments(tmp_path, monkeypatch):
    model = hf_tiny.build("llama").model
    args = targs(tmp_path)
    data = make_data(16)
    with pytest.raises(ValueError, match="privacy=PrivacyArguments"):
        DPTrainer(model=model, args=args, train_dataset=data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers="):
        DPTrainer(model=model, args=args, optimizers=(opt, None), privacy=privacy())
    with pytest.raises(ValueError, match="per_sample_loss_func"):
        DPTrainer(model=model, args=args, compute_loss_func=lambda *a, **k: 0, privacy=privacy())
    with pytest.raises(ValueError, match="exactly one of target_epsilon"):
        PrivacyArguments()
    with pytest.raises(ValueError, match="dp-macadam"):
        PrivacyArguments(target_epsilon=1.0, optimizer="dp-macadam")
    with pytest.raises(ValueError, match="loss_normalizer"):
        PrivacyArguments(target_epsilon=1.0, loss_normalizer=float("nan"))
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="world_size=2 under parallel_mode='not_parallel'"):
        DPTrainer(model=model, args=args, train_dataset=data, privacy=privacy())


def test_unsupported_optim_and_too_large_batch_are_refused_at_train(tmp_path):
    tr = trainer(hf_tiny.build("llama").model, tmp_path, optim="adafactor")
    with pytest.raises(ValueError, match="adafactor"):
        tr.train()
    tr = trainer(hf_tiny.build("llama").model, tmp_path, data=make_data(6))
    with pytest.raises(ValueError, match="exceeds the 6 training examples"):
        tr.train()


# -- the README example ---------------------------------------------------------------------
def test_readme_trainer_example_runs(tmp_path, monkeypatch, capsys):
    section = README.read_text().split("## Hugging Face Trainer and PEFT", 1)[1]
    section = section.split("\n## ", 1)[0]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    script = tmp_path / "example.py"
    script.write_text(block)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    eps = float(re.search(r"epsilon=([0-9.]+)", out).group(1))
    assert 0 < eps <= 8.0 + 1e-6


def test_trainer_hyper_parameters_fit_every_rule():
    """TrainingArguments' Adam betas / eps reach each rule in the form its class takes:
    DP-AdEMAMix gets Adam's pair and its own slow beta3 (a pair raised ValueError),
    DP-Adafactor no float eps (its eps is the (eps1, eps2) pair)."""
    import types

    from dpkern.integrations.transformers.arguments import _optimizer_kwargs

    args = types.SimpleNamespace(
        learning_rate=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7
    )
    ade = _optimizer_kwargs("dp-ademamix", args)
    assert ade["betas"] == (0.8, 0.95, 0.9999) and ade["eps"] == 1e-7
    assert "eps" not in _optimizer_kwargs("dp-adafactor", args)
    assert _optimizer_kwargs("dp-adamw", args)["betas"] == (0.8, 0.95)
    p = torch.nn.Parameter(torch.randn(3))
    privacy = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2)
    for name in ("dp-ademamix", "dp-adafactor", "dp-adamw", "dp-lion"):
        cls = dpkern.rules.by_cli_name(name).optimizer_class()
        cls([p], **_optimizer_kwargs(name, args), **privacy)  # constructs: no ValueError


# -- gradient checkpointing, accumulation, epochs --------------------------------------------
def _count_block_forwards(model) -> list:
    """A list that grows by one per forward of the first decoder block's MLP (inside the
    checkpointed block: a recomputation in the backward counts too)."""
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_gradient_checkpointing_trains_exactly_as_without(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): the blocks are recomputed in the
    backward (twice the block forwards, counted), non-reentrant, and the final parameters
    equal the run without checkpointing (same noise seed, same Poisson draws)."""
    priv = privacy(noise_seed=77, verify="off")  # (the check's own passes would count)
    data = make_data(32)
    runs = {}
    for ckpt in (False, True):
        model = hf_tiny.build("llama").model
        calls = _count_block_forwards(model)
        with pytest.warns(UserWarning, match=NOT_PRIVATE):
            tr = trainer(model, tmp_path / str(ckpt), data, priv, gradient_checkpointing=ckpt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (5.x: the deprecated alias)
            tr.train()
        assert tr.optimizer.optimizer.dp_step == 3
        runs[ckpt] = (params_of(model), len(calls), model)
    (plain, n_plain, _), (ckpt, n_ckpt, model) = runs[False], runs[True]
    assert model.is_gradient_checkpointing and not runs[False][2].is_gradient_checkpointing
    funcs = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()]
    funcs = [f for f in funcs if f is not None]
    assert funcs and all(f.keywords["use_reentrant"] is False for f in funcs)
    assert n_plain > 0 and n_ckpt == 2 * n_plain  # each block forward recomputed once
    for n, p in plain.items():
        torch.testing.assert_close(ckpt[n], p, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize(
    "field", ["gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"]
)
def test_reentrant_gradient_checkpointing_is_refused(tmp_path, field):
    """use_reentrant=True (torch.autograd.grad cannot run through reentrant checkpoints)
    is refused at construction, naming it; so is a model checkpointed reentrantly by hand
    (at the first step, before torch's own error in the backward)."""
    if field not in TrainingArguments.__dataclass_fields__:
        pytest.skip(f"this transformers has no {field}")
    model = hf_tiny.build("llama").model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = targs(tmp_path, gradient_checkpointing=True, **{field: {"use_reentrant": True}})
    with pytest.raises(ValueError, match="use_reentrant"):
        DPTrainer(model=model, args=args, train_dataset=make_data(16), privacy=privacy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (5.x: the deprecated name)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    tr = trainer(model, tmp_path)
    tr.create_optimizer()
    with pytest.raises(ValueError, match="use_reentrant=True"):
        tr.training_step(tr.model, collate(make_data(3)))


def test_checkpointing_kwargs_are_made_non_reentrant(tmp_path):
    """No kwargs, no use_reentrant, or use_reentrant=None (torch's reentrant default;
    transformers 4 also defaults to reentrant): DPTrainer sets use_reentrant=False and
    keeps the other kwargs."""
    for given in (None, {}, {"use_reentrant": None}, {"preserve_rng_state": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            tr = trainer(
                hf_tiny.build("llama").model,
                tmp_path,
                gradient_checkpointing=True,
                gradient_checkpointing_kwargs=given,
            )
        for field in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            if hasattr(tr.args, field):
                assert getattr(tr.args, field) == {**(given or {}), "use_reentrant": False}
    tr = trainer(hf_tiny.build("llama").model, tmp_path)
    assert not tr.args.gradient_checkpointing and not tr.args.gradient_checkpointing_kwargs


def test_accumulated_micro_batches_are_one_logical_batch_noised_once(tmp_path):
    """8 x 1 and 4 x 2 (per_device_train_batch_size x gradient_accumulation_steps) have the
    same expected batch, so with a noise seed (which fixes the sampling too) they draw the
    same Poisson batches (checked: the 4 x 2 micro-batches pair up into the 8 x 1 ones) and,
    with noise added once per logical batch, end at the same parameters; a noise draw per
    micro-batch would not."""
    priv = privacy(noise_seed=5)
    data = make_data(40)
    runs = {}
    for bs, acc in ((8, 1), (4, 2)):
        drawn = []
        _, counting = _realised_sizes(collate, drawn)
        with pytest.warns(UserWarning, match=NOT_PRIVATE):
            tr = DPTrainer(
                model=hf_tiny.build("llama").model,
                args=targs(
                    tmp_path / str(acc),
                    per_device_train_batch_size=bs,
                    gradient_accumulation_steps=acc,
                    max_steps=3,
                ),
                train_dataset=data,
                data_collator=counting,
                privacy=priv,
            )
        tr.train()
        assert tr.optimizer.optimizer.dp_step == 3 and tr.accountant.history == [[1.0, 0.2, 3]]
        runs[acc] = (params_of(tr.model), drawn)
    (one, drawn1), (two, drawn2) = runs[1], runs[2]
    merged = [drawn2[2 * k] + drawn2[2 * k + 1] for k in range(len(drawn2) // 2)]
    n = min(len(merged), len(drawn1))
    assert n >= 3 and [sorted(b) for b in merged[:n]] == [sorted(b) for b in drawn1[:n]]
    for name, p in one.items():
        torch.testing.assert_close(two[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_sigma_is_calibrated_for_the_epochs_of_the_run(tmp_path):
    """num_train_epochs=2 and max_steps=-1 on N = 20 with B_e = 4 x 2 = 8: an epoch is
    ceil(20 / 8) = 3 logical batches, so 6 releases at q = 8 / 20 are accounted, and the
    epsilon they spend is within (0.9, 1] of the target."""
    target, n = 4.0, 20
    tr = DPTrainer(
        model=hf_tiny.build("llama").model,
        args=targs(tmp_path, max_steps=-1, num_train_epochs=2),
        train_dataset=make_data(n),
        data_collator=collate,
        privacy=PrivacyArguments(target_epsilon=target, target_delta=1e-3, loss_normalizer=12),
    )
    out = tr.train()
    steps = 2 * math.ceil(n / 8)
    assert tr.planned_steps == steps and tr.state.global_step == steps
    assert tr.accountant.steps == steps
    assert tr.accountant.history == [[tr.noise_multiplier, 8 / n, steps]]
    eps = out.metrics["epsilon"]
    assert 0.9 * target < eps <= target + 1e-6
    assert eps == pytest.approx(tr.privacy_spent()["epsilon"])
    assert out.metrics["epoch"] == pytest.approx(2.0)


def test_a_large_target_delta_is_warned_about_once(tmp_path):
    """target_delta >= 1/N: one warning per train() (the loader and the calibration
    both read the plan)."""
    tr = trainer(
        hf_tiny.build("llama").model, tmp_path, max_steps=1, priv=privacy(target_delta=0.1)
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tr.train()
    assert sum("not well below 1/N" in str(w.message) for w in seen) == 1
