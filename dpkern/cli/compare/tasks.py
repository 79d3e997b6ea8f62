"""The benchmarks of ``dpkern compare``: :class:`Task` (data splits, a model factory, a
per-sample loss, the metric), the digits task (a small CNN) and the text task (the finetune
job's model and data)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from torch import Tensor, nn


@dataclass
class Task:
    """One benchmark: data splits, a model factory, a per-sample loss and the metric.

    ``train`` is a tuple of tensors whose first dimension indexes the privacy unit (one
    image, one text block); ``loss_fn(output, *targets)`` is the loss of ONE sample as
    :func:`dpkern.grad_sample.compute_grad_sample` calls it; ``evaluate(model, split)``
    returns the metric (a float) on ``split`` ("val" or "test")."""

    name: str
    metric: str
    higher_is_better: bool
    train: tuple[Tensor, ...]
    make_model: Callable[[int], nn.Module]
    loss_fn: Callable
    evaluate: Callable[[nn.Module, str], float]
    epochs: float = 15.0  # default expected passes over the training set (EPOCHS)
    quick_epochs: float = 1.0  # --quick's (EPOCHS)

    @property
    def num_train(self) -> int:
        return int(self.train[0].shape[0])


# per task: (default --epochs, --quick's epochs), for the tasks below and the options' help
EPOCHS = {"digits": (15.0, 1.0), "text": (1.0, 0.05)}

# per task: the modules its training runs import beyond dpkern's own dependencies, each
# with the extra of pyproject.toml that installs it; checked by _task before anything runs
TRAINING_NEEDS = {"digits": (("sklearn", "compare"),), "text": (("transformers", "llm"),)}


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits (about 6.2 k parameters): two conv 3x3 -> GroupNorm ->
    tanh -> max-pool stages, then a linear classifier. Input float32 ``[B, 1, 8, 8]`` in
    [0, 1]; output logits ``[B, 10]``. GroupNorm, never BatchNorm (per-sample), and tanh
    (bounded activations help under DP: Papernot et al., AAAI 2021)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def digits_splits(split_seed: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """scikit-learn's ``load_digits`` as {"train", "val", "test"} -> (x float32
    ``[N, 1, 8, 8]`` scaled to [0, 1], y int64 ``[N]``): a stratified 70/15/15 split,
    fixed by ``split_seed`` (public: it is not part of the private randomness)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    idx = list(range(len(y)))
    train, rest = train_test_split(idx, test_size=0.3, random_state=split_seed, stratify=y)
    val, test = train_test_split(rest, test_size=0.5, random_state=split_seed, stratify=y[rest])
    xt = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    yt = torch.tensor(y, dtype=torch.long)
    return {
        name: (xt[ids], yt[ids]) for name, ids in (("train", train), ("val", val), ("test", test))
    }


def digits_task() -> Task:
    """The digits task: :class:`DigitsCNN`, cross-entropy, accuracy in %."""
    splits = digits_splits()

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return DigitsCNN()

    @torch.no_grad()
    def evaluate(model: nn.Module, split: str) -> float:
        x, y = splits[split]
        model.eval()
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()

    epochs, quick_epochs = EPOCHS["digits"]
    return Task(
        "digits",
        "test accuracy (%)",
        True,
        splits["train"],
        make_model,
        TF.cross_entropy,
        evaluate,
        epochs=epochs,
        quick_epochs=quick_epochs,
    )


TEXT_BLOCK_SIZE = 64  # the finetune job's default block (the privacy unit)
TEXT_VAL_FRACTION = 0.1  # held out by dpkern.data.split_blocks, then halved: val | test


def text_task() -> Task:
    """The text task: the finetune job's default byte-level GPT-2 (dpkern.models) on its
    default corpus (dpkern.data: CPython's help pages), blocks of 64 bytes as the privacy
    unit, its per-block next-token loss; the held-out 10% of blocks is halved into
    validation and test. Metric: perplexity per byte, exp(mean loss), lower is better."""
    from ... import data, models

    blocks = data.make_blocks(data.byte_encode(data.default_text()), TEXT_BLOCK_SIZE)
    train, held = data.split_blocks(blocks, TEXT_VAL_FRACTION)
    half = held.shape[0] // 2
    splits = {"val": held[:half], "test": held[half:]}

    def make_model(seed: int) -> nn.Module:
        return models.CausalLMLogits(models.default_model(TEXT_BLOCK_SIZE, seed=seed))

    def evaluate(model: nn.Module, split: str) -> float:
        return math.exp(models.evaluate(model, splits[split], 64, torch.device("cpu")))

    # sample_loss(logits, ids) gets the block as input and as target: train = (ids, ids)
    epochs, quick_epochs = EPOCHS["text"]
    return Task(
        "text",
        "held-out perplexity (per byte)",
        False,
        (train, train),
        make_model,
        models.sample_loss,
        evaluate,
        epochs=epochs,
        quick_epochs=quick_epochs,
    )


TASKS = {"digits": digits_task, "text": text_task}

_TASK_CACHE: dict[str, Task] = {}


class MissingExtra(ImportError):
    """A module a task needs is not installed; the message names the extra to install."""


def _task(name: str, *, training: bool = True) -> Task:
    """The task ``name``, built once. ``training`` (not for --from-runs, which only reports):
    first check that the modules its training runs import are installed.

    Raises: MissingExtra (an ImportError) naming the module and the extra to install."""
    for module, extra in TRAINING_NEEDS.get(name, ()) if training else ():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(
                f"--task {name} needs {module}: pip install 'dpkern[{extra}]'", name=module
            ) from exc
    if name not in _TASK_CACHE:
        _TASK_CACHE[name] = TASKS[name]()
    return _TASK_CACHE[name]
