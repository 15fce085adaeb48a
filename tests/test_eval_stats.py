"""pass@k / pass^k estimators against brute force, and the summary with bootstrap intervals."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from openforgerl.eval_stats import by_tag, group_runs, paired_difference, pass_at_k, pass_hat_k, summarize


@st.composite
def counts(draw: st.DrawFn) -> tuple[int, int, int]:
    n = draw(st.integers(1, 9))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(counts())
def test_estimators_equal_brute_force_over_all_k_subsets(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    runs = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(runs, k))
    assert math.isclose(pass_at_k(n, c, k), sum(any(s) for s in subsets) / len(subsets), abs_tol=1e-12)
    assert math.isclose(pass_hat_k(n, c, k), sum(all(s) for s in subsets) / len(subsets), abs_tol=1e-12)


def test_edge_cases() -> None:
    assert (pass_at_k(5, 0, 3), pass_hat_k(5, 0, 3)) == (0.0, 0.0)
    assert (pass_at_k(5, 5, 3), pass_hat_k(5, 5, 3)) == (1.0, 1.0)
    assert pass_at_k(4, 1, 1) == pass_hat_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 2, 3) == 1.0  # any 3 of 4 runs include one of the 2 successes
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # exact integers: no overflow for large n
    with pytest.raises(ValueError, match="at least 3 runs"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="at least 3 runs"):
        pass_hat_k(2, 2, 3)
    with pytest.raises(ValueError, match="k must be at least 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="between 0 and n=3"):
        pass_hat_k(3, 4, 1)


RUNS = {
    "easy": [1.0, 1.0, 1.0, 1.0],
    "flaky": [1.0, 0.0, 1.0, 0.0],
    "hard": [0.0, 0.0, 0.0, 0.5],
}


def test_summary_per_task_and_overall() -> None:
    s = summarize(RUNS, ks=(3, 1), n_bootstrap=2000, seed=7)
    assert s.ks == (1, 3)
    flaky = next(t for t in s.tasks if t.task_id == "flaky")
    assert (flaky.runs, flaky.successes, flaky.mean_reward) == (4, 2, 0.5)
    assert flaky.pass_at == {1: 0.5, 3: 1.0} and flaky.pass_hat == {1: 0.5, 3: 0.0}
    assert s.mean_reward.estimate == pytest.approx((1.0 + 0.5 + 0.125) / 3)
    assert s.pass_at[3].estimate == pytest.approx(2 / 3)
    assert s.pass_hat[3].estimate == pytest.approx(1 / 3)
    for interval in (s.mean_reward, *s.pass_at.values(), *s.pass_hat.values()):
        eps = 1e-12  # the resampled means and the estimate are summed in different orders
        assert (
            0.0 <= interval.low <= interval.estimate + eps and interval.estimate - eps <= interval.high <= 1.0
        )
    # the threshold decides what a success is: partial rewards count when it is lowered
    assert summarize(RUNS, success_threshold=0.5, n_bootstrap=10).tasks[2].successes == 1


def test_figures_by_tag_average_their_tasks_and_leave_out_tags_every_task_has() -> None:
    s = summarize(RUNS, ks=(1, 2), n_bootstrap=10)
    tags = {"easy": ["suite", "add"], "flaky": ["suite", "add", "add"], "hard": ["suite", "copy"]}
    table = by_tag(s, tags)
    assert set(table) == {"add", "copy"}  # "suite" is on every task: the overall figures already
    assert table["add"]["tasks"] == 2 and table["add"]["runs"] == 4 + 4  # a repeated tag counts once
    assert table["add"]["pass@k"]["1"] == pytest.approx((1.0 + 0.5) / 2)
    assert table["add"]["pass@k"]["2"] == pytest.approx((1.0 + 5 / 6) / 2)
    assert table["copy"]["mean_reward"] == pytest.approx(0.125)
    assert by_tag(s, {}) == {}


def test_intervals_are_seeded_and_plausible() -> None:
    assert summarize(RUNS, seed=1, n_bootstrap=500) == summarize(RUNS, seed=1, n_bootstrap=500)
    assert summarize(RUNS, seed=1, n_bootstrap=500) != summarize(RUNS, seed=2, n_bootstrap=500)
    single = summarize({"only": [1.0, 0.0]}, n_bootstrap=100)
    assert single.mean_reward.low == single.mean_reward.high == 0.5  # one task: no task variance to see
    # 400 tasks, each solved or not: the interval is close to the normal one, 2 * 1.96 * sqrt(p(1-p)/400)
    rewards = np.random.default_rng(0).integers(0, 2, size=400).astype(float)
    wide = summarize({f"t{i}": [r] for i, r in enumerate(rewards)}, n_bootstrap=4000)
    p = wide.mean_reward.estimate
    assert wide.mean_reward.high - wide.mean_reward.low == pytest.approx(
        2 * 1.96 * math.sqrt(p * (1 - p) / 400), rel=0.1
    )


def test_paired_difference_is_the_mean_change_with_a_narrower_interval_than_two_separate_ones() -> None:
    before = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.25}
    after = {"d": 0.5, "c": 0.5, "b": 1.0, "a": 1.0}  # matched by task, not by order
    d = paired_difference(before, after, n_bootstrap=2000)
    assert d.estimate == pytest.approx((0 + 1 + 0 + 0.25) / 4)
    assert 0.0 <= d.low <= d.estimate <= d.high <= 1.0  # no task got worse: no resample is below 0
    same = paired_difference(before, before, n_bootstrap=200)
    assert same.estimate == same.low == same.high == 0.0
    # 200 tasks of very different difficulty, each a little better after: pairing sees the change
    # clearly where the two separate intervals overlap.
    rng = np.random.default_rng(0)
    base = {f"t{i}": float(x) for i, x in enumerate(rng.uniform(0.0, 0.9, size=200))}
    better = {t: v + 0.05 for t, v in base.items()}
    paired = paired_difference(base, better, n_bootstrap=2000)
    assert paired.estimate == pytest.approx(0.05) and paired.low > 0.0
    apart = [
        summarize({t: [v] for t, v in runs.items()}, n_bootstrap=2000).mean_reward for runs in (base, better)
    ]
    assert apart[0].high > apart[1].low  # separately, the two intervals overlap
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(before, {"a": 1.0})
    with pytest.raises(ValueError, match="no tasks"):
        paired_difference({}, {})


def test_errors() -> None:
    with pytest.raises(ValueError, match="task 'flaky': 4 runs, but k=5"):
        summarize({"easy": [1.0] * 5, "flaky": RUNS["flaky"]}, ks=(5,))
    with pytest.raises(ValueError, match="no tasks"):
        summarize({})
    with pytest.raises(ValueError, match="confidence"):
        summarize(RUNS, confidence=1.0)


def test_json_and_markdown_reports() -> None:
    s = summarize(group_runs([("a", 1.0), ("b", 0.0), ("a", 0.0), ("b", 0.0)]), ks=(1, 2), n_bootstrap=200)
    report = json.loads(json.dumps(s.to_dict()))
    assert report["tasks"] == 2 and report["runs"] == 4
    assert report["pass@k"]["2"]["estimate"] == pytest.approx(0.5)
    assert report["per_task"][0] == {
        "task_id": "a",
        "runs": 2,
        "successes": 1,
        "mean_reward": 0.5,
        "pass@k": {"1": 0.5, "2": 1.0},
        "pass^k": {"1": 0.5, "2": 0.0},
    }
    md = s.to_markdown()
    assert "| metric | estimate | 95% CI |" in md
    assert "| pass@2 | 0.500 | [" in md
    assert "| task | runs | successes | mean reward | pass@1 | pass@2 | pass^1 | pass^2 |" in md
    assert "| a | 2 | 1 | 0.500 | 0.500 | 1.000 | 0.500 | 0.000 |" in md
