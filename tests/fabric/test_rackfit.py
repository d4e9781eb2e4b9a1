"""Fitting the model to a rack: known parameters recovered from the model's own times plus noise, and the
refusal of measurements that cannot constrain a parameter."""

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.fabric.rackfit import (
    RACK_PARAMETERS,
    balanced_phase,
    fit_rack,
    pair_phase,
    predict_racks,
    predicted_times,
)

TRUE = np.array([40.0, 12.0, 25.0, 2.0, 6.0])  # GB/s, GB/s, us, us, us


def _phases(world=8, per_domain=4, pairs=True, sizes=(4096, 65536, 1 << 20, 1 << 24)):
    phases = [balanced_phase(f"balanced {s}", world, per_domain, s, 1.0) for s in sizes]
    if pairs:
        for size in (8, 1 << 20):
            phases.append(pair_phase(f"pair nvlink {size}", world, 0, 1, False, size, 1.0))
            phases.append(pair_phase(f"pair scaleout {size}", world, 0, per_domain, True, size, 1.0))
    return phases


def _measured(phases, noise, seed=0, per_domain=4, per_host=4, true=TRUE):
    rng = np.random.default_rng(seed)
    times = predicted_times(phases, true, per_domain, per_host)
    for phase, t in zip(phases, times, strict=True):
        phase.time_s = float(t * np.exp(rng.normal(0.0, noise)))
    return phases


def test_recovers_known_parameters_from_noisy_model_times():
    fit = fit_rack(_measured(_phases(), noise=0.03), 4, 4)
    for name, value, sigma, true in zip(RACK_PARAMETERS, fit.values, fit.relative_sigma, TRUE, strict=True):
        assert abs(np.log(value / true)) < max(4 * sigma, 0.02), (name, value, true, sigma)
        assert sigma < 0.15, name
    assert np.all(np.abs(fit.residual_pct) < 15)


def test_exact_times_give_the_parameters_back():
    fit = fit_rack(_measured(_phases(), noise=0.0), 4, 4)
    assert fit.values == pytest.approx(TRUE, rel=1e-3)


def test_no_scaleout_bytes_is_refused_naming_the_parameter():
    phases = _measured(_phases(world=4, per_domain=4, pairs=False), 0.0, per_domain=4)
    with pytest.raises(UsageError, match="cannot constrain scaleout_GBps") as info:
        fit_rack(phases, 4, 4)
    assert "\n" not in str(info.value)


def test_pairs_alone_cannot_constrain_the_phase_latency():
    pairs = [p for p in _phases() if not p.collective]
    with pytest.raises(UsageError, match="cannot constrain phase_latency_us: .*a collective phase"):
        fit_rack(_measured(pairs, 0.0), 4, 4)


def test_prediction_error_bars_bracket_the_fit():
    fit = fit_rack(_measured(_phases(), noise=0.05, seed=3), 4, 4)
    rows = predict_racks(fit, "qwen3-30b-a3b", [4, 8], tokens_per_rank=64, draws=8)
    assert [(r["ranks"], r["phase"]) for r in rows] == [
        (4, "dispatch"), (4, "combine"), (8, "dispatch"), (8, "combine")
    ]  # fmt: skip
    assert all(r["low_us"] <= r["time_us"] * 1.05 and r["time_us"] <= r["high_us"] * 1.05 for r in rows)
    assert rows[2]["racks"] == 2 and rows[2]["time_us"] > rows[0]["time_us"]  # 2 racks: bytes cross NICs
