"""Ghost clipping (issue 8): per-layer Linear weight norms (dpkern Gram path, instantiation,
Opacus' ghost-clipping norm sampler) and one end-to-end DP step of the default GPT-2
(ghost, per-sample, Opacus fast gradient clipping, non-private), each a benchmark group.
The same workloads as ``python -m bench.ghost`` (see bench/ghost.py)."""

import pytest

from bench.conftest import DEVICE, FULL, run_pedantic
from bench.ghost import (
    DEFAULT_BATCHES,
    DEFAULT_BLOCKS,
    DEFAULT_LAYERS,
    e2e_candidates,
    layer_candidates,
    parse_layer,
)

LAYERS = list(DEFAULT_LAYERS) if FULL else list(DEFAULT_LAYERS[:2])
BLOCKS = list(DEFAULT_BLOCKS) if FULL else [DEFAULT_BLOCKS[0]]
BATCHES = list(DEFAULT_BATCHES) if FULL else [DEFAULT_BATCHES[0]]
LAYER_NAMES = ("dpkern:gram", "dpkern:instantiate", "dpkern:triton", "baseline:opacus")
E2E_NAMES = ("floor:nonprivate", "dpkern:ghost", "dpkern:per_sample", "baseline:opacus")


def _pick(cands, name):
    """The candidate ``name``; for "baseline:opacus" the first Opacus candidate (Opacus 1.6
    refuses the tied GPT-2, so that is "baseline:opacus-untied", see bench/ghost.py)."""
    prefix = name if name != "baseline:opacus" else "baseline:"
    return next((c for c in cands if c.name.startswith(prefix)), None)


@pytest.mark.parametrize("name", LAYER_NAMES)
@pytest.mark.parametrize("shape", LAYERS)
def test_ghost_layer_norm(benchmark, shape, name):
    cand = _pick(layer_candidates(parse_layer(shape), DEVICE), name)
    if cand is None:
        pytest.skip(f"{name} does not run here")
    run_pedantic(benchmark, cand.run, f"ghost layer {shape} (BxTxDxP)")


@pytest.mark.parametrize("name", E2E_NAMES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block", BLOCKS)
def test_ghost_e2e_step(benchmark, block, batch, name):
    cands, notes, _ = e2e_candidates(block, batch, DEVICE, opacus=name.startswith("baseline"))
    cand = _pick(cands, name)
    if cand is None:
        pytest.skip(f"{name} does not run here: " + "; ".join(notes))
    benchmark.extra_info["notes"] = notes
    run_pedantic(benchmark, cand.run, f"ghost e2e block={block} B={batch}")
