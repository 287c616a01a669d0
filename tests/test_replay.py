"""The replay drafter: a draft whose acceptance is known in advance (accept + 1 tokens per greedy step)."""
import pytest

from metasd.core import Engine, Verifier
from metasd.drafters.replay import ReplayDrafter
from tiny import plain_greedy, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]


@pytest.mark.parametrize("accept", [0, 1, 3, 5])
def test_greedy_steps_commit_accept_plus_one_tokens_and_the_verifiers_output(accept):
    model = tiny_qwen(seed=0)
    engine = Engine(Verifier(model), ReplayDrafter(model, accept=accept, wrong=1))
    result = engine.generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == plain_greedy(model, PROMPT, 30)
    taus = result.stats.tokens_per_step
    assert set(taus[:-1]) == {accept + 1} and taus[-1] <= accept + 1  # the last step is cut by the budget
    # the first token comes with the prefill: the steps have 29 tokens left, a draft the tokens left less one
    assert result.stats.drafted == sum(min(accept + 1, 29 - sum(taus[:i]) - 1) for i in range(len(taus)))


def _counting_records(drafter: ReplayDrafter) -> list[int]:
    """The lengths of the recordings ``drafter`` makes (one entry per ``_record``)."""
    calls: list[int] = []
    record = drafter._record
    drafter._record = lambda tokens, n: calls.append(len(tokens)) or record(tokens, n)
    return calls


def test_a_recording_costs_nothing_in_the_steps_even_when_made_inside_one():
    """Recorded when the request begins, and again inside a step when the committed text leaves the recording: the
    cost model counts neither, so each step's modeled cost is the verifier's verify alone."""
    model = tiny_qwen(seed=0)
    truth = plain_greedy(model, PROMPT, 12)
    none = Engine(Verifier(model)).generate(PROMPT, max_new_tokens=12).stats
    assert none.modeled_cost == pytest.approx(11.0)  # plain decoding: one decode step per token after the first

    at_start = ReplayDrafter(model, accept=2, wrong=0)
    started = _counting_records(at_start)
    replay = Engine(Verifier(model), at_start).generate(PROMPT, max_new_tokens=12)
    assert started == [len(PROMPT)] and replay.token_ids == truth  # one recording, when the request began
    # a 3-row verify costs a little more than a 1-row one, and nothing else is counted
    assert 1.0 < replay.stats.modeled_cost / replay.stats.steps < 1.2

    # a recording the committed text leaves after 4 tokens (as a bf16 tie broken the other way would): the drafter
    # records again inside the step that finds it off, and that step still costs a verify alone
    leaving = ReplayDrafter(model, accept=2, wrong=0)
    leaving.record(PROMPT, truth[:4] + [(t + 1) % 64 for t in truth[4:]])
    again = _counting_records(leaving)
    result = Engine(Verifier(model), leaving).generate(PROMPT, max_new_tokens=12)
    assert result.token_ids == truth
    assert again == [len(PROMPT) + 5]  # re-recorded once, in a step, from the 5 tokens committed by then
    # after the prefill's token: the second step's draft left the text at its first token (the 5th), the third step
    # found the recording off and recorded again
    assert result.stats.tokens_per_step[:3] == [3, 1, 3]
    assert 1.0 < result.stats.modeled_cost / result.stats.steps < 1.2


def test_a_given_recording_is_replayed_and_a_wrong_one_is_recorded_again():
    model = tiny_qwen(seed=0)
    drafter = ReplayDrafter(None, accept=2)
    truth = plain_greedy(model, PROMPT, 16)
    drafter.record(PROMPT, truth)
    assert Engine(Verifier(model), drafter).generate(PROMPT, max_new_tokens=16).stats.tokens_per_step[:3] == [3, 3, 3]
    with pytest.raises(ValueError, match="no verifier model to record"):
        drafter.record(PROMPT, [(t + 1) % 64 for t in truth])  # wrong: the drafter would record again, but has no model
        Engine(Verifier(model), drafter).generate(PROMPT, max_new_tokens=16)
    fixed = ReplayDrafter(model, accept=2)
    fixed.record(PROMPT, [(t + 1) % 64 for t in truth])
    result = Engine(Verifier(model), fixed).generate(PROMPT, max_new_tokens=16)
    assert result.token_ids == truth and result.stats.tokens_per_step[1] == 3  # re-recorded after the first step


def test_without_rerecord_leaving_the_recording_raises_instead_of_recording_in_the_step():
    """Benchmarks record up front and must never record inside a (timed) step: with ``rerecord=False`` a wrong or
    short recording raises ``ReplayMiss`` naming where the text left it, and a right one runs at accept + 1."""
    from metasd.drafters.replay import ReplayMiss

    model = tiny_qwen(seed=0)
    truth = plain_greedy(model, PROMPT, 20)
    ok = ReplayDrafter(model, accept=2, rerecord=False)
    ok.record(PROMPT, truth)
    ok._record = None  # recording now would fail: proves none runs
    result = Engine(Verifier(model), ok).generate(PROMPT, max_new_tokens=16)
    assert result.token_ids == truth[:16] and set(result.stats.tokens_per_step[:-1]) == {3}
    wrong = ReplayDrafter(model, accept=2, rerecord=False)
    wrong.record(PROMPT, truth[:4] + [(truth[4] + 1) % 64] + truth[5:])
    with pytest.raises(ReplayMiss, match=f"left the recording at position {len(PROMPT) + 4}"):
        Engine(Verifier(model), wrong).generate(PROMPT, max_new_tokens=16)
    short = ReplayDrafter(model, accept=2, rerecord=False)
    short.record(PROMPT, truth[:6])
    with pytest.raises(ReplayMiss, match="the recording ends at"):
        Engine(Verifier(model), short).generate(PROMPT, max_new_tokens=16)
