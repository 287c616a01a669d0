"""What ends a request at an end-of-sequence token, vLLM's three switches: ``ignore_eos`` (for fixed-length load
tests: EOS tokens do not end a request, which runs to ``max_new_tokens``), ``min_tokens`` (no EOS before that many
new tokens, masked in every draft row along its path; no stop string counts that ends before the ``min_tokens``-th
token's text) and ``stop_token_ids`` (tokens that end a request as EOS does, ignore_eos or not). Each token-identical to a plain greedy loop written independently, with chain, tree and lookup
drafting, alone and through the scheduler; bad values refused naming the field. Tiny fp32 models."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution.verifier import Verifier
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from sampling_check import joint_check
from tiny import tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
EOS = 1  # tiny_tokenizer's "</s>"
BIAS = {EOS: 2.0}  # end-of-sequence made likely enough that plain decoding meets it early


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _never_stopping(model, prompt: list[int], n: int, min_tokens: int = 0, held=(EOS,), bias=BIAS) -> list[int]:
    """Plain greedy decoding with the ``bias`` on EOS, one full forward per token, reading past every EOS; the
    ``held`` tokens (EOS, stop tokens) never chosen as one of the first ``min_tokens`` tokens."""
    out: list[int] = []
    with torch.no_grad():
        for i in range(n):
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].clone()
            logits[EOS] += bias.get(EOS, 0.0)
            if i < min_tokens:
                logits[list(held)] = float("-inf")
            out.append(int(logits.argmax()))
    return out


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def _drafters():
    return {"none": None, "chain": PretrainedDrafter(tiny_qwen(seed=0, logit_scale=3.0), k=4, name="chain"),
            "tree": PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=3.0), nodes=10, depth=4, width=2, name="tree"),
            "ngram": NGramDrafter(k=4, n_max=2, name="ngram")}


@pytest.mark.parametrize("name", sorted(_drafters()))
def test_ignore_eos_runs_to_max_new_tokens_as_plain_decoding_past_eos(model, name):
    want = _never_stopping(model, PROMPT, 24)
    assert EOS in want[:20], "plain decoding meets no EOS: the test could not fail"
    engine = Engine(Verifier(model, tiny_tokenizer()), _drafters()[name], check_tokenizers=False)
    stops = engine.generate(PROMPT, 24, logit_bias=BIAS)
    assert stops.stats.stop_reason == "eos" and stops.token_ids == want[: want.index(EOS) + 1]
    full = engine.generate(PROMPT, 24, logit_bias=BIAS, ignore_eos=True)
    assert full.token_ids == want and full.stats.stop_reason == "length"


def test_the_scheduler_applies_each_requests_own_end_of_sequence_rule(model):
    engine = Engine(Verifier(model, tiny_tokenizer()), _drafters()["tree"], check_tokenizers=False)
    want = _never_stopping(model, PROMPT, 20)
    held = _until_eos(_never_stopping(model, PROMPT, 20, min_tokens=want.index(EOS) + 2))
    with Scheduler(engine, max_batch=3) as s:
        with s._lock:  # one step meets all three
            ignoring, stopping = (s.submit(PROMPT, 20, logit_bias=BIAS, ignore_eos=flag) for flag in (True, False))
            holding = s.submit(PROMPT, 20, logit_bias=BIAS, min_tokens=want.index(EOS) + 2)
        assert ignoring.result(timeout=120).token_ids == want
        assert stopping.result(timeout=120).token_ids == want[: want.index(EOS) + 1]
        assert holding.result(timeout=120).token_ids == held != stopping.result().token_ids


@pytest.mark.parametrize("value", ["yes", 1])  # None: not given, as every request argument
def test_ignore_eos_must_be_a_bool(model, value):
    engine = Engine(Verifier(model, tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^ignore_eos must be true or false"):
        engine.generate(PROMPT, 3, ignore_eos=value)


@pytest.mark.parametrize("name", sorted(_drafters()))
def test_min_tokens_masks_eos_before_them_as_plain_decoding_does(model, name):
    plain = _never_stopping(model, PROMPT, 24)
    first = plain.index(EOS)
    want = _until_eos(_never_stopping(model, PROMPT, 24, min_tokens=first + 3))
    assert want != _until_eos(plain) and len(want) > first + 3, "min_tokens changed nothing: the test could not fail"
    engine = Engine(Verifier(model, tiny_tokenizer()), _drafters()[name], check_tokenizers=False)
    got = engine.generate(PROMPT, 24, logit_bias=BIAS, min_tokens=first + 3)
    assert got.token_ids == want and got.stats.stop_reason == ("eos" if want[-1] == EOS else "length")


def test_sampled_tokens_follow_the_verifier_with_eos_masked_through_a_tree_of_depth_2():
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=20.0)
    verifier.generation_config.eos_token_id = 2  # (the 8-token model has no tokenizer to name one)
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=10.0), mode="rsd_s", width=3,
                                    nodes=6, depth=2)
    engine = Engine(Verifier(verifier), drafter)
    assert engine.eos_ids() == {2}
    bias = {2: 3.0}  # end-of-sequence likely: masked in the first two positions, then often taken
    check = joint_check(engine, [3], 2000, length=3, logit_bias=bias, min_tokens=2)
    assert check.pvalue > 1e-4, check
    assert check.taken_at(2) >= 100 and check.tried_at(2) - check.taken_at(2) >= 50, check


def test_min_tokens_ignores_a_stop_string_ending_before_its_token(model):
    """vLLM's rule: a stop string counts only when it ends in the text of the min_tokens-th token or a later one."""
    tok = tiny_tokenizer()
    engine = Engine(Verifier(model, tok), _drafters()["chain"], check_tokenizers=False)
    plain = engine.generate(PROMPT, 24, ignore_eos=True)
    words = plain.text.split()
    stop = next(w for w in words if words.count(w) >= 2)  # a word met twice: the second may end the text
    cut_first = plain.text.index(stop)
    assert engine.generate(PROMPT, 24, ignore_eos=True, stop=[stop]).text == plain.text[:cut_first]
    # min_tokens past the first occurrence's token: the text runs on to the next occurrence
    n_first = next(j for j in range(1, 25) if stop in tok.decode(plain.token_ids[:j]))
    second = plain.text.index(stop, cut_first + 1)
    got = engine.generate(PROMPT, 24, ignore_eos=True, stop=[stop], min_tokens=n_first + 1)
    assert got.text == plain.text[:second] and got.stats.stop_reason == "stop"


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(model):
    """vLLM's ``include_stop_str_in_output``: the text ends after the stop string instead of before it (with
    ``min_tokens``, after the occurrence that counts), alone and streamed through the scheduler."""
    tok = tiny_tokenizer()
    engine = Engine(Verifier(model, tok), _drafters()["chain"], check_tokenizers=False)
    plain = engine.generate(PROMPT, 24, ignore_eos=True)
    words = plain.text.split()
    stop = next(w for w in words if words.count(w) >= 2)
    first = plain.text.index(stop)
    n_first = next(j for j in range(1, 25) if stop in tok.decode(plain.token_ids[:j]))
    second = plain.text.index(stop, first + 1)
    cases = [(dict(), plain.text[: first + len(stop)]),
             (dict(min_tokens=n_first + 1), plain.text[: second + len(stop)])]
    for extra, want in cases:
        got = engine.generate(PROMPT, 24, ignore_eos=True, stop=[stop, "never"], include_stop_str_in_output=True,
                              **extra)
        assert got.text == want and got.stats.stop_reason == "stop", extra
        with Scheduler(engine) as s:
            events = list(s.submit(PROMPT, 24, ignore_eos=True, stop=stop, include_stop_str_in_output=True,
                                   **extra).events(timeout=60))
        assert "".join(e.text for e in events) == want and events[-1].finish_reason == "stop", extra
    with pytest.raises(ValueError, match="^include_stop_str_in_output must be true or false"):
        engine.generate(PROMPT, 4, stop="w1", include_stop_str_in_output="yes")


def test_with_min_tokens_the_stream_runs_past_a_stop_string_that_does_not_count(model):
    """A stop string ending before the ``min_tokens``-th token's text does not end the request, so the events carry
    the text after it as it is generated, not all of it in the last event."""
    tok = tiny_tokenizer()
    engine = Engine(Verifier(model, tok), None, check_tokenizers=False)  # a token a step: many events
    plain = engine.generate(PROMPT, 24, ignore_eos=True)
    words = plain.text.split()
    stop = next(w for w in words if words.count(w) >= 2)
    first = plain.text.index(stop)
    n_first = next(j for j in range(1, 25) if stop in tok.decode(plain.token_ids[:j]))
    with Scheduler(engine) as s:
        events = list(s.submit(PROMPT, 24, ignore_eos=True, stop=stop, min_tokens=n_first + 1).events(timeout=60))
    before_last = "".join(e.text for e in events[:-1])
    assert len(before_last) > first + len(stop), (before_last, stop)
    assert before_last + events[-1].text == plain.text[: plain.text.index(stop, first + 1)]


@pytest.mark.parametrize("kwargs, message", [({"min_tokens": -1}, "^min_tokens must be an integer >= 0"),
                                             ({"min_tokens": 4}, r"^min_tokens \(4\) must be at most max_new_tokens"),
                                             ({"min_tokens": 1.5}, "^min_tokens must be an integer")])
def test_a_bad_min_tokens_is_refused_naming_the_field(model, kwargs, message):
    engine = Engine(Verifier(model, tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPT, 3, **kwargs)


@pytest.mark.parametrize("name", sorted(_drafters()))
def test_stop_token_ids_end_the_request_as_eos_does_even_with_ignore_eos(model, name):
    want = _never_stopping(model, PROMPT, 24, bias={})
    stop = next(t for t in want[3:] if t != EOS)  # a token plain decoding meets after a few others
    engine = Engine(Verifier(model, tiny_tokenizer()), _drafters()[name], check_tokenizers=False)
    got = engine.generate(PROMPT, 24, ignore_eos=True, stop_token_ids=[stop])
    assert got.token_ids == want[: want.index(stop) + 1] and got.stats.stop_reason == "stop"
    # held back by min_tokens (EOS ignored): plain decoding with the stop token masked until then
    held = _never_stopping(model, PROMPT, 24, min_tokens=want.index(stop) + 1, held=(stop,), bias={})
    assert held[: want.index(stop) + 1] != want[: want.index(stop) + 1]  # the mask changed something
    got = engine.generate(PROMPT, 24, ignore_eos=True, stop_token_ids=[stop], min_tokens=want.index(stop) + 1)
    assert got.token_ids == (held[: held.index(stop) + 1] if stop in held else held)


@pytest.mark.parametrize("ids, message", [([999], "stop_token_ids: token id 999 is outside the vocabulary (0..63)"),
                                          ([-1], "token id -1 is outside"), ("5", "must be a list of token ids"),
                                          ([True], "token id True is outside")])
def test_bad_stop_token_ids_are_refused_naming_the_field(model, ids, message):
    engine = Engine(Verifier(model, tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^stop_token_ids") as e:
        engine.generate(PROMPT, 3, stop_token_ids=ids)
    assert message in str(e.value)


@pytest.mark.parametrize("streamed", [False, True])
def test_skip_special_tokens_false_keeps_their_text_but_not_the_token_that_ended_the_request(model, streamed):
    """vLLM's ``skip_special_tokens`` (default true) and its rule for the token that ends a request: an end-of-sequence
    or stop token's text is left out of the answer unless ``include_stop_str_in_output``; with skip_special_tokens
    false every other special token's text stays in it. The same whole or streamed (through the scheduler)."""
    tok = tiny_tokenizer()
    engine = Engine(Verifier(model, tok), _drafters()["chain"], check_tokenizers=False)
    bias = {EOS: 1.0}  # plain decoding meets EOS after a word, then a word again
    want = _never_stopping(model, PROMPT, 24, bias=bias)
    stop = next(t for t in want[want.index(EOS) + 1:] if t != EOS)  # a word met after the first EOS

    def text(**kw) -> str:
        if not streamed:
            return engine.generate(PROMPT, 24, logit_bias=bias, **kw).text
        with Scheduler(engine, max_batch=2) as s:
            handle = s.submit(PROMPT, 24, logit_bias=bias, **kw)
            pieces = [e.text for e in handle.events(timeout=60)]
            assert "".join(pieces) == handle.result(timeout=60).text
            return "".join(pieces)

    upto = want[: want.index(EOS)]  # the words before the first EOS, which ends the request
    assert text() == text(skip_special_tokens=False) == tok.decode(upto)
    assert text(skip_special_tokens=False, include_stop_str_in_output=True) == tok.decode(upto + [EOS])
    assert text(include_stop_str_in_output=True) == tok.decode(upto)  # special: skipped
    # past EOS (ignore_eos) to a stop token: the EOS's text is in the answer with skip_special_tokens false only
    past = want[: want.index(stop)]
    assert text(ignore_eos=True, stop_token_ids=[stop]) == tok.decode(past, skip_special_tokens=True)
    assert text(ignore_eos=True, stop_token_ids=[stop], skip_special_tokens=False) == \
        tok.decode(past, skip_special_tokens=False) and "</s>" in tok.decode(past, skip_special_tokens=False)
    assert text(ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True) == \
        tok.decode(past + [stop], skip_special_tokens=True)


def test_a_bad_skip_special_tokens_is_refused_naming_the_field(model):
    engine = Engine(Verifier(model, tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^skip_special_tokens must be true or false, got 'no'"):
        engine.generate(PROMPT, 3, skip_special_tokens="no")
