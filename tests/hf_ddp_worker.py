"""DPTrainer under DDP: the script ``tests/test_integration_transformers_ddp.py`` launches
with ``python -m torch.distributed.run --standalone --nproc_per_node 2`` (gloo on CPU), and
the single-process reference the test runs in its own process (:func:`run`).

``python hf_ddp_worker.py OUT`` on every rank runs the scenarios below and writes its
results under ``OUT`` (``rank{r}.pt``; the test compares them):

- ``seeded``: a seeded DP-SGD run of 3 steps saving checkpoints 2 and 3 (the run the test
  compares with a single process): the weights, each rank's micro-batches of epoch 0, the
  log history, the ranks that wrote the privacy record, the parameters with a ``.grad``;
- ``resumed``: a new trainer resumed from that checkpoint-2 to step 3;
- ``secure``: 2 steps without a noise seed (keys broadcast from rank 0);
- ``mismatch_lr`` / ``mismatch_seed`` / ``mismatch_data``: rank 1 with another learning
  rate / noise seed / dataset size; the DistributedDPError each rank raised.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402

N, STEPS, NOISE_SEED = 48, 3, 2024


def make_data(n: int = N) -> list[dict]:
    """``n`` examples of random token ids of lengths 4..12, each with its index."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 13, (1,), generator=g))
        out.append({"idx": i, "input_ids": torch.randint(3, hf_tiny.V, (length,), generator=g)})
    return out


collate = hf_tiny.collate  # (it drops ``idx``)


def run(out, *, steps=STEPS, noise_seed=NOISE_SEED, lr=0.5, n=N, resume=None, save_steps=None):
    """One DPTrainer run (DP-SGD, noise sigma 1, B_e = 4 x 2 = 8 of N = 48); returns
    ``(trainer, micro_batches, record_writers)``: ``micro_batches`` the index lists the
    training loader's sampler yields in epoch 0 (this rank's)."""
    from transformers import TrainingArguments

    import dpkern.integrations.transformers.saving as hft
    from dpkern.integrations.transformers import DPTrainer, PrivacyArguments

    writers = []
    write = hft.write_record

    def counting_write(output_dir, record):  # who writes the privacy record
        writers.append(int(os.environ.get("RANK", "0")))
        write(output_dir, record)

    hft.write_record = counting_write
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=lr,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,  # the collator drops "idx"
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (noise_seed: "not private")
        tr = DPTrainer(
            model=hf_tiny.build("llama").model,
            args=args,
            train_dataset=make_data(n),
            data_collator=collate,
            privacy=PrivacyArguments(
                noise_multiplier=1.0,
                target_delta=1e-3,
                loss_normalizer=12,
                max_grad_norm=0.1,
                noise_seed=noise_seed,
            ),
        )
        try:
            tr.train(resume_from_checkpoint=resume)
        finally:
            hft.write_record = write
    sampler = tr.callback_handler.train_dataloader.batch_sampler
    sampler.set_epoch(0)  # (seeded: the same draws as in training)
    return tr, list(sampler), writers


def _state(tr) -> dict:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def main(out: str) -> None:
    import torch.distributed as dist

    from dpkern.distributed import DistributedDPError

    logging.getLogger("absl").setLevel(logging.ERROR)
    rank = int(os.environ["RANK"])
    res = {}
    tr, batches, writers = run(os.path.join(out, "seeded"), save_steps=2)
    res["seeded"] = {
        "params": _state(tr),
        "batches": batches,
        "logs": tr.state.log_history,
        "writers": writers,
        "grads": [n for n, p in tr.model.named_parameters() if p.grad is not None],
        "wrapped": type(tr.model_wrapped).__name__,
        "ledger": tr.accountant.history,
        "spent": tr.privacy_spent(),
    }
    dist.barrier()  # checkpoint-2 is written (rank 0) before any rank reads it
    tr, _, _ = run(os.path.join(out, "resumed"), resume=os.path.join(out, "seeded", "checkpoint-2"))
    res["resumed"] = {
        "params": _state(tr),
        "ledger": tr.accountant.history,
        "logs": tr.state.log_history,
    }
    tr, _, _ = run(os.path.join(out, "secure"), steps=2, noise_seed=None)
    res["secure"] = {"params": _state(tr), "logs": tr.state.log_history}
    for name, kw in (
        ("mismatch_lr", {"lr": 0.5 if rank == 0 else 0.25}),
        ("mismatch_seed", {"noise_seed": NOISE_SEED + rank}),
        ("mismatch_data", {"n": N - rank}),
    ):
        try:
            run(os.path.join(out, name), steps=1, **kw)
            res[name] = None
        except DistributedDPError as exc:
            res[name] = str(exc)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
