"""A step that commits several tokens ends the text exactly where plain decoding ends it: a stop string completed by
any of the step's tokens - the same step's EOS included - cuts the text before it, and the tokens counted are the
ones plain decoding would have committed (through ``Engine.generate``, the scheduler and the stream). Temperatures
too small to divide by are greedy decoding. Tiny fp32 models (tests/tiny.py)."""
import math

import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.decoding.drafter import Drafter
from metasd.core.decoding.sampling import SamplingParams, process_logits
from metasd.core.engine import Engine
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]


class OracleChain(Drafter):
    """Drafts the verifier's own greedy continuation, ``k`` tokens: every step commits k + 1 tokens."""

    kind = "test_oracle_chain"

    def __init__(self, model, k=8, eos=frozenset()):
        super().__init__("oracle")
        self.model, self.k, self.eos = model, k, set(eos)

    def propose(self, ctx):
        depth = min(self.k, ctx.max_depth)
        return Draft(plain_greedy(self.model, ctx.tokens.tolist(), depth), list(range(-1, depth - 1))) if depth > 0 \
            else Draft.empty()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _pair(tok, model):
    return (Engine(Verifier(model, tok), [], check_tokenizers=False),
            Engine(Verifier(model, tok), OracleChain(model), check_tokenizers=False))


def test_a_stop_string_and_eos_in_one_step_end_the_text_where_plain_decoding_does(tok):
    base = tiny_qwen(seed=0)
    full = Engine(Verifier(base, tok), [], check_tokenizers=False).generate(PROMPT, 30)
    # the verifier's 6th token becomes EOS; the stop string is the 4th token's text: one oracle step commits both
    model = tiny_qwen(seed=0, eos=full.token_ids[5])
    plain, spec = _pair(tok, model)
    stop = tok.decode(full.token_ids[3:4]).strip()
    want = plain.generate(PROMPT, 30, stop=stop)
    got = spec.generate(PROMPT, 30, stop=stop)
    assert want.stats.stop_reason == "stop" and want.stats.steps == 3  # plain decoding stopped at the 4th token
    assert got.stats.steps == 1  # ... which the speculative step after the prefill's token committed with EOS
    assert (got.text, got.token_ids, got.stats.stop_reason) == (want.text, want.token_ids, "stop")
    assert got.stats.new_tokens == want.stats.new_tokens == 4 and stop not in got.text
    pieces = list(spec.stream(PROMPT, 30, stop=stop))
    assert "".join(pieces) == want.text
    with Scheduler(spec, max_batch=2) as s:
        h = s.submit(PROMPT, 30, stop=stop)
        events = list(h.events(timeout=60))
    assert "".join(e.text for e in events) == want.text and events[-1].finish_reason == "stop"
    assert sum(len(e.token_ids) for e in events) == 4 and events[-1].result.token_ids == want.token_ids


def test_tokens_after_a_stop_string_in_the_same_step_are_not_committed(tok):
    model = tiny_qwen(seed=0)
    plain, spec = _pair(tok, model)
    full = plain.generate(PROMPT, 30)
    stop = tok.decode(full.token_ids[2:3]).strip()
    assert stop not in tok.decode(full.token_ids[:2])
    want = plain.generate(PROMPT, 30, stop=stop)
    got = spec.generate(PROMPT, 30, stop=stop)
    assert got.stats.steps == 1 and want.stats.steps == 2  # after the token drawn with the prefill
    assert (got.text, got.token_ids, got.stats.new_tokens) == (want.text, want.token_ids, 3)


def test_eos_before_a_stop_string_in_the_same_step_still_ends_on_eos(tok):
    base = tiny_qwen(seed=0)
    full = Engine(Verifier(base, tok), [], check_tokenizers=False).generate(PROMPT, 30)
    model = tiny_qwen(seed=0, eos=full.token_ids[2])
    plain, spec = _pair(tok, model)
    stop = tok.decode(full.token_ids[4:5]).strip()  # after the EOS: never reached
    want, got = plain.generate(PROMPT, 30, stop=stop), spec.generate(PROMPT, 30, stop=stop)
    assert want.stats.stop_reason == got.stats.stop_reason == "eos"
    assert got.token_ids == want.token_ids == full.token_ids[:3]


@pytest.mark.parametrize("temperature", [1e-40, 1e-12, 9.9e-6, 0.0])
def test_temperatures_below_1e_5_are_greedy(tok, temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.tensor([[1.0, 3.0, 2.0], [float(2 ** 100), 0.0, -1.0]])
    probs = process_logits(logits, params)
    assert torch.isfinite(probs).all() and probs.argmax(-1).tolist() == [1, 0]
    model = tiny_qwen(seed=0, logit_scale=4.0)
    plain, spec = _pair(tok, model)
    greedy = plain.generate(PROMPT, 12).token_ids
    assert spec.generate(PROMPT, 12, temperature=temperature, seed=3).token_ids == greedy


def test_the_smallest_sampling_temperature_gives_finite_probabilities():
    params = SamplingParams(temperature=1e-5)
    assert not params.greedy
    probs = process_logits(torch.tensor([[30.0, 29.0, -30.0]]), params)
    assert torch.isfinite(probs).all() and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
