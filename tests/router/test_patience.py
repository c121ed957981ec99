"""How long a turn waits for its lookup (router.patience). Pure, no I/O."""

from __future__ import annotations

import pytest

from router.patience import MIN_MEASURED_TOKENS, Patience, PrefillRates, lookup_wait_s

P = Patience(base_s=0.05, recompute_share=0.25, max_s=1.0)


def test_the_wait_grows_with_the_prompts_recompute_time_up_to_the_cap() -> None:
    assert lookup_wait_s(P, 0, 1e-4) == pytest.approx(0.05)
    assert lookup_wait_s(P, 100, 1e-4) == pytest.approx(0.05 + 0.25 * 0.01)  # 10 ms to recompute
    assert lookup_wait_s(P, 32_000, 1e-4) == pytest.approx(0.05 + 0.25 * 3.2)  # 3.2 s to recompute
    assert lookup_wait_s(P, 200_000, 1e-4) == 1.0


def test_share_zero_is_the_fixed_base_and_a_base_above_the_cap_stands() -> None:
    assert lookup_wait_s(Patience(0.05, 0.0, 1.0), 32_000, 1e-4) == 0.05
    assert lookup_wait_s(Patience(2.0, 0.25, 1.0), 32_000, 1e-4) == 2.0


def test_the_turn_waits_at_least_as_long_as_it_waits_for_something_else() -> None:
    assert lookup_wait_s(P, 100, 1e-4, busy_s=0.3) == 0.3
    assert lookup_wait_s(P, 32_000, 1e-4, busy_s=0.3) == pytest.approx(0.85)


def test_nonsense_inputs_wait_the_base() -> None:
    assert lookup_wait_s(P, -5, 1e-4) == 0.05
    assert lookup_wait_s(P, 1000, -1.0) == 0.05


def test_prefill_rates_are_measured_per_model_from_long_prefills() -> None:
    rates = PrefillRates(1e-4)
    assert rates.s_per_token("m") == 1e-4
    rates.observe("m", MIN_MEASURED_TOKENS - 1, 10.0)  # too few tokens to tell the rate
    rates.observe("m", 1000, 0.0)
    assert rates.s_per_token("m") == 1e-4
    rates.observe("m", 1000, 2.0)  # a CPU engine: 2 ms a token
    assert rates.s_per_token("m") == pytest.approx(2e-3)
    rates.observe("m", 1000, 1.0)
    assert 1e-3 < rates.s_per_token("m") < 2e-3  # (a running estimate)
    assert rates.s_per_token("other") == 1e-4


def test_the_loops_lag_is_waited_for_on_top_bounded_by_the_longest_wait() -> None:
    assert lookup_wait_s(P, 100, 1e-4, lag_s=0.2) == pytest.approx(0.05 + 0.25 * 0.01 + 0.2)
    assert lookup_wait_s(P, 100, 1e-4, busy_s=0.3, lag_s=0.2) == pytest.approx(0.5)
    assert lookup_wait_s(P, 100, 1e-4, lag_s=5.0) == pytest.approx(0.05 + 0.25 * 0.01 + 1.0)
    assert lookup_wait_s(P, 100, 1e-4, lag_s=-1.0) == lookup_wait_s(P, 100, 1e-4)
