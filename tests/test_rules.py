"""The update-rule registry (dpkern.rules) and everything derived from it.

Every table that enumerates rules (classes, backends' dispatch and codes, the command-line
choices) agrees with the registry; a rule whose states are not shaped like the parameter
(a factored second moment) runs on the reference end to end -- optimizer states, steps,
checkpoints -- and the fused backends refuse a rule they have no kernel for with a clear
error ("auto" runs it on the reference with a warning)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import pytest
import torch

import dpkern
from dpkern import backends, hyper, optim, rules
from dpkern.backends import reference as ref
from dpkern.optim import DPOptimizer


# ---------------------------------------------------------------------------------------
# The registry itself
# ---------------------------------------------------------------------------------------
def test_specs_are_consistent():
    specs = list(rules.RULES.values())
    assert len({s.cli_name for s in specs}) == len(specs)
    for name, spec in rules.RULES.items():
        assert spec.name == name and spec.hyper_class.rule == name
        cls = spec.optimizer_class()
        assert cls.rule is spec and cls.hyper_class is spec.hyper_class
        assert spec.optimizer in dpkern.__all__ and getattr(dpkern, spec.optimizer) is cls
        assert spec.optimizer in optim.__all__
        assert callable(getattr(dpkern.functional, f"dp_{name}", dpkern.functional.dp_step))
        assert rules.get(name) is spec and rules.by_cli_name(spec.cli_name) is spec
        assert spec.lr_grid and spec.section and spec.source
        if spec.noise_bias_correction:
            assert not spec.state("noise_var_avg").kernel
        assert ("max_grad_norm" in spec.optimizer_options()) == (not spec.whitening)


def test_unknown_names_are_value_errors():
    with pytest.raises(ValueError, match="unknown update rule 'adambc'"):
        rules.get("adambc")
    with pytest.raises(ValueError, match="unknown optimizer 'adam_bc'"):
        rules.by_cli_name("adam_bc")
    with pytest.raises(ValueError, match="already registered"):
        rules.register(rules.get("sgd"))


def test_spec_validation():
    with pytest.raises(ValueError, match="rule"):
        rules.RuleSpec("adam", "x", "X", hyper.SGDHyper, "X", ())
    with pytest.raises(ValueError, match="noise_var_avg"):
        rules.RuleSpec("adam_bc", "x", "X", hyper.AdamBCHyper, "X", (), noise_bias_correction=True)
    with pytest.raises(ValueError, match="shape kind"):
        rules.StateSpec("x", "diagonal")
    with pytest.raises(ValueError, match="domain"):
        rules.StateSpec("x", domain="odd")


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (1, 1), (2, 0, 3)])
def test_state_shapes_and_factor_indexing(shape):
    """row / col state shapes, and factor_sizes' flat indexing of them (what the fused
    backends use to address a factored state from a block of the flat parameter)."""
    n = math.prod(shape)
    row, col = rules.state_shape(rules.ROW, shape), rules.state_shape(rules.COL, shape)
    assert rules.state_shape(rules.PARAM, shape) == shape
    assert rules.state_shape(rules.SCALAR, shape) == ()
    inner, matrix = rules.factor_sizes(shape)
    if len(shape) >= 2:
        assert row == shape[:-1] and col == shape[:-2] + shape[-1:]
    else:
        assert row == shape and col == ()
    for j in range(n):
        idx = torch.unravel_index(torch.tensor(j), shape) if shape else ()
        idx = tuple(int(i) for i in idx)
        want_row = idx[:-1] if len(shape) >= 2 else idx
        want_col = idx[:-2] + idx[-1:] if len(shape) >= 2 else ()
        flat = lambda ix, sh: int(torch.tensor(ix) @ torch.tensor(_strides(sh))) if sh else 0
        assert j // inner == flat(want_row, row)
        assert (j // matrix) * inner + j % inner == flat(want_col, col)


def _strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def test_every_backend_implements_every_registered_rule():
    """The built-in rules have their function in every backend; the fused backends' own
    tables name registered rules only (checked again at import)."""
    assert set(ref.UPDATES) == set(rules.RULES)
    for name in ("cpp", "triton"):
        module = backends._load(name)[0]
        if module is None:
            continue
        for rule in rules.RULES:
            assert module.supports(rule), (name, rule)
    try:
        from dpkern.backends.triton import rules as triton_rules
    except ImportError:
        return
    assert set(triton_rules.RULES) == set(rules.RULES)


def test_cli_choices_come_from_the_registry():
    from dpkern.cli import compare
    from dpkern.cli.finetune import options

    names = tuple(s.cli_name for s in rules.RULES.values())
    assert options.OPTIMIZERS == names
    # compare: every rule, then "+bc" for each family whose class takes the option
    bc = tuple(
        s.cli_name + "+bc"
        for s in rules.RULES.values()
        if s.noise_bias_correction and "noise_bias_correction" in s.hyper_fields
    )
    assert {"dp-rmsprop+bc", "dp-adagrad+bc", "dp-radam+bc", "dp-adafactor+bc"} <= set(bc)
    assert "dp-lion+bc" not in bc and "dp-adambc+bc" not in bc
    assert tuple(compare.OPTIMIZERS) == names + bc
    assert set(compare.QUICK_OPTIMIZERS) <= set(names)
    for cli, (cls, grid) in compare.OPTIMIZERS.items():
        spec = rules.by_cli_name(cli.removesuffix("+bc"))
        want = tuple(float(f"{lr / 30:.3g}") for lr in spec.lr_grid) if cli in bc else spec.lr_grid
        assert cls is spec.optimizer_class() and grid == want
    decoupled = tuple(
        n for n in compare.OPTIMIZERS if rules.by_cli_name(n.removesuffix("+bc")).decoupled_decay
    )
    assert compare.DECOUPLED == decoupled
    assert {"dp-adamw", "dp-adamw-bc", "dp-ademamix", "dp-lion", "dp-adafactor"} <= set(
        compare.DECOUPLED
    )
    pytest.importorskip("transformers")
    from dpkern.integrations import transformers as hf

    assert tuple(hf.OPTIMIZERS) == tuple(s.cli_name for s in rules.RULES.values() if s.ghost)


def test_hyper_tables_moved_with_a_warning():
    with pytest.warns(DeprecationWarning, match="dpkern.rules"):
        assert hyper.RULES == tuple(rules.RULES)
    with pytest.warns(DeprecationWarning):
        assert hyper.HYPER_CLASSES["adam_bc"] is hyper.AdamBCHyper


def test_cpp_codes_and_hyper_parameters_by_name():
    """The extension's rule codes are looked up by name; it refuses unknown codes, keys
    and variance estimates (never runs them as another rule or a default)."""
    _C = pytest.importorskip("dpkern._C")
    from dpkern.backends import cpp

    codes = _C.rule_codes()
    assert set(codes) <= set(rules.RULES) and len(set(codes.values())) == len(codes)
    for name, spec in rules.RULES.items():
        h = spec.hyper_class(lr=0.1)
        d = cpp._hyper_dict(h)
        assert d["rule"] == codes[name]
        # update_rms_clip is the host's (it forms the scale, SPEC 10.9): never sent
        assert set(d) == {"rule", *spec.hyper_fields} - {"update_rms_clip"}
    dp = (1, 1, 0, 0.0, 1.0, 0.0, 1, False)
    with pytest.raises(ValueError, match="unknown hyper-parameter 'bogus'"):
        _C.step({"rule": codes["sgd"], "lr": 0.1, "bogus": 1.0}, dp, [], 0, 0)
    with pytest.raises(ValueError, match="unknown variance_estimate 'median'"):
        _C.step({"rule": codes["macadam"], "lr": 0.1, "variance_estimate": "median"}, dp, [], 0, 0)


# ---------------------------------------------------------------------------------------
# A rule with states not shaped like the parameter (a test-only factored second moment)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToyFactoredHyper(hyper._Base):
    """A test rule: Adafactor-like factored second moment, no momentum."""

    rule: ClassVar[str] = "toy_factored"
    beta2: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        hyper.check_beta("beta2", self.beta2)


TOY = rules.RuleSpec(
    "toy_factored",
    "dp-toy-factored",
    "DP-ToyFactored",
    ToyFactoredHyper,
    "DPToyFactored",
    (
        rules.StateSpec("exp_avg_sq_row", rules.ROW, domain="nonnegative"),
        rules.StateSpec("exp_avg_sq_col", rules.COL, domain="nonnegative"),
        rules.StateSpec("updates", rules.SCALAR, domain="nonnegative"),
    ),
    second_moment=True,
)


def update_toy_factored(h, dp, p, g, state):
    """v = R C^T / mean(R) (factored over the trailing matrix; a vector keeps its own)."""
    row, col, n = state["exp_avg_sq_row"], state["exp_avg_sq_col"], state["updates"]
    g2 = g * g + 1e-30
    if p.dim() >= 2:
        row.mul_(h.beta2).add_((1 - h.beta2) * g2.mean(dim=-1))
        col.mul_(h.beta2).add_((1 - h.beta2) * g2.mean(dim=-2))
        v = row.unsqueeze(-1) * col.unsqueeze(-2) / row.mean(dim=-1)[..., None, None]
    else:
        row.mul_(h.beta2).add_((1 - h.beta2) * g2)
        v = row
    n.add_(1.0)
    p.sub_(h.lr * g / (v.sqrt() + 1e-8))
    return 0.0


class DPToyFactored(DPOptimizer):
    rule = TOY

    def __init__(self, params, lr=1e-2, beta2=0.9, *, max_grad_norm, noise_multiplier,
                 expected_batch_size, seed=None, backend="auto", nonfinite="error"):  # fmt: skip
        super().__init__(
            params,
            dict(lr=lr, beta2=beta2),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            backend=backend,
            nonfinite=nonfinite,
        )


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(rules._REGISTRY, TOY.name, TOY)
    monkeypatch.setitem(ref.UPDATES, TOY.name, update_toy_factored)
    return TOY


SHAPES = [(3, 4), (5,), (), (2, 3, 4)]


def _toy_run(backend, steps=3, seed=7):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = DPToyFactored(
        params, lr=0.05, max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4.0,
        seed=seed, backend=backend,
    )  # fmt: skip
    for _ in range(steps):
        for p in params:
            p.grad_sample = torch.randn((4, *p.shape), generator=g)
        opt.step()
    return params, opt


def test_factored_rule_runs_on_the_reference(toy):
    params, opt = _toy_run("torch")
    for p in params:
        st = opt.state[p]
        assert tuple(st["exp_avg_sq_row"].shape) == rules.state_shape(rules.ROW, p.shape)
        assert tuple(st["exp_avg_sq_col"].shape) == rules.state_shape(rules.COL, p.shape)
        assert st["updates"].shape == () and float(st["updates"]) == 3.0
        assert all(v.dtype == torch.float32 for v in st.values())
        assert torch.isfinite(p).all()
    assert opt.group_hyper(0) == ToyFactoredHyper(lr=0.05, beta2=0.9)


def test_factored_rule_checkpoint_round_trip(toy):
    params, opt = _toy_run("torch")
    sd = opt.state_dict()
    again, opt2 = _toy_run("torch", steps=1)
    opt2.load_state_dict(sd)
    for p, q in zip(params, again, strict=True):
        for name in TOY.state_names:
            assert torch.equal(opt.state[p][name], opt2.state[q][name])
    bad = opt.state_dict()
    bad["state"][0]["exp_avg_sq_col"] = torch.zeros(3)  # col state of a (3, 4) parameter: (4,)
    with pytest.raises(ValueError, match=r"'exp_avg_sq_col' has shape \(3,\), expected \(4,\)"):
        opt2.load_state_dict(bad)


def test_factored_rule_functional(toy):
    params = [torch.randn(s) for s in SHAPES]
    states = {
        st.name: [torch.zeros(st.shape_for(p.shape)) for p in params] for st in TOY.kernel_states
    }
    grads = [torch.randn((2, *p.shape)) for p in params]
    kw = dict(step=1, key=3, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2.0)
    dpkern.functional.dp_step(
        ToyFactoredHyper(lr=0.1), params, grads, states, backend="torch", **kw
    )
    assert float(states["updates"][0]) == 1.0
    states["exp_avg_sq_row"][0] = torch.zeros(4)  # a param-shaped buffer where a row one goes
    with pytest.raises(ValueError, match=r"exp_avg_sq_row\[0\]: expected float32 of shape \(3,\)"):
        dpkern.functional.dp_step(ToyFactoredHyper(lr=0.1), params, grads, states, **kw)
    with pytest.raises(ValueError, match="states: expected"):
        dpkern.functional.dp_step(ToyFactoredHyper(lr=0.1), params, grads, {}, **kw)


@pytest.mark.parametrize("name", ["cpp", pytest.param("triton", marks=pytest.mark.triton)])
def test_fused_backends_refuse_a_rule_without_kernel(toy, name):
    if not backends.is_available(name):
        pytest.skip(f"backend {name!r} not available")
    module = backends._load(name)[0]
    assert not module.supports(TOY.name)
    device = torch.device("cpu")
    if name == "triton" and not backends.triton_interpret():
        with pytest.raises(RuntimeError):
            backends.resolve(name, device, TOY.name)
        return
    with pytest.raises(NotImplementedError, match="no kernel for the update rule 'toy_factored'"):
        backends.resolve(name, device, TOY.name)
    with pytest.raises(NotImplementedError, match="toy_factored"):
        _toy_run(name)


def test_auto_runs_a_rule_without_kernel_on_the_reference(toy):
    want, _ = _toy_run("torch")
    backends._warned_rules.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = _toy_run("auto")
    if backends.is_available("cpp"):
        assert any("toy_factored" in str(w.message) for w in caught)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_repr_names_what_auto_resolves_to(toy, monkeypatch):
    _, opt = _toy_run("auto", steps=0)
    # no kernel for the toy rule: auto runs it on the reference, and the repr says so
    assert backends.resolved_name("auto", "cpu", TOY.name) == "torch"
    assert "backend: auto (torch)" in repr(opt)
    p = torch.nn.Parameter(torch.randn(3))
    sgd = dpkern.DPSGD([p], lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2)
    ran = "cpp" if backends.is_available("cpp") else "torch"
    assert "backend: auto (" + ran + ")" in repr(sgd)
    assert backends.describe("auto", "cpu", "sgd") == f"auto ({ran})"
    assert backends.describe("torch", "cpu") == "torch"
    monkeypatch.setattr(backends, "_load", lambda name: (None, "not built"))
    assert "backend: auto (torch)" in repr(sgd)  # cpp missing: the reference, said so
    assert backends.describe("auto", "cuda") == "auto (torch)"


# ---------------------------------------------------------------------------------------
# The optimizers' public hooks
# ---------------------------------------------------------------------------------------
def test_public_hooks():
    p = torch.nn.Parameter(torch.randn(3))
    opt = dpkern.DPAdamW(
        [p], lr=0.1, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2.0, seed=1
    )
    assert opt.group_hyper(0) == opt.group_hyper(opt.param_groups[0]) == hyper.AdamWHyper(lr=0.1)
    with pytest.raises(ValueError, match="reproducible mode"):
        opt.adopt_key(5)
    p.grad_sample = torch.randn(2, 3)
    opt.check_inputs()  # validates, changes nothing
    assert p.grad_sample is not None and not opt.state
    p.grad_sample = torch.randn(2, 4)
    with pytest.raises(ValueError, match="grad_sample has shape"):
        opt.check_inputs()
    opt.accumulate_clipped([torch.ones(3)], 4, clipped_samples=3, nonfinite_samples=1)
    assert opt.stats == dict(steps=0, samples=4, clipped_samples=3, nonfinite_samples=1)
    secure = dpkern.DPSGD(
        [p], lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2
    )
    before = secure.key_fingerprint()
    secure.adopt_key(12345)
    assert secure.key_fingerprint() != before
