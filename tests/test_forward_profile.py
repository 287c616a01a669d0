"""The profiled cost of a forward (metasd/core/pricing/forward_profile.py): the monotone fit and its units, the
validation of a profile (every nonsense field named), its JSON round trip, and ``profile_forward`` on tiny random models
(the shapes it runs, the cache it crops, the model and random state it leaves as it found them)."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from metasd.core.pricing import forward_profile
from metasd.core.pricing.forward_profile import FALL_TOLERANCE, ForwardProfile, ProfileError, profile_forward
from tiny import plain_greedy, tiny_llama, tiny_qwen


# ---------------------------------------------------------------------------------------------------- the fit


def _noisy_profiles(count: int = 200, seed: int = 0) -> list[ForwardProfile]:
    """Seeded random profiles shaped like measurements: a flat memory-bound start, then a linear compute-bound rise,
    each point times noise in [0.8, 1.2] (so neighbouring points dip often, never by half)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        k = rng.randint(2, 8)
        tokens = sorted(rng.sample(range(1, 600), k))
        base, knee, slope = rng.uniform(1e-3, 1.0), rng.uniform(1, 128), rng.uniform(0, 0.05)
        seconds = [base * (1 + slope * max(0.0, t - knee)) * rng.uniform(0.8, 1.2) for t in tokens]
        out.append(ForwardProfile(tuple(tokens), tuple(seconds), name="noisy"))
    return out


def test_fitted_cost_is_monotone_and_one_at_one_token():
    profiles = _noisy_profiles()
    dips = sum(any(b < a for a, b in zip(p.seconds, p.seconds[1:])) for p in profiles)
    assert dips > 50, "the generator must produce profiles with dips, or the running maximum goes untested"
    ns = list(range(0, 1001)) + [0.5, 1.5, 7.25, 999.9]
    for p in profiles:
        assert p.cost(1) == 1.0
        fitted = [p.seconds_for(n) for n in sorted(ns)]
        assert all(b >= a for a, b in zip(fitted, fitted[1:])), p
        costs = [p.cost(n) for n in range(1, 1001)]
        assert all(b >= a for a, b in zip(costs, costs[1:])), p
        assert all(c >= 1.0 for c in costs)


def test_interpolation_exact_at_measured_points_and_running_max_at_dips():
    rising = ForwardProfile((1, 4, 16, 64), (0.10, 0.11, 0.15, 0.40))
    assert [rising.seconds_for(t) for t in rising.tokens] == list(rising.seconds)
    assert rising.fitted_seconds == rising.seconds
    assert rising.cost(64) == pytest.approx(4.0)
    assert rising.seconds_for(10) == pytest.approx(0.11 + (0.15 - 0.11) * 6 / 12)  # between 4 and 16
    dipping = ForwardProfile((1, 4, 16, 64), (0.10, 0.12, 0.11, 0.40))  # 16 measured below 4: noise
    assert dipping.fitted_seconds == (0.10, 0.12, 0.12, 0.40)
    assert dipping.seconds_for(16) == 0.12 and dipping.seconds_for(10) == 0.12


def test_below_the_first_point_and_beyond_the_last():
    p = ForwardProfile((4, 16, 64), (0.2, 0.3, 0.6))
    assert p.seconds_for(1) == p.seconds_for(0) == p.seconds_for(4) == 0.2
    assert p.cost(1) == 1.0 and p.cost(64) == pytest.approx(3.0)
    slope = (0.6 - 0.3) / 48  # the last segment's
    assert p.seconds_for(256) == pytest.approx(0.6 + slope * 192)
    flat_end = ForwardProfile((1, 8, 64), (0.1, 0.3, 0.25))  # last point dips: extrapolate flat, never down
    assert flat_end.seconds_for(64) == flat_end.seconds_for(1000) == 0.3
    for bad in (-1, math.nan, math.inf, "3", None):
        with pytest.raises(ValueError, match="^n:"):
            p.seconds_for(bad)


# ---------------------------------------------------------------------------------------------- validation


NONSENSE = [
    # (tokens, seconds, the message starts with)
    ((1,), (0.1,), "tokens: at least 2 points, got 1"),
    ((), (), "tokens: at least 2 points, got 0"),
    ((1, 8, 8), (0.1, 0.2, 0.3), "tokens: must be strictly increasing, got [1, 8, 8]"),
    ((8, 4), (0.1, 0.2), "tokens: must be strictly increasing"),
    ((0, 4), (0.1, 0.2), "tokens[0]: must be an integer >= 1"),
    ((1, -4), (0.1, 0.2), "tokens[1]: must be an integer >= 1"),
    ((1, 2.5), (0.1, 0.2), "tokens[1]: must be an integer >= 1"),
    ((True, 4), (0.1, 0.2), "tokens[0]: must be an integer >= 1"),
    ("14", (0.1, 0.2), "tokens: must be a list"),
    (None, (0.1, 0.2), "tokens: must be a list"),
    ((1, 4, 16), (0.1, 0.2), "seconds: 2 values for 3 token counts"),
    ((1, 4), (0.1, 0.2, 0.3), "seconds: 3 values for 2 token counts"),
    ((1, 4, 16), (0.1, 0.2, math.nan), "seconds[2]: must be a finite number > 0, got nan"),
    ((1, 4), (math.inf, 0.2), "seconds[0]: must be a finite number > 0"),
    ((1, 4), (0.1, 0.0), "seconds[1]: must be a finite number > 0"),
    ((1, 4), (-0.1, 0.2), "seconds[0]: must be a finite number > 0"),
    ((1, 4), (0.1, "0.2"), "seconds[1]: must be a finite number > 0"),
    ((1, 4), (0.1, None), "seconds[1]: must be a finite number > 0"),
    ((1, 4), 0.1, "seconds: must be a list"),
    ((1, 8, 64), (0.1, 0.2, 0.09), "seconds[2]: "),  # 64 tokens at less than half of 8 tokens
    ((1, 8, 16, 64), (0.1, 0.2, 0.15, 0.09), "seconds[3]: "),  # half of the running max (8), not of the previous point
    ((1, 64), (1.0, 0.4), "seconds[1]: "),
]


@pytest.mark.parametrize("tokens, seconds, message", NONSENSE)
def test_nonsense_profile_names_the_field(tokens, seconds, message):
    with pytest.raises(ProfileError) as err:
        ForwardProfile(tokens, seconds)
    assert str(err.value).startswith(message), str(err.value)
    assert isinstance(err.value, ValueError)


def test_falling_times_say_which_points():
    with pytest.raises(ProfileError, match=r"^seconds\[2\]: .* at 64 tokens is less than 0.5 x .* at 8 tokens"):
        ForwardProfile((1, 8, 64), (0.1, 0.2, 0.09))


def test_noise_within_the_tolerance_is_accepted():
    p = ForwardProfile((1, 8, 64), (0.1, 0.2, 0.2 * FALL_TOLERANCE * 1.01))
    assert p.fitted_seconds[-1] == 0.2


@pytest.mark.parametrize("name, meta, field", [(3, {}, "name"), ("v", [], "meta"), ("v", {1: "cpu"}, "meta"),
                                               (None, {}, "name")])
def test_name_and_meta_are_checked(name, meta, field):
    with pytest.raises(ProfileError, match=f"^{field}: "):
        ForwardProfile((1, 4), (0.1, 0.2), name=name, meta=meta)


def test_lists_become_tuples_and_meta_is_copied():
    meta = {"device": "cpu"}
    p = ForwardProfile([1, 4], [1, 2], name="v", meta=meta)
    meta["device"] = "cuda"
    assert p.tokens == (1, 4) and p.seconds == (1.0, 2.0) and isinstance(p.seconds[0], float)
    assert p.meta == {"device": "cpu"}


def test_json_round_trip():
    p = ForwardProfile((1, 4, 16), (0.1, 0.12, 0.3), name="qwen", meta={"device": "cpu", "context": 256})
    back = ForwardProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.meta == p.meta


@pytest.mark.parametrize("d, field", [
    ([1, 2], "profile"),
    ({"seconds": [0.1, 0.2]}, "tokens"),
    ({"tokens": [1, 4]}, "seconds"),
    ({"tokens": [1, 4], "seconds": [0.1, 0.2], "secs": [1]}, "secs"),
    ({"tokens": [1, 4], "seconds": [0.1, -0.2]}, r"seconds\[1\]"),
    ({"tokens": [1, 1], "seconds": [0.1, 0.2]}, "tokens"),
    ({"tokens": [1, 4], "seconds": [0.1, 0.2], "meta": "cpu"}, "meta"),
])
def test_from_dict_names_the_bad_key(d, field):
    with pytest.raises(ProfileError, match=f"^{field}: "):
        ForwardProfile.from_dict(d)


def test_describe_is_one_line_with_every_point():
    p = ForwardProfile((1, 4, 16), (0.1, 0.12, 0.3), name="qwen", meta={"device": "cpu", "context": 256})
    line = p.describe()
    assert "\n" not in line and "qwen" in line and "context 256" in line
    assert "1 tok 100 ms (1.00x)" in line and "16 tok 300 ms (3.00x)" in line


# ------------------------------------------------------------------------------------------ profile_forward


class _Recorder:
    """A forward pre-hook on a model that records each forward's input ids shape, mask shape and cache length, and a
    fake clock (``now``) that each forward advances by a made-up duration: 1 ms per 100 tokens plus 10 ms, times a
    cycling jitter, so the profile's seconds are known exactly whatever the machine's load."""

    JITTER = (1.0, 1.3, 0.8, 1.1, 0.9)

    def __init__(self, model, monkeypatch):
        self.calls: list[tuple] = []
        self.durations: list[float] = []
        self.clock = 0.0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)
        monkeypatch.setattr(forward_profile, "now", lambda device=None: self.clock)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        mask = kwargs.get("attention_mask")
        ids = kwargs["input_ids"]
        self.calls.append((tuple(ids.shape), None if mask is None else tuple(mask.shape), int(cache.get_seq_length())))
        self.durations.append(1e-3 * (10 + ids.numel() / 100) * self.JITTER[len(self.calls) % len(self.JITTER)])
        self.clock += self.durations[-1]


def test_profile_forward_runs_the_requested_shapes_and_leaves_the_model_as_it_was(monkeypatch):
    model = tiny_qwen(seed=3)
    prompt = [0, 7, 9, 12, 30]
    before = plain_greedy(model, prompt, 8)
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, use_cache=True)
    rng = torch.random.get_rng_state()
    rec = _Recorder(model, monkeypatch)
    try:
        p = profile_forward(model, (1, 4, 16, 64), context=32, repeats=3, warmup=1, max_seconds=None)
    finally:
        rec.handle.remove()
    assert p.tokens == (1, 4, 16, 64) and len(p.seconds) == 4
    assert ForwardProfile.from_dict(p.to_dict()) == p
    assert p.meta["context"] == 32 and p.meta["rows"] == 1 and p.meta["repeats"] == 3 and p.meta["device"] == "cpu"
    assert p.meta["dtype"] == "float32" and "skipped" not in p.meta
    # 1 warm-up + 3 timed forwards per count, each over [1, n] after exactly the context (the cache cropped back)
    assert [c[0] for c in rec.calls] == [(1, n) for n in (1, 4, 16, 64) for _ in range(4)]
    assert [c[1] for c in rec.calls] == [(1, 1, n, 32 + n) for n in (1, 4, 16, 64) for _ in range(4)]
    assert {c[2] for c in rec.calls} == {32}
    # each point: the median of its timed forwards, the warm-up left out
    assert p.seconds == pytest.approx([statistics.median(rec.durations[4 * k + 1: 4 * k + 4]) for k in range(4)])
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert not model.training
    assert plain_greedy(model, prompt, 8) == before
    assert torch.equal(model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, use_cache=True),
                       generated)


def test_rows_split_the_tokens(monkeypatch):
    model = tiny_llama(seed=1)
    rec = _Recorder(model, monkeypatch)
    try:
        p = profile_forward(model, (4, 8, 32), rows=4, context=16, repeats=1, warmup=0, max_seconds=None)
    finally:
        rec.handle.remove()
    assert p.tokens == (4, 8, 32) and p.meta["rows"] == 4 and p.cost(1) == 1.0
    assert [c[0] for c in rec.calls] == [(4, 1), (4, 2), (4, 8)]  # [rows, n // rows]
    assert [c[1] for c in rec.calls] == [(4, 1, 1, 17), (4, 1, 2, 18), (4, 1, 8, 24)]
    assert {c[2] for c in rec.calls} == {16}


def test_prefilled_context_and_no_mask(monkeypatch):
    model = tiny_qwen(seed=2)
    rec = _Recorder(model, monkeypatch)
    try:
        p = profile_forward(model, (2, 6), rows=2, context=8, repeats=1, warmup=0, mask=False, prefill=True)
    finally:
        rec.handle.remove()
    assert p.tokens == (2, 6) and p.meta["prefill"] is True and p.meta["mask"] is False
    # the prefill of one row of context, then [rows, n // rows] with no mask over the cache repeated to 2 rows
    assert rec.calls == [((1, 8), None, 0), ((2, 1), None, 8), ((2, 3), None, 8)]


def _budgeted_profile(monkeypatch, budget, repeats, warmup):
    """A profile of counts 100-800 tokens ([100, 1-8]) under ``budget`` on the fake clock without jitter: forwards
    of 10 ms + 1 ms per 100 tokens. (profile, recorder)."""
    model = tiny_qwen(seed=5)
    rec = _Recorder(model, monkeypatch)
    rec.JITTER = (1.0,)
    try:
        p = profile_forward(model, (100, 200, 400, 800), rows=100, context=2, repeats=repeats, warmup=warmup,
                            max_seconds=budget)
    finally:
        rec.handle.remove()
    return p, rec


@pytest.mark.parametrize("budget, tokens, skipped", [(0.03, (1, 2), [4, 8]), (0.036, (1, 2), [4, 8]),
                                                     (0.04, (1, 2, 4), [8]), (0.053, (1, 2, 4), [8]),
                                                     (0.06, (1, 2, 4, 8), None), (1e-9, (1, 2), [4, 8]),
                                                     (None, (1, 2, 4, 8), None)])
def test_the_budget_skips_the_counts_predicted_past_it(monkeypatch, budget, tokens, skipped):
    """Forwards of 10 ms + 1 ms per 100 tokens, one timed forward per count (counts of 100-800 tokens as [100, 1-8]):
    100 and 200 tokens take 11 + 12 = 23 ms; 400 is predicted on the line through them at 14 ms (37 ms in all), and
    after it 800 at 18 ms (55 ms in all). A budget of 36 or 53 ms tells the line from the last point's time alone."""
    p, _ = _budgeted_profile(monkeypatch, budget, repeats=1, warmup=0)
    assert tuple(n // 100 for n in p.tokens) == tokens  # the first two counts always run
    assert [n // 100 for n in p.meta["skipped"]] == skipped if skipped else "skipped" not in p.meta


@pytest.mark.parametrize("budget, reduced, skipped", [(0.1, None, [4, 8]), (0.12, [4], [8]), (0.15, None, [8]),
                                                      (0.18, [8], None), (0.3, None, None)])
def test_a_count_the_budget_cannot_time_in_full_is_timed_once(monkeypatch, budget, reduced, skipped):
    """Forwards of 10 ms + 1 ms per 100 tokens, 1 warm-up + 3 timed forwards a count: 100 and 200 tokens take 3 x 11
    + 4 x 12 = 81 ms charged (the first warm-up is not). 400 is predicted at 14 ms: 56 ms in full (137 in all), 28
    once after one warm-up (109); then 800 at 18 ms: 72 in full, 36 once. A count the budget cannot time in full is
    timed once where that fits, and only skipped where not even that does."""
    p, rec = _budgeted_profile(monkeypatch, budget, repeats=3, warmup=1)
    measured = tuple(n for n in (1, 2, 4, 8) if n not in (skipped or []))
    assert tuple(n // 100 for n in p.tokens) == measured
    assert [n // 100 for n in p.meta.get("reduced", [])] == (reduced or [])
    assert [n // 100 for n in p.meta.get("skipped", [])] == (skipped or [])
    forwards = {n: sum(c[0] == (100, n) for c in rec.calls) for n in (1, 2, 4, 8)}
    assert forwards == {n: 2 if n in (reduced or []) else 4 if n in measured else 0 for n in (1, 2, 4, 8)}
    assert p.seconds[:len(measured)] == pytest.approx([1e-3 * (10 + n) for n in measured])
    assert "reduced" in p.describe() if reduced else "reduced" not in p.describe()


def test_profile_forward_on_the_real_clock():
    """No fake clock: a tiny model whose 128-token forward is clearly dearer than its 1-token one gives a valid
    profile, and a model in training mode is put back in it."""
    model = tiny_qwen(seed=4, hidden=256).train()
    p = profile_forward(model, (1, 128), context=8, repeats=3, warmup=1, max_seconds=None)
    assert p.tokens == (1, 128) and all(s > 0 for s in p.seconds) and p.meta["threads"] == torch.get_num_threads()
    assert model.training


@pytest.mark.parametrize("kwargs, field", [
    ({"token_counts": (1, 4), "rows": 0}, "rows"),
    ({"token_counts": (1, 4), "rows": -2}, "rows"),
    ({"token_counts": (2, 5), "rows": 2}, r"token_counts\[1\]"),
    ({"token_counts": (3, 4, 6), "rows": 3}, r"token_counts\[1\]"),
    ({"token_counts": (4,)}, "token_counts"),
    ({"token_counts": (4, 2)}, "token_counts"),
    ({"token_counts": (0, 2)}, r"token_counts\[0\]"),
    ({"token_counts": (1, 4), "context": 0}, "context"),
    ({"token_counts": (1, 4), "context": 254}, "context"),  # 254 + 4 > the tiny model's 256 positions
    ({"token_counts": (1, 4), "repeats": 0}, "repeats"),
    ({"token_counts": (1, 4), "warmup": -1}, "warmup"),
    ({"token_counts": (1, 4), "max_seconds": 0}, "max_seconds"),
])
def test_bad_arguments_are_named(kwargs, field):
    model = tiny_qwen(seed=0)
    with pytest.raises(ValueError, match=f"^{field}: "):
        profile_forward(model, **kwargs)


@pytest.mark.parametrize("stalled", [16, 64, 1])
def test_a_count_timed_through_a_stall_is_timed_again(monkeypatch, stalled):
    """Forwards of 10 ms + 1 ms per 100 tokens, except the first time a count is timed (warm-up and timed forwards),
    at 6x: a stall of the machine. 64 tokens at 6x are dearer per token than 16: timed again; one token at 6x makes 4
    tokens under half its seconds: one token timed again (16 at 6x breaks both rules). The lower median stays, and a
    count in shape is timed once."""
    model = tiny_qwen(seed=5)
    rec = _Recorder(model, monkeypatch)
    rec.JITTER = (1.0,)
    seen: list[int] = []

    def hook(module, args, kwargs):
        n = kwargs["input_ids"].shape[1]
        first_round = seen.count(n) < 2  # warm-up + one timed forward per round
        seen.append(n)
        rec.durations.append(1e-3 * (10 + n / 100) * (6.0 if n == stalled and first_round else 1.0))
        rec.clock += rec.durations[-1]

    rec.handle.remove()
    rec.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        p = profile_forward(model, (1, 4, 16, 64), context=2, repeats=1, warmup=1, max_seconds=None)
    finally:
        rec.handle.remove()
    assert p.meta["retimed"] == [stalled] and p.describe().endswith(f"; retimed {stalled} tok")  # the server logs it
    assert p.seconds == pytest.approx([1e-3 * (10 + n / 100) for n in (1, 4, 16, 64)])
    # a count timed again gets its warm-up again, but the first count's warm-up is the profile's uncharged first forward
    again = {1: 1}.get(stalled, 2)
    assert {n: seen.count(n) for n in (1, 4, 16, 64)} == {n: 2 + again if n == stalled else 2 for n in (1, 4, 16, 64)}
    clean = _Recorder(model, monkeypatch)
    try:
        assert "retimed" not in profile_forward(model, (1, 4, 16, 64), context=2, max_seconds=None).meta
    finally:
        clean.handle.remove()


def test_the_profile_budget_benchmark_reports_what_each_fresh_process_timed(tmp_path, capsys):
    """``benchmarks/profile_budget.py`` on a tiny saved model: one fresh process per run, each run's profile (the
    counts it timed, its meta with the uncharged first forward) written out."""
    from benchmark_scripts import load_script
    from tiny import tiny_tokenizer

    tiny_qwen(seed=0).save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    out = tmp_path / "runs.json"
    assert load_script("profile_budget").main(["--model", str(tmp_path / "model"), "--dtype", "fp32", "--runs", "2",
                                               "--budget", "30", "--counts", "1", "4", "16", "--context", "8",
                                               "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and len(capsys.readouterr().out.splitlines()) == 2
    for run in runs:
        profile = ForwardProfile.from_dict(run["profile"])
        assert profile.tokens == (1, 4, 16) and "skipped" not in profile.meta
        assert profile.meta["first_forward_s"] > 0 and run["wall_s"] > 0


def test_a_stall_that_outlasts_one_retime_is_timed_again_until_it_ends(monkeypatch):
    """One token at 6x for its warm-up and first ``RETIMES`` timings (a stall of the machine, as another process
    running beside a starting server caused): 4 tokens under half its seconds - one token timed again until the stall
    ends, the profile accepted (before: one retime, then ``ProfileError``, and the server did not start). A stall
    that outlasts every retime still fails, naming the point."""
    from metasd.core.pricing.forward_profile import RETIMES

    model = tiny_qwen(seed=5)

    def profiled(rounds):
        rec = _Recorder(model, monkeypatch)
        rec.JITTER = (1.0,)
        seen: list[int] = []

        def hook(module, args, kwargs):
            n = kwargs["input_ids"].shape[1]
            stalled = n == 1 and seen.count(1) < 1 + rounds  # the uncharged warm-up, then ``rounds`` timings
            seen.append(n)
            rec.durations.append(1e-3 * (10 + n / 100) * (6.0 if stalled else 1.0))
            rec.clock += rec.durations[-1]

        rec.handle.remove()
        rec.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return profile_forward(model, (1, 4, 16), context=2, repeats=1, warmup=1, max_seconds=None), seen
        finally:
            rec.handle.remove()

    p, seen = profiled(RETIMES)
    assert RETIMES == 3 and p.meta["retimed"] == [1] and seen.count(1) == 2 + RETIMES  # the last one clean
    assert p.seconds == pytest.approx([1e-3 * (10 + n / 100) for n in (1, 4, 16)])
    with pytest.raises(ProfileError, match=r"^seconds\[1\]: "):
        profiled(RETIMES + 1)
