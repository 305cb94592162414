"""Statistics behind ``pytest-smolvm results`` against hand-computed values and simulated data."""

from __future__ import annotations

import random

import pytest

from pytest_smolvm.evals.results.stats import Interval, baseline_digests, bootstrap, compare, pass_at_k_curve


def test_pass_at_k_curve_matches_hand_computed_values() -> None:
    # One task, n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2;
    # pass@3 = 1 - C(3,3)/C(4,3) = 3/4; pass@4 = 1. A second task, n=4, c=0, halves each.
    curve = pass_at_k_curve([(4, 1), (4, 0)])
    assert [round(i.estimate, 6) for i in curve] == [0.125, 0.25, 0.375, 0.5]
    assert all(i.low <= i.estimate <= i.high for i in curve)


def test_pass_at_k_curve_all_passed_has_a_degenerate_band() -> None:
    assert pass_at_k_curve([(3, 3)]) == [Interval(1.0, 1.0, 1.0)] * 3


def test_bootstrap_is_deterministic_and_brackets_the_mean() -> None:
    values = [0.0, 0.5, 1.0, 1.0, 0.25]
    first, second = bootstrap(values), bootstrap(values)
    assert first == second
    assert first is not None and first.estimate == pytest.approx(0.55)
    assert first.low <= first.estimate <= first.high
    assert bootstrap([]) is None


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time() -> None:
    rng = random.Random(1234)
    trials, covered = 200, 0
    for t in range(trials):
        sample = [rng.gauss(0.3, 1.0) for _ in range(40)]
        interval = bootstrap(sample, resamples=400, seed=t)
        assert interval is not None
        covered += interval.low <= 0.3 <= interval.high
    # Percentile bootstrap under-covers slightly at n=40; 0.88-0.99 holds for this fixed seed.
    assert 0.88 <= covered / trials <= 0.99


def _line(case: str, seed: int, reward: float, digest: str = "sha256:a") -> dict[str, object]:
    return {"function": "test_agent", "case": case, "seed": seed, "episode": seed, "reward": reward,
            "outcome": "passed" if reward > 0.5 else "failed", "baseline_digest": digest}


def test_compare_pairs_by_task_and_seed_and_flags_intervals_that_exclude_zero() -> None:
    base = [_line("sort", s, 0.2) for s in range(10)] + [_line("grep", s, 0.5 + 0.1 * (s % 2)) for s in range(10)]
    other = [_line("sort", s, 0.9) for s in range(10)]
    other += [_line("grep", s, 0.5 + 0.1 * ((s + 1) % 2)) for s in range(10)]
    other.append(_line("sort", 99, 0.0))  # no partner in base: not paired
    diffs = {d.task: d for d in compare(base, other)}
    assert diffs["test_agent[sort]"].pairs == 10 and diffs["test_agent[sort]"].flagged
    assert diffs["test_agent[sort]"].difference is not None
    assert diffs["test_agent[sort]"].difference.estimate == pytest.approx(0.7)
    assert diffs["test_agent[grep]"].pairs == 10 and not diffs["test_agent[grep]"].flagged


def test_baseline_digests_tell_runs_on_different_baselines_apart() -> None:
    assert baseline_digests([_line("a", 0, 1.0, "sha256:a")]) != baseline_digests([_line("a", 0, 1.0, "sha256:b")])


def test_bootstrap_and_pass_at_k_bands_do_not_depend_on_the_order_values_came_in() -> None:
    values = [0.0, 0.1, 0.9, 1.0, 0.25, 0.5, 0.75, 0.3]
    counts = [(8, 1), (8, 7), (8, 4), (8, 0)]
    rng = random.Random(44)
    for _ in range(5):
        rng.shuffle(values)
        rng.shuffle(counts)
        assert bootstrap(values) == bootstrap(sorted(values))
        assert pass_at_k_curve(counts) == pass_at_k_curve(sorted(counts))
