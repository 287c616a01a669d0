"""benchmarks/infill.py's cases and bookkeeping: a case removes one whole statement of a function body (never a
docstring or a compound statement's header) of the size asked for, keeping the lines around it; the ratios are each
complete repeat's sum of tokens over sum of seconds against plain's, medians and ranges over the repeats."""
import pytest

from benchmark_scripts import load_script

infill = load_script("infill")

SOURCE = '''"""A module."""


def f(x):
    """A docstring line that must never be the gap."""
    y = x + 1
    if y > 2:
        z = (y *
             2)
        return z
    total = sum([y,
                 x,
                 3])
    return y
'''


def test_a_case_is_one_whole_statement_of_the_size_asked_for(tmp_path):
    # the simple statements of function bodies: not the docstring (line 5), not the `if` header (line 7)
    assert infill._statements(SOURCE) == [(6, 6), (8, 9), (10, 10), (11, 13), (14, 14)]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(SOURCE)
    for gap, middle in ((1, None), (2, "        z = (y *\n             2)\n"),
                        (3, "    total = sum([y,\n                 x,\n                 3])\n")):
        (case,) = infill.cut_cases(tmp_path / "pkg", 1, gaps=(gap,), before=3, after=2)
        lines = case.middle.splitlines()
        assert len(lines) == gap and '"""' not in case.middle and not case.middle.strip().startswith("if ")
        if middle is not None:
            assert case.middle == middle
        assert (case.before + case.middle + case.after) in SOURCE and len(case.before.splitlines()) <= 3
        assert len(case.after.splitlines()) <= 2 and case.source == "pkg/a.py"
    with pytest.raises(ValueError, match="no Python files"):
        infill.cut_cases(tmp_path / "pkg" / "nothing", 1)


def _row(rep, case, method, tokens, seconds, ids=(1, 2)):
    return {"repeat": rep, "case": case, "method": method, "tokens": tokens, "seconds": seconds,
            "token_ids": list(ids)}


def test_ratios_are_sums_over_cases_against_plain_per_complete_repeat():
    rows = []
    for rep, (fast_a, fast_b) in enumerate([(2.0, 4.0), (1.0, 1.0), (3.0, 3.0)]):  # seconds of "metasd default"
        for case, fast in ((0, fast_a), (1, fast_b)):
            rows += [_row(rep, case, "plain", 10, 6.0), _row(rep, case, "prompt lookup", 10, 6.0),
                     _row(rep, case, "metasd suffix", 10, 6.0),
                     _row(rep, case, "metasd default", 10, fast, ids=(1, 3) if rep == 1 and case == 1 else (1, 2))]
    rows += [_row(3, 0, "plain", 10, 1.0)]  # a repeat still running: left out
    out = infill.summarize(rows)
    default = out["metasd default"]
    assert default["per_repeat"] == pytest.approx([12.0 / 6.0, 12.0 / 2.0, 12.0 / 6.0])
    assert default["vs plain"]["median"] == pytest.approx(2.0) and default["vs plain"]["range"] == pytest.approx(
        [2.0, 6.0])
    assert default["identical to plain"] == "5/6" and out["prompt lookup"]["identical to plain"] == "6/6"
    assert out["plain"]["vs plain"]["median"] == 1.0
