"""metasd.bench.stats on synthetic numbers: rotation, per-repeat ratios, median/range, verdicts, outliers."""
import pytest

from metasd.bench import stats


def _row(qid, group, repeat, **methods):
    return {"question_id": qid, "category": group.lower(), "group": group, "repeat": repeat,
            "methods": {m: {"tokens": t, "seconds": s} for m, (t, s) in methods.items()}}


def test_rotation_puts_every_method_in_every_position():
    names = ["plain", "assisted", "lookup", "pool"]
    # one repeat: over len(names) consecutive prompts every method takes every position once
    for rep in range(3):
        orders = [stats.rotation(names, qi + rep) for qi in range(len(names))]
        for name in names:
            assert sorted(o.index(name) for o in orders) == list(range(len(names)))
        assert all(sorted(o) == sorted(names) for o in orders)
    # the same prompt in consecutive repeats is timed in a different order
    assert stats.rotation(names, 0 + 0) != stats.rotation(names, 0 + 1)
    assert stats.rotation(names, 0)[0] == "plain" and stats.rotation(names, 1)[0] == "assisted"
    assert stats.rotation(names, 5) == stats.rotation(names, 1) and stats.rotation([], 3) == []


def test_ratios_are_per_repeat_sums_over_prompts():
    rows = [_row("a", "MT", 0, plain=(10, 2.0), m=(10, 1.0)), _row("b", "QA", 0, plain=(30, 3.0), m=(20, 1.0)),
            _row("a", "MT", 1, plain=(10, 1.0), m=(10, 1.0)), _row("b", "QA", 1, plain=(30, 3.0), m=(20, 4.0))]
    # repeat 0: m 30 tok / 2 s = 15, plain 40 / 5 = 8; repeat 1: m 30 / 5 = 6, plain 40 / 4 = 10
    assert stats.ratios(rows, "m", "plain") == pytest.approx([15 / 8, 6 / 10])
    assert stats.ratios(rows, "m", "plain", group="MT") == pytest.approx([2.0, 1.0])
    assert stats.rates(rows, "plain") == pytest.approx({0: 8.0, 1: 10.0})
    # a failed run is left out of both sides in its repeat
    rows[1]["methods"]["m"] = {"error": "RuntimeError: x"}
    assert stats.ratios(rows, "m", "plain")[0] == pytest.approx((10 / 1.0) / (10 / 2.0))


def test_median_and_range():
    assert stats.median_range([1.2, 0.9, 1.5]) == (1.2, 0.9, 1.5)
    assert stats.median_range([1.0, 2.0]) == (1.5, 1.0, 2.0)
    assert stats.fmt_median_range([1.2, 0.9, 1.5]) == "1.20x [0.90, 1.50]"
    assert stats.fmt_median_range([1.234]) == "1.23x" and stats.fmt_median_range([]) == "-"
    with pytest.raises(ValueError):
        stats.median_range([])


def test_verdict_only_where_ranges_do_not_overlap():
    assert stats.verdict([1.3, 1.4, 1.5], [1.0, 1.0, 1.0]) == stats.FASTER
    assert stats.verdict([0.7, 0.8, 0.9], [1.0, 1.0, 1.0]) == stats.SLOWER
    assert stats.verdict([0.95, 1.2, 1.4], [1.0, 1.0, 1.0]) == stats.NOISE  # one repeat below plain: noise
    assert stats.verdict([1.1, 1.3], [1.0, 1.1]) == stats.NOISE  # touching ranges overlap
    assert stats.verdict([1.2, 1.3], [1.25, 1.5]) == stats.NOISE
    assert stats.verdict([2.0], [1.0]) == stats.verdict([1.5, 1.6], [1.0]) == stats.ONE_REPEAT  # one run: no range
    with pytest.raises(ValueError):
        stats.verdict([], [1.0])


def test_outliers_flag_slow_runs_against_same_token_median():
    rows = [_row("a", "MT", r, plain=(10, s)) for r, s in enumerate([1.0, 1.1, 2.0])]
    flagged = stats.outliers(rows)
    # median 1.1: 2.0 > 1.65 is flagged, 1.1 and 1.0 are not
    assert [(o["method"], o["question_id"], o["repeat"], o["group"]) for o in flagged] == [("plain", "a", 2, "MT")]
    assert flagged[0]["median_s"] == pytest.approx(1.1)
    assert stats.outliers(rows, factor=2.0) == []
    # a different token count is its own population: a longer run is not an outlier of the shorter ones
    rows = [_row("a", "MT", 0, m=(10, 1.0)), _row("a", "MT", 1, m=(10, 1.0)), _row("a", "MT", 2, m=(40, 4.0))]
    assert stats.outliers(rows) == []
    # one repeat only: never flagged; other prompts are separate populations
    rows = [_row("a", "MT", 0, m=(10, 1.0)), _row("b", "MT", 0, m=(10, 9.0))]
    assert stats.outliers(rows) == []
