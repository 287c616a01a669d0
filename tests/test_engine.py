"""Engine on tiny random models: greedy identity, KV-cache commit, bad input, streaming, sampling exactness."""

import numpy as np
import pytest
import torch

import metasd.core.decoding.commit
import metasd.core.decoding.request
from metasd.core.decoding.drafter import Drafter
from metasd.drafters import NGramDrafter, PretrainedDrafter
from metasd.core.engine import Engine
from metasd.core.decoding.policy import Policy
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from sampling_check import joint_check
from tiny import plain_greedy, tiny_llama, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]


class OracleTreeDrafter(Drafter):
    """Test drafter: a tree whose branches hold the verifier's greedy continuation in a random branch
    (sometimes corrupted) plus random siblings, exercising tree masks, positions and cache gathers."""

    kind = "oracle_tree"

    def __init__(self, model, seed=0, vocab=64):
        super().__init__("oracle_tree")
        self.model, self.rng, self.vocab = model, np.random.default_rng(seed), vocab

    def propose(self, ctx):
        depth = min(4, ctx.max_depth)
        if depth <= 0:
            return Draft.empty()
        truth = plain_greedy(self.model, ctx.tokens.tolist(), depth)
        if self.rng.random() < 0.3:
            truth[self.rng.integers(depth)] = int(self.rng.integers(self.vocab))
        tokens, parents = [], []
        parent = -1
        for d in range(depth):
            n_sib = int(self.rng.integers(1, 4))
            slot = int(self.rng.integers(n_sib))
            chosen = None
            for s in range(n_sib):
                tok = truth[d] if s == slot else int(self.rng.integers(self.vocab))
                tokens.append(tok)
                parents.append(parent)
                if s == slot:
                    chosen = len(tokens) - 1
            parent = chosen
        return Draft(tokens, parents)


class RandomArms(Policy):
    """Test policy: uniformly random arm every step (switches drafters as often as possible)."""

    name = "test_random"

    def reset(self):
        pass

    def select(self, context=None):
        return int(self.rng.integers(self.n_arms))

    def update(self, arm, reward, context=None):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0)


def _engine(model, drafters, policy=None, **kw):
    return Engine(Verifier(model), drafters, policy, check_tokenizers=False, **kw)


@pytest.mark.parametrize("make", [
    lambda m: [],
    lambda m: PretrainedDrafter(tiny_qwen(seed=0), k=4),  # same weights: every draft token accepted
    lambda m: PretrainedDrafter(tiny_llama(seed=3), k=3),  # unrelated drafter: most drafts rejected
    lambda m: PretrainedDrafter(tiny_qwen(seed=0), k=2, adaptive_k=True, confidence_threshold=0.05),
    lambda m: NGramDrafter(k=5, n_max=2),
    lambda m: OracleTreeDrafter(m, seed=1),
], ids=["plain", "same-model", "other-model", "adaptive", "ngram", "tree"])
def test_greedy_output_identical_to_plain_decoding(model, make):
    engine = _engine(model, make(model))
    for n in (1, 7, 40):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(model, PROMPT, n)
        assert result.stats.new_tokens == n == result.stats.committed == 1 + sum(result.stats.tokens_per_step)


def test_identical_drafter_is_always_accepted(model):
    result = _engine(model, PretrainedDrafter(tiny_qwen(seed=0), k=4)).generate(PROMPT, max_new_tokens=41)  # 1 + 8x5
    s = result.stats
    assert s.acceptance_rate == 1.0 and s.mean_tokens_per_step == 5.0 and s.steps == 8
    assert s.per_position_acceptance == [1.0] * 4 and s.acceptance_histogram == {4: 8}


def test_per_step_switching_stays_identical(model):
    pool = [PretrainedDrafter(tiny_qwen(seed=0), k=3, name="good"), PretrainedDrafter(tiny_llama(seed=4), k=3, name="bad"),
            NGramDrafter(k=4, name="ngram"), OracleTreeDrafter(model, seed=2)]
    engine = _engine(model, pool, RandomArms(len(pool), seed=0))
    result = engine.generate(PROMPT, max_new_tokens=60)
    assert result.token_ids == plain_greedy(model, PROMPT, 60)
    assert len(result.stats.selection_counts) == 4  # every drafter was used
    assert result.stats.catch_up_tokens > 0  # idle drafters caught up on tokens committed without them


def test_no_deprecation_warning_reaches_the_user(model):
    """transformers 5.23+ deprecates the ``past_key_values`` argument (removed in 5.40): metasd hands caches over by
    the keyword the installed transformers takes, so no FutureWarning lands in the middle of a user's answer."""
    import warnings

    from metasd.drafters import PretrainedTreeDrafter

    pool = [PretrainedDrafter(tiny_qwen(seed=1), k=3, name="chain"),
            PretrainedTreeDrafter(tiny_qwen(seed=1), nodes=6, depth=3, name="tree", head_vocab=40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        for drafter in pool:
            Engine(Verifier(model), drafter).generate(PROMPT, max_new_tokens=8)


def test_tree_commit_keeps_exactly_the_accepted_path(model):
    verifier = Verifier(model)
    verifier.prefill(torch.tensor(PROMPT[:-1]))
    draft = Draft(tokens=[3, 4, 5, 6, 7], parents=[-1, -1, 1, 1, 3])
    verifier.verify(PROMPT[-1], draft)
    verifier.commit([1, 3, 4])  # tokens 4, 6, 7
    # the cache must equal a fresh prefill of the prompt and the accepted tokens (the bonus stays pending)
    fresh = Verifier(model)
    fresh.prefill(torch.tensor(PROMPT + [4, 6, 7]))
    assert verifier.cached == fresh.cached == len(PROMPT) + 3
    for a, b in zip(verifier.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_drafter_cache_after_catch_up_equals_fresh_prefill():
    drafter_model = tiny_qwen(seed=0)
    drafter = PretrainedDrafter(drafter_model, k=3)
    drafter.begin(None)
    drafter.sync(PROMPT + [1, 2, 3])
    drafter.sync(PROMPT + [1, 9, 9, 9, 4])  # diverges after PROMPT + [1]: crop, then feed the new tokens
    assert drafter.cached_ids == PROMPT + [1, 9, 9, 9, 4] and drafter.last_catch_up == 3
    fresh = PretrainedDrafter(drafter_model, k=3)
    fresh.begin(None)
    fresh.sync(PROMPT + [1, 9, 9, 9, 4])
    for a, b in zip(drafter.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=5, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=5, temperature=1.0, top_p=0.0), "top_p"),
    (dict(max_new_tokens=5, temperature=1.0, top_p=1.2), "top_p"),
    (dict(max_new_tokens=5, stop=[""]), "stop"),
])
def test_bad_generation_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _engine(model, []).generate(PROMPT, **kwargs)


def test_empty_prompt_and_too_long_prompt(tokenizer):
    model = tiny_qwen(seed=0, context=32)
    engine = Engine(Verifier(model, tokenizer, name="tiny-qwen"), [])
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"exceeds the context of tiny-qwen \(32 tokens\)"):
        engine.generate(list(range(6, 36)), max_new_tokens=4)


def test_pool_checks(model):
    with pytest.raises(ValueError, match="needs a policy"):
        _engine(model, [NGramDrafter(name="a"), NGramDrafter(name="b")])
    with pytest.raises(ValueError, match="unique"):
        _engine(model, [NGramDrafter(), NGramDrafter()], RandomArms(2))
    with pytest.raises(ValueError, match="arms"):
        _engine(model, [NGramDrafter()], RandomArms(3))
    with pytest.raises(ValueError, match="granularity"):
        _engine(model, [], granularity="token")


@pytest.mark.parametrize("make", [
    lambda: PretrainedDrafter(tiny_llama(seed=3), k=3),  # rejection sampling of a drafter with probabilities
    lambda: NGramDrafter(k=5, n_max=2),  # sample-and-match of a drafter without
], ids=["model", "ngram"])
def test_an_unseeded_sampled_request_leaves_the_global_rng_alone(model, make):
    """An unseeded sampled request draws from a stream of its own, seeded from the OS's entropy: the caller's global
    torch RNG is in the same state after it as before (no reseeding, no draws), and two such requests differ."""
    engine = _engine(model, make())
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    result = engine.generate(PROMPT, max_new_tokens=16, temperature=1.0)
    assert len(result.token_ids) == 16
    assert torch.equal(torch.get_rng_state(), before) and torch.initial_seed() == 1234
    seeds = {engine._run(PROMPT, 4, temperature=1.0).generator.initial_seed() for _ in range(3)}
    assert len(seeds) == 3  # each unseeded request its own seed
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------- text, chat, stop strings, streaming
def test_text_stop_strings_eos_and_stream(tokenizer):
    model = tiny_qwen(seed=0)
    engine = Engine(Verifier(model, tokenizer), NGramDrafter())
    full = engine.generate([{"role": "user", "content": "w7 w8 w9"}], max_new_tokens=30)
    prompt_text = tokenizer.decode(full.prompt_ids)
    assert prompt_text.startswith("<s> user : w7 w8 w9 </s> <s> assistant :")
    words = full.text.split()
    assert len(words) >= 5
    stop_word = words[4]
    cut = engine.generate([{"role": "user", "content": "w7 w8 w9"}], max_new_tokens=30, stop=stop_word)
    assert cut.text == full.text[: full.text.index(stop_word)] and cut.stats.stop_reason == "stop"
    pieces = list(engine.stream([{"role": "user", "content": "w7 w8 w9"}], max_new_tokens=30))
    assert "".join(pieces) == full.text and len(pieces) > 1
    # EOS: make the verifier's 3rd greedy token the EOS id; generation stops right after it
    eos_model = tiny_qwen(seed=0, eos=full.token_ids[2])
    stopped = Engine(Verifier(eos_model, tokenizer), []).generate([{"role": "user", "content": "w7 w8 w9"}], max_new_tokens=30)
    assert stopped.token_ids == full.token_ids[:3] and stopped.stats.stop_reason == "eos"


def _counting_decodes(tok) -> list[int]:
    """The number of tokens of each ``tok.decode`` call from now on."""
    calls: list[int] = []
    decode = tok.decode
    tok.decode = lambda ids, *a, **kw: calls.append(len(ids)) or decode(ids, *a, **kw)
    return calls


def test_streaming_and_stop_checks_decode_linearly_in_the_output_length():
    """Streaming and the stop-string check read the text incrementally: a request decodes a few tokens per step, not
    its whole output every step (which would decode n^2/2 tokens over n steps)."""
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    engine = Engine(Verifier(tiny_qwen(seed=0), tok), [])  # plain decoding: one token a step, the most steps
    calls = _counting_decodes(tok)
    decoded = {}
    for n in (40, 160):
        for mode in ("stream", "generate"):
            calls.clear()
            if mode == "stream":
                text, result = _drain(engine.stream(PROMPT, max_new_tokens=n, stop=["no such text"]))
                assert text == result.text
            else:
                result = engine.generate(PROMPT, max_new_tokens=n, stop=["no such text"])
            assert len(result.token_ids) == n == result.stats.steps + 1 and result.stats.stop_reason == "length"
            decoded[mode, n] = sum(calls)
            assert len(calls) <= 2 * n + 1, (mode, n, len(calls))  # two short windows a step, the whole text once
    for mode in ("stream", "generate"):
        assert decoded[mode, 160] < 5 * decoded[mode, 40], decoded  # linear: ~4x; quadratic: ~16x
        assert decoded[mode, 160] <= 15 * 160, decoded


def test_a_stop_string_spanning_steps_stops_and_the_stream_never_shows_it(tokenizer):
    """Plain decoding commits one word a step, so a stop string of two words, or of the end of one word and the start
    of the next, is completed by a later step than the one that began it. Generation stops at that step, the text is
    cut before it, and the stream's pieces add up to that text (a piece that may begin a stop string is held back)."""
    engine = Engine(Verifier(tiny_qwen(seed=0), tokenizer), [])
    full = engine.generate(PROMPT, max_new_tokens=30)
    words = full.text.split(" ")
    assert len(words) == 30 and len(set(words[6:10])) > 1
    for stop in (f"{words[6]} {words[7]}", f"{words[8][1:]} {words[9][:2]}"):
        start = full.text.index(stop)
        cut = engine.generate(PROMPT, max_new_tokens=30, stop=[stop, "no such text"])
        assert cut.text == full.text[:start] and cut.stats.stop_reason == "stop"
        assert cut.token_ids == full.token_ids[: 8 if stop.startswith(words[6]) else 10]  # stopped at the step
        text, streamed = _drain(engine.stream(PROMPT, max_new_tokens=30, stop=stop))
        assert streamed.token_ids == cut.token_ids and text == cut.text == streamed.text
    # a prefix of a stop string that never completes is held back only until the text moves past it
    text, streamed = _drain(engine.stream(PROMPT, max_new_tokens=30, stop=f"{words[5]} no such word"))
    assert text == streamed.text == full.text and streamed.stats.stop_reason == "length"


# ---------------------------------------------------------------- sampling exactness end to end
SMALL_V = 8


def _sampling_pvalue(engine, n=1500):
    """Chi-square p-value of n two-token samples against the verifier's exact two-token distribution
    (``sampling_check``: pairs expected fewer than 5 times pooled into one cell); three tokens are generated, so the
    step after the prefill's token drafts the second."""
    return joint_check(engine, [1, 2, 3], n, length=2, max_new_tokens=3).pvalue


@pytest.fixture(scope="module")
def small_pair():
    verifier = tiny_qwen(seed=5, vocab=SMALL_V, logit_scale=4.0)
    drafter = tiny_qwen(seed=6, vocab=SMALL_V, logit_scale=4.0)
    return verifier, drafter


def test_speculative_sampling_matches_the_verifier_distribution(small_pair):
    verifier, drafter = small_pair
    engine = _engine(verifier, PretrainedDrafter(drafter, k=2))
    assert _sampling_pvalue(engine) > 1e-3


def test_wrong_acceptance_rule_fails_the_sampling_test(small_pair, monkeypatch):
    from metasd.core.decoding.acceptance import Acceptance

    def accept_all(draft, p, generator=None):  # deliberately wrong: keeps every draft token
        return Acceptance(list(range(len(draft))), int(torch.multinomial(p[-1], 1, generator=generator)))

    monkeypatch.setattr(metasd.core.decoding.commit, "accept_rejection", accept_all)
    verifier, drafter = small_pair
    engine = _engine(verifier, PretrainedDrafter(drafter, k=2))
    assert _sampling_pvalue(engine) < 1e-6


def test_a_second_request_while_one_runs_is_refused_and_never_corrupts_a_cache(model, tokenizer):
    """Two streams opened on one engine (or on engines sharing its verifier through ``derive``), or two threads: the
    second request is refused while the first holds the verifier and drafters; the first finishes unharmed."""
    import threading

    from metasd.core import EngineBusyError

    engine = Engine(Verifier(model, tokenizer), PretrainedDrafter(tiny_qwen(seed=1), k=3, name="d"), check_tokenizers=False)
    expected = plain_greedy(model, PROMPT, 12)
    first = engine.stream(PROMPT, max_new_tokens=12)
    head = next(first)  # the first request has started
    with pytest.raises(EngineBusyError, match="verifier is in use by another request"):
        engine.generate(PROMPT, max_new_tokens=4)
    with pytest.raises(EngineBusyError):
        next(engine.derive().stream(PROMPT, max_new_tokens=4))  # shares the verifier
    text, result = _drain(first, head)
    assert result.token_ids == expected and text == result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == expected  # usable again, cache intact
    results, errors = [], []

    def run():
        try:
            results.append(engine.generate(PROMPT, max_new_tokens=12).token_ids)
        except EngineBusyError as e:
            errors.append(e)

    started = engine.stream(PROMPT, max_new_tokens=12)
    head = next(started)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and not results  # refused in the other thread while this one holds the engine
    text, result = _drain(started, head)  # the request that held the engine finishes unharmed
    assert result.token_ids == expected and text == result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize("where", ["claim:0", "claim:1", "claim:2", "release:0", "release:2"])
def test_an_interrupt_while_taking_or_dropping_the_engine_never_leaves_it_busy(model, tokenizer, monkeypatch, where):
    """KeyboardInterrupt lands between bytecodes; the worst points are right after a verifier or drafter is marked
    as held (``claim:i``: the i-th mark made, then the interrupt, before the code that made it sees the result) and in
    the cleanup (``release:i``: the interrupt instead of dropping the i-th mark). Either way the request fails with
    the interrupt and the next request on the engine runs, with the verifier's tokens."""
    import metasd.core.engine as engine_module
    from metasd.core import EngineBusyError

    chain = PretrainedDrafter(tiny_qwen(seed=1), k=3, name="chain")
    engine = Engine(Verifier(model, tokenizer), [chain, NGramDrafter(name="ngram")], RandomArms(2, seed=0),
                    check_tokenizers=False)
    expected = plain_greedy(model, PROMPT, 8)
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == expected
    step, index = where.split(":")
    original = getattr(engine_module, f"_{step}")
    calls = []

    def interrupted(owner, claim):
        calls.append(owner)
        if len(calls) - 1 != int(index):
            return original(owner, claim)
        if step == "claim":
            assert original(owner, claim)  # marked as held...
        raise KeyboardInterrupt  # ...and interrupted before anything else happens

    monkeypatch.setattr(engine_module, f"_{step}", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT, max_new_tokens=8)
    assert len(calls) > int(index)  # the interrupt was delivered where the test says
    monkeypatch.undo()
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == expected  # not refused as busy
    other = engine.stream(PROMPT, max_new_tokens=8)  # and a live request is still exclusive
    next(other)
    with pytest.raises(EngineBusyError):
        engine.generate(PROMPT, max_new_tokens=8)
    assert _drain(other)[1].token_ids == expected


def _drain(stream, text: str = ""):
    """The rest of a stream's text (after ``text``, already read) and its ``GenerationResult``."""
    while True:
        try:
            text += next(stream)
        except StopIteration as done:
            return text, done.value
