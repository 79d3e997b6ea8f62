"""Accounting on dp-accounting, cross-checked against Opacus' accountants."""

from __future__ import annotations

import math

import pytest

from dpkern import accounting as A

opacus_rdp = pytest.importorskip("opacus.accountants")


@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.5, 5.0])
@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("steps,delta", [(100, 1e-5), (3000, 1e-6), (10000, 1e-5)])
def test_rdp_matches_opacus(sigma, q, steps, delta):
    """1e-3 relative wherever epsilon <= 12 (every practical budget). Beyond, the optimal
    RDP order is near 1, where dp-accounting drops orders whose series does not converge:
    its epsilon is then larger (looser, still valid), never smaller than Opacus'."""
    acc = opacus_rdp.RDPAccountant()
    acc.history = [(sigma, q, steps)]
    want = acc.get_epsilon(delta)
    got = A.get_epsilon(sigma, q, steps, delta)
    if want <= 12:
        assert got == pytest.approx(want, rel=1e-3)
    else:
        assert got >= want * (1 - 1e-3)


def test_pld_is_tighter_than_rdp_and_close_to_opacus_prv():
    eps_rdp = A.get_epsilon(1.0, 0.01, 1000, 1e-5, "rdp")
    eps_pld = A.get_epsilon(1.0, 0.01, 1000, 1e-5, "pld")
    assert eps_pld < eps_rdp
    prv = opacus_rdp.PRVAccountant()
    prv.history = [(1.0, 0.01, 1000)]
    assert eps_pld == pytest.approx(prv.get_epsilon(1e-5), rel=0.03)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_multiplier_calibration_hits_the_target(accountant):
    sigma = A.get_noise_multiplier(2.0, 1e-5, 0.02, 500, accountant)
    assert A.get_epsilon(sigma, 0.02, 500, 1e-5, accountant) <= 2.0
    assert A.get_epsilon(sigma - 0.01, 0.02, 500, 1e-5, accountant) > 2.0
    if accountant == "rdp":
        from opacus.accountants.utils import get_noise_multiplier

        want = get_noise_multiplier(
            target_epsilon=2.0,
            target_delta=1e-5,
            sample_rate=0.02,
            steps=500,
            accountant="rdp",
            epsilon_tolerance=0.001,
        )
        assert sigma == pytest.approx(want, rel=5e-3)


def test_budget_too_small_and_bad_arguments():
    with pytest.raises(ValueError, match="no noise_multiplier"):
        A.get_noise_multiplier(1e-9, 1e-12, 1.0, 10**6)
    for kwargs in [
        dict(target_epsilon=0),
        dict(target_delta=1.0),
        dict(sample_rate=1.5),
        dict(steps=-1),
        dict(accountant="gdp"),
    ]:
        args = {
            **dict(
                target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=10, accountant="rdp"
            ),
            **kwargs,
        }
        with pytest.raises(ValueError, match=list(kwargs)[0]):
            A.get_noise_multiplier(**args)
    assert A.get_epsilon(0.0, 0.01, 10, 1e-5) == math.inf
    assert A.get_epsilon(1.0, 0.0, 10, 1e-5) == 0.0


def test_running_accountant_with_schedule_and_state_dict():
    acc = A.PrivacyAccountant()
    for _ in range(50):
        acc.step(noise_multiplier=1.2, sample_rate=0.01)
    for _ in range(30):
        acc.step(noise_multiplier=0.9, sample_rate=0.01)
    assert acc.history == [[1.2, 0.01, 50], [0.9, 0.01, 30]] and acc.steps == 80
    ref = opacus_rdp.RDPAccountant()
    ref.history = [(1.2, 0.01, 50), (0.9, 0.01, 30)]
    assert acc.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-3)
    clone = A.PrivacyAccountant()
    clone.load_state_dict(acc.state_dict())
    assert clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    eps, delta = acc.get_privacy_spent(1e-5, numel=124_000_000)
    assert delta == pytest.approx(1e-5 + 80 * 62_000_000 * 2.0**-96)
    assert A.truncation_delta(10**4, 70 * 10**9) < 1e-14  # SPEC section 3's claim


# -- load_state_dict validates everything before it changes the ledger ----------------------
def _spent_ledger(accountant="rdp"):
    acc = A.PrivacyAccountant(accountant)
    acc.step(1.1, 0.02, 300)
    acc.step(0.8, 0.02, 100)
    return acc


@pytest.mark.parametrize(
    "state,match",
    [
        ({}, r"missing key\(s\) \['accountant', 'history'\]"),
        ({"accountant": "rdp"}, r"missing key\(s\) \['history'\]"),
        ({"history": []}, r"missing key\(s\) \['accountant'\]"),
        ({"accountant": "rdp", "history": [], "steps": 5}, r"unknown key\(s\) \['steps'\]"),
        ([["rdp"], []], "expected a dict"),
        (None, "expected a dict"),
        ({"accountant": "gdp", "history": []}, "invalid accountant='gdp'"),
        ({"accountant": None, "history": []}, "invalid accountant=None"),
        ({"accountant": "rdp", "history": "1.0,0.01,5"}, "invalid history of type str"),
        ({"accountant": "rdp", "history": {"a": 1}}, "invalid history of type dict"),
        ({"accountant": "rdp", "history": [[1.0, 0.01]]}, r"history\[0\]"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, 5], 7]}, r"history\[1\]"),
        (
            {"accountant": "rdp", "history": [[-1.0, 0.01, 5]]},
            r"noise_multiplier=-1.0: must be >= 0",
        ),
        ({"accountant": "rdp", "history": [[math.nan, 0.01, 5]]}, "noise_multiplier=nan"),
        ({"accountant": "rdp", "history": [[math.inf, 0.01, 5]]}, "noise_multiplier=inf"),
        ({"accountant": "rdp", "history": [["1.0", 0.01, 5]]}, "noise_multiplier='1.0'"),
        ({"accountant": "rdp", "history": [[True, 0.01, 5]]}, "noise_multiplier=True"),
        (
            {"accountant": "rdp", "history": [[1.0, 1.5, 5]]},
            r"sample_rate=1.5: must be in \[0, 1\]",
        ),
        ({"accountant": "rdp", "history": [[1.0, -0.1, 5]]}, "sample_rate=-0.1"),
        ({"accountant": "rdp", "history": [[1.0, math.nan, 5]]}, "sample_rate=nan"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, 2.5]]}, r"steps=2.5: expected an int >= 0"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, 5.0]]}, r"steps=5.0"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, -3]]}, r"steps=-3"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, "5"]]}, r"steps='5'"),
        ({"accountant": "rdp", "history": [[1.0, 0.01, True]]}, r"steps=True"),
        (
            {"accountant": "rdp", "history": [[1.0, 0.01, 5], [1.0, 0.01, None]]},
            r"history\[1\] steps=None",
        ),
    ],
)
def test_load_state_dict_refuses_bad_states_and_keeps_the_ledger(state, match):
    """A junk state (``{}`` wiped a spent ledger to epsilon 0 before) is a ValueError, and
    the ledger is unchanged: validation is complete before anything is assigned."""
    acc = _spent_ledger()
    before, eps = acc.state_dict(), acc.get_epsilon(1e-5)
    assert eps > 1.0
    with pytest.raises(ValueError, match=match):
        acc.load_state_dict(state)
    assert acc.state_dict() == before and acc.accountant == "rdp"
    assert acc.get_epsilon(1e-5) == eps and acc.steps == 400


@pytest.mark.parametrize("saved,mine", [("rdp", "pld"), ("pld", "rdp")])
def test_load_state_dict_refuses_the_other_accountant_kind(saved, mine):
    """An RDP checkpoint loaded into a PLD accountant switched its kind silently before."""
    acc = A.PrivacyAccountant(mine)
    acc.step(2.0, 0.01, 10)
    before = acc.state_dict()
    with pytest.raises(ValueError, match=rf"construct PrivacyAccountant\(accountant='{saved}'\)"):
        acc.load_state_dict(_spent_ledger(saved).state_dict())
    assert acc.accountant == mine and acc.state_dict() == before
    resumed = A.PrivacyAccountant(saved)  # the way the message gives
    resumed.load_state_dict(_spent_ledger(saved).state_dict())
    assert resumed.get_epsilon(1e-5) == _spent_ledger(saved).get_epsilon(1e-5)


def test_load_state_dict_accepts_valid_checkpoints():
    """Round trips, JSON (tuples become lists, ints stay ints), tuples, int sigma, an empty
    history, zero-step runs; the loaded ledger is a copy (later steps leave the dict)."""
    import json

    acc = _spent_ledger()
    for state in [
        acc.state_dict(),
        json.loads(json.dumps(acc.state_dict())),
        {"accountant": "rdp", "history": ((1.1, 0.02, 300), (0.8, 0.02, 100))},
    ]:
        clone = A.PrivacyAccountant()
        clone.load_state_dict(state)
        assert clone.history == acc.history and clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    state = {"accountant": "rdp", "history": [[2, 0, 0], [1, 1, 3]]}
    clone = A.PrivacyAccountant()
    clone.load_state_dict(state)
    assert clone.history == [[2.0, 0.0, 0], [1.0, 1.0, 3]]
    assert all(type(r[0]) is float and type(r[2]) is int for r in clone.history)
    clone.step(1.0, 1.0)
    assert state["history"][1] == [1, 1, 3] and clone.steps == 4
    empty = _spent_ledger()
    empty.load_state_dict({"accountant": "rdp", "history": []})  # explicit: a fresh ledger
    assert empty.get_epsilon(1e-5) == 0.0


def test_truncation_delta_and_privacy_spent_validate_numel():
    acc = _spent_ledger()
    for bad in (-1, 2.5, "10", None):
        with pytest.raises(ValueError, match="numel"):
            acc.get_privacy_spent(1e-5, numel=bad)
    assert A.truncation_delta(0, 0) == 0.0


def test_public_accountant_api_is_documented():
    """Every public method and property of PrivacyAccountant says what it takes, returns
    and raises (torch.optim's docstring standard)."""
    import inspect

    assert "Mironov" in A.PrivacyAccountant.__doc__ and "Balle" in A.PrivacyAccountant.__doc__
    assert "PLD" in A.PrivacyAccountant.__doc__ or "privacy loss" in A.PrivacyAccountant.__doc__
    for name, member in vars(A.PrivacyAccountant).items():
        if name.startswith("_") and name != "__init__":
            continue
        doc = inspect.getdoc(member.fget if isinstance(member, property) else member)
        if name == "__init__":
            doc = A.PrivacyAccountant.__doc__  # constructor arguments: in the class doc
        assert doc and len(doc) > 40, name
        if callable(member) and name not in ("__init__", "state_dict"):
            assert "Raises" in doc, name
        if callable(member) and name in ("get_epsilon", "get_privacy_spent", "state_dict"):
            assert "Returns" in doc, name


# -- fixed-shape batches: the truncation term, the epsilon(delta) curve ------------------------
def test_batch_truncation_is_charged_to_delta():
    from scipy import stats

    N, q, B_max, T = 10_000, 0.01, 140, 500  # mean 100, sd ~10: B_max 4 sd above
    eta = A.batch_overflow_probability(N, q, B_max)
    assert eta == pytest.approx(stats.binom.sf(B_max, N + 1, q), rel=1e-7)
    acc = A.PrivacyAccountant("rdp")
    acc.step(1.0, q, T, overflow_probability=eta)
    plain = A.PrivacyAccountant("rdp")
    plain.step(1.0, q, T)
    eps, total = acc.get_privacy_spent(1e-6, numel=1000)
    assert eps == plain.get_epsilon(1e-6)  # epsilon for the user's delta, as before
    want = 1e-6 + A.truncation_delta(T, 1000) + (1 + math.exp(eps)) * T * eta
    assert total == pytest.approx(want, rel=1e-12)
    report = acc.privacy_report(1e-6, numel=1000)
    assert report["delta_batch_truncation"] == pytest.approx((1 + math.exp(eps)) * T * eta)
    assert report["batch_overflow"] == pytest.approx(T * eta) and report["delta_total"] == total
    assert plain.privacy_report(1e-6, 1000)["delta_batch_truncation"] == 0.0
    # the ledger keeps the overflow mass through a checkpoint; old checkpoints load as 0
    clone = A.PrivacyAccountant("rdp")
    clone.load_state_dict(acc.state_dict())
    assert clone.get_privacy_spent(1e-6, 1000) == (eps, total)
    old = A.PrivacyAccountant("rdp")
    old.load_state_dict({"accountant": "rdp", "history": [[1.0, q, T]]})
    assert old.batch_overflow == 0.0
    for bad in (-1.0, math.nan, math.inf, "1e-9", True):
        with pytest.raises(ValueError, match="batch_overflow"):
            old.load_state_dict({"accountant": "rdp", "history": [], "batch_overflow": bad})
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="overflow_probability"):
            acc.step(1.0, q, overflow_probability=bad)
    assert acc.batch_overflow == pytest.approx(T * eta)  # unchanged by the refused steps


def test_overflow_delta_edge_cases():
    assert A.overflow_delta(0.0, math.inf) == 0.0
    assert A.overflow_delta(1e-30, 2.0) == pytest.approx((1 + math.e**2) * 1e-30)
    assert A.overflow_delta(1e-3, 1e4) == 1.0
    with pytest.raises(ValueError, match="overflow"):
        A.overflow_delta(-1.0, 1.0)
    with pytest.raises(ValueError, match="max_batch_size"):
        A.batch_overflow_probability(100, 0.1, -1)
    with pytest.raises(ValueError, match="unit_rows"):
        A.batch_overflow_probability({0: 3}, 0.1, 5)
    assert A.batch_overflow_probability(100, 0.0, 5) == 0.0
    assert A.batch_overflow_probability(10, 1.0, 10) == 1.0  # the neighbour has 11 rows
    assert A.batch_overflow_probability(10, 1.0, 11) == 0.0


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_epsilon_curve(kind):
    acc = A.PrivacyAccountant(kind)
    acc.step(1.1, 0.02, 200)
    deltas = [1e-9, 1e-7, 1e-5, 1e-3]
    curve = acc.epsilon_curve(deltas)
    assert curve == [acc.get_epsilon(d) for d in deltas]
    assert all(a >= b for a, b in zip(curve, curve[1:]))
    assert A.PrivacyAccountant(kind).epsilon_curve(deltas) == [0.0] * 4
    with pytest.raises(ValueError, match="delta"):
        acc.epsilon_curve([1e-5, 1.5])


@pytest.mark.parametrize("guess", [0.01, 2.0, 300.0])
def test_calibrate_extension_meets_the_target_from_any_guess(guess):
    """A ledger of 10 steps at sigma 2 and the target that 20 such steps spend: 10 more
    steps need sigma 2 again, whether the bracket starts below, at or above it."""
    from dpkern.accounting import calibrate_extension, get_epsilon

    q, delta = 0.05, 1e-3
    target = get_epsilon(2.0, q, 20, delta)
    sigma = calibrate_extension([[2.0, q, 10]], q, 10, target, delta, "rdp", guess=guess)
    assert sigma == pytest.approx(2.0, rel=2e-4) and get_epsilon(sigma, q, 20, delta) <= target
    with pytest.raises(ValueError, match="already spent the budget"):
        calibrate_extension([[0.5, q, 10]], q, 10, 0.5 * target, delta, "rdp", guess=guess)


def test_excluded_rdp_orders_are_not_logged_other_absl_messages_are(caplog):
    """dp-accounting's 'failed to converge ... Excluding this order' lines (dozens per
    calibration at q = 0.25) are dropped; the epsilon is unchanged and other absl
    warnings still reach the log."""
    import logging

    from dpkern.accounting import get_epsilon, get_noise_multiplier

    with caplog.at_level(logging.WARNING, logger="absl"):
        sigma = get_noise_multiplier(4.0, 1e-5, 0.25, 8)
        eps = get_epsilon(sigma, 0.25, 8, 1e-5)
        logging.getLogger("absl").warning("something else %s", "entirely")
    assert eps <= 4.0 + 1e-9
    texts = [r.getMessage() for r in caplog.records]
    assert not any("failed to converge" in t for t in texts), texts[:3]
    assert "something else entirely" in texts
