"""``ignore_eos`` (vLLM's, for fixed-length load tests): end-of-sequence tokens do not end a request, which runs to
``max_new_tokens`` - token-identical to a plain greedy loop that never stops, with chain, tree and lookup drafting,
alone and through the scheduler; a value that is not a bool is refused naming the field. Tiny fp32 models."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution.verifier import Verifier
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from tiny import tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
EOS = 1  # tiny_tokenizer's "</s>"
BIAS = {EOS: 2.0}  # end-of-sequence made likely enough that plain decoding meets it early


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _never_stopping(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the bias, one full forward per token, reading past every EOS."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].clone()
            logits[EOS] += BIAS[EOS]
            out.append(int(logits.argmax()))
    return out


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


def test_the_scheduler_ignores_eos_for_the_requests_that_ask(model):
    engine = Engine(Verifier(model, tiny_tokenizer()), _drafters()["tree"], check_tokenizers=False)
    want = _never_stopping(model, PROMPT, 20)
    with Scheduler(engine, max_batch=2) as s:
        with s._lock:  # one step meets both
            ignoring, stopping = (s.submit(PROMPT, 20, logit_bias=BIAS, ignore_eos=flag) for flag in (True, False))
        assert ignoring.result(timeout=120).token_ids == want
        assert stopping.result(timeout=120).token_ids == want[: want.index(EOS) + 1]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_ignore_eos_must_be_a_bool(model, value):
    engine = Engine(Verifier(model, tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^ignore_eos must be true or false"):
        engine.generate(PROMPT, 3, ignore_eos=value)
