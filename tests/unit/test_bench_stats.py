"""The statistics of benchmarks/bench.py on known data."""

import sys

import pytest

from tests.server import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_stats import bootstrap_ratio, median_or_none, percentile, rotation, trial_order  # noqa: E402


def test_trials_alternate_which_server_goes_first():
    assert trial_order(3) == ["A", "B", "B", "A", "A", "B"]
    order = trial_order(5)
    assert order.count("A") == order.count("B") == 5


def test_rotation_runs_every_server_once_a_round_and_varies_who_goes_first():
    order = rotation(("s", "f", "a"), 4)
    assert order == ["s", "f", "a", "f", "s", "a", "a", "s", "f", "a", "f", "s"]
    rounds = [order[i:i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == ["a", "f", "s"] for r in rounds)
    assert {r[0] for r in rounds[:3]} == {"s", "f", "a"}


def test_percentile_interpolates_between_ranks():
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([5], 0.99) == 5
    assert percentile(list(range(101)), 0.99) == pytest.approx(99)


def test_median_skips_missing_values():
    assert median_or_none([None, 3, 1, None, 2]) == 2
    assert median_or_none([None]) is None


def test_identical_samples_give_ratio_one_with_no_spread():
    assert bootstrap_ratio([100.0] * 5, [100.0] * 5) == (1.0, 1.0, 1.0)


def test_a_clear_double_gives_an_interval_around_two():
    a = [200.0, 210.0, 190.0, 205.0, 195.0]
    b = [100.0, 105.0, 95.0, 102.0, 98.0]
    ratio, low, high = bootstrap_ratio(a, b)
    assert ratio == pytest.approx(2.0)
    assert 1.8 < low <= ratio <= high < 2.2


def test_interval_contains_the_estimate_and_widens_with_noise():
    steady = bootstrap_ratio([100.0, 101, 99, 100, 102], [100.0, 99, 101, 100, 98])
    noisy = bootstrap_ratio([50.0, 150, 80, 120, 100], [100.0, 60, 140, 90, 110])
    for ratio, low, high in (steady, noisy):
        assert low <= ratio <= high
    assert noisy[2] - noisy[1] > steady[2] - steady[1]


def test_bootstrap_is_seeded():
    a, b = [1.0, 3, 2, 5, 4], [2.0, 1, 4, 3, 2]
    assert bootstrap_ratio(a, b, seed=7) == bootstrap_ratio(a, b, seed=7)


def test_bootstrap_refuses_empty_or_non_positive_samples():
    with pytest.raises(ValueError):
        bootstrap_ratio([], [1.0])
    with pytest.raises(ValueError):
        bootstrap_ratio([1.0], [0.0])
