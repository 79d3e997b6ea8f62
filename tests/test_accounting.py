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
        want = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02,
                                    steps=500, accountant="rdp", epsilon_tolerance=0.001)
        assert sigma == pytest.approx(want, rel=5e-3)


def test_budget_too_small_and_bad_arguments():
    with pytest.raises(ValueError, match="no noise_multiplier"):
        A.get_noise_multiplier(1e-9, 1e-12, 1.0, 10**6)
    for kwargs in [dict(target_epsilon=0), dict(target_delta=1.0), dict(sample_rate=1.5),
                   dict(steps=-1), dict(accountant="gdp")]:
        args = {**dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=10,
                       accountant="rdp"), **kwargs}
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
