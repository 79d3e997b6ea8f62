"""One training run of ``dpkern compare``: :class:`RunConfig`, the dpkern optimizer it
names (:data:`OPTIMIZERS`), :func:`train_one`, and the runs in worker processes."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import torch

from ... import rules
from ...accounting import PrivacyAccountant
from ...grad_sample import compute_grad_sample
from ...sampling import PoissonBatchSampler
from .tasks import _task

# name (finetune's) -> (class, learning-rate grid; the third value is --quick's), from the
# registry: the grids (RuleSpec.lr_grid) bracket the best values of a 5-point sweep at
# epsilon 1 and 7 on digits (seed 0).
OPTIMIZERS: dict[str, tuple[type, tuple[float, ...]]] = {
    spec.cli_name: (spec.optimizer_class(), spec.lr_grid)
    for spec in rules.RULES.values()
    if spec.lr_grid
}
#: "<name>+bc": a family whose class takes ``noise_bias_correction`` (SPEC 10), run with it
#: on. Its grid is the family's divided by 30: the corrected denominator (floored at
#: gamma) is smaller than sqrt(v) wherever the noise dominates v, so steps are larger (the
#: built-in BC rules' grids sit 100x below their twins').
BC_SUFFIX = "+bc"
OPTIMIZERS.update(
    {
        spec.cli_name + BC_SUFFIX: (
            spec.optimizer_class(),
            tuple(float(f"{lr / 30:.3g}") for lr in spec.lr_grid),
        )
        for spec in rules.RULES.values()
        if spec.lr_grid
        and spec.noise_bias_correction
        and "noise_bias_correction" in spec.hyper_fields
    }
)


def spec_of(name: str) -> rules.RuleSpec:
    """The rule of a compare name (``dp-rmsprop`` or ``dp-rmsprop+bc``)."""
    return rules.by_cli_name(name.removesuffix(BC_SUFFIX))


# --weight-decay applies to the rules with decoupled decay only
DECOUPLED = tuple(n for n in OPTIMIZERS if spec_of(n).decoupled_decay)


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs besides the task (picklable for worker processes)."""

    task: str
    optimizer: str
    epsilon: float
    seed: int
    lr: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    max_grad_norm: float
    weight_decay: float
    backend: str
    accountant: str


def make_optimizer(name: str, params, cfg: RunConfig, expected_batch_size: float):
    """The dpkern optimizer ``name`` (a key of :data:`OPTIMIZERS`) for ``cfg``; noise key =
    the run's seed (finetune's --noise-seed: reproducible and NOT private, so two
    optimizers at the same seed see the same noise draws). DP-MacAdam has no clipping
    bound to set (it adapts it)."""
    cls, _ = OPTIMIZERS[name]
    options = spec_of(name).optimizer_options()
    kw = dict(
        lr=cfg.lr,
        noise_multiplier=cfg.noise_multiplier,
        expected_batch_size=expected_batch_size,
        seed=cfg.seed,
        backend=cfg.backend,
    )
    if "max_grad_norm" in options:  # not for whitening rules (DP-MacAdam)
        kw["max_grad_norm"] = cfg.max_grad_norm
    if name in DECOUPLED:
        kw["weight_decay"] = cfg.weight_decay
    if name.endswith(BC_SUFFIX):
        kw["noise_bias_correction"] = True
    return cls(params, **kw)


def train_one(cfg: RunConfig) -> dict:
    """Train one model privately and measure it.

    Returns a row of :data:`CSV_RUN_FIELDS` (val_metric, test_metric, epsilon_spent from a
    :class:`~dpkern.accounting.PrivacyAccountant` stepped once per optimizer step).
    Raises: RuntimeError when the accountant reports more than the target epsilon."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: several threads per run cost more than they give
    try:
        return _train_one(cfg)
    finally:
        torch.set_num_threads(threads)


def _train_one(cfg: RunConfig) -> dict:
    task = _task(cfg.task)
    t0, c0 = time.perf_counter(), time.process_time()
    model = task.make_model(cfg.seed)
    model.train()
    n = task.num_train
    opt = make_optimizer(
        cfg.optimizer, [p for p in model.parameters() if p.requires_grad], cfg, cfg.sample_rate * n
    )
    if hasattr(opt, "train"):  # schedule-free (SPEC 10.8): train at y, evaluate at x
        opt.train()
    accountant = PrivacyAccountant(cfg.accountant)
    sampler = PoissonBatchSampler(n, cfg.sample_rate, cfg.steps, seed=cfg.seed)
    for batch in sampler:
        ids = torch.tensor(batch, dtype=torch.long)
        compute_grad_sample(
            model, task.loss_fn, task.train[0][ids], *[t[ids] for t in task.train[1:]]
        )
        opt.step()
        opt.zero_grad()
        accountant.step(cfg.noise_multiplier, cfg.sample_rate)
    if hasattr(opt, "eval"):
        opt.eval()
    spent = accountant.get_epsilon(cfg.delta)
    if spent > cfg.epsilon:
        raise RuntimeError(
            f"{cfg.optimizer} seed {cfg.seed}: spent epsilon {spent:.4f} > target {cfg.epsilon}"
        )
    return dict(
        task=cfg.task,
        optimizer=cfg.optimizer,
        epsilon=cfg.epsilon,
        seed=cfg.seed,
        lr=cfg.lr,
        noise_multiplier=cfg.noise_multiplier,
        sample_rate=cfg.sample_rate,
        steps=cfg.steps,
        epsilon_spent=spent,
        delta=cfg.delta,
        val_metric=task.evaluate(model, "val"),
        test_metric=task.evaluate(model, "test"),
        seconds=time.perf_counter() - t0,
        cpu_seconds=time.process_time() - c0,
    )


def _results(configs: list[RunConfig], jobs: int):
    """train_one over ``configs``, in order, in ``jobs`` worker processes (1 = in-process)."""
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            yield from pool.map(train_one, configs)
    else:
        for cfg in configs:
            yield train_one(cfg)
