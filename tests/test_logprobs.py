"""Log-probabilities (metasd/core/execution/logprobs.py): each committed token's - and, when asked, each prompt
token's - raw log-probability under the verifier, whatever drafted it, through ``Engine.generate`` and the scheduler.
The reference is one forward of the verifier over the prompt and the new tokens, with no cache and no drafting.
Tiny fp32 models (tests/tiny.py)."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution.logprobs import committed_rows, step_logprobs
from metasd.core.execution.verifier import Verifier
from metasd.drafters import FusedDrafter, NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from tiny import tiny_qwen, tiny_tokenizer

PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41, 7, 7, 7, 12, 13]]
MAX_NEW = [24, 9, 30]
TOP = 3


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _pools():
    soft = lambda: tiny_qwen(seed=0, logit_scale=2.0)  # noqa: E731 - softer than the verifier: some drafts rejected
    return {"none": None,
            "chain": PretrainedDrafter(soft(), k=4, name="chain"),
            "tree": PretrainedTreeDrafter(soft(), nodes=8, depth=3, width=2, name="tree"),
            "cascade": FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"),
                                     NGramDrafter(k=4, n_max=2, name="ngram")], enough=4, name="cascade")}


def _reference(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """[len(prompt) + len(new) - 1, vocab] log-probabilities of the verifier over the whole sequence, one forward."""
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return torch.log_softmax(logits.float(), -1)[:-1]  # row i predicts token i + 1


def _check(scores, ref_rows: torch.Tensor, tokens: list[int], top: int):
    assert len(scores) == len(tokens) == len(ref_rows)
    for s, row, t in zip(scores, ref_rows, tokens):
        assert s.token == t
        assert s.logprob == pytest.approx(float(row[t]), abs=1e-4)
        ids = row.topk(top).indices.tolist()
        assert [i for i, _ in s.top] == ids
        assert [lp for _, lp in s.top] == pytest.approx(row[ids].tolist(), abs=1e-4)


def test_committed_rows_follow_the_accepted_path():
    assert committed_rows([]) == [0]
    assert committed_rows([0, 2, 5]) == [0, 1, 3, 6]
    logits = torch.randn(7, 11)  # [n+1, vocab]: a draft of 6 nodes
    got = step_logprobs(logits, [0, 2, 5], [4, 1, 9], top=2)  # a stop kept 3 of the 4 committed tokens
    lp = torch.log_softmax(logits, -1)
    assert [g.logprob for g in got] == pytest.approx([float(lp[0, 4]), float(lp[1, 1]), float(lp[3, 9])])
    assert [g.top[0][0] for g in got] == [int(lp[r].argmax()) for r in (0, 1, 3)]


@pytest.mark.parametrize("pool", ["none", "chain", "tree", "cascade"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_logprobs_are_the_verifiers_raw_ones_whatever_drafted(model, tok, pool, temperature):
    drafter = _pools()[pool]
    engine = Engine(Verifier(model, tok), drafter, check_tokenizers=False)
    accepted = 0
    for prompt, n in zip(PROMPTS, MAX_NEW):
        r = engine.generate(prompt, n, logprobs=TOP, temperature=temperature, seed=5)
        ref = _reference(model, prompt, r.token_ids)[len(prompt) - 1:]  # the rows that predict the new tokens
        _check(r.logprobs, ref, r.token_ids, TOP)  # raw: before the temperature, as vLLM returns them
        assert r.prompt_logprobs is None
        accepted += r.stats.accepted
    assert pool == "none" or accepted > 0, "no draft token was accepted: the path rows were not exercised"


def test_logprobs_zero_gives_the_chosen_tokens_only_and_stops_keep_counts_aligned(model, tok):
    engine = Engine(Verifier(model, tok), _pools()["chain"], check_tokenizers=False)
    full = engine.generate(PROMPTS[2], 30)
    stop = tok.decode(full.token_ids[6:8])
    r = engine.generate(PROMPTS[2], 30, logprobs=0, stop=stop)
    assert r.stats.stop_reason == "stop" and len(r.token_ids) < 30
    assert len(r.logprobs) == len(r.token_ids) and all(s.top == [] for s in r.logprobs)
    assert [s.token for s in r.logprobs] == r.token_ids


def test_prompt_logprobs_cover_every_prompt_token_but_the_first(model, tok, monkeypatch):
    monkeypatch.setattr("metasd.core.execution.verifier.PROMPT_LOGPROBS_CHUNK", 4)  # 17 tokens: 5 forwards
    engine = Engine(Verifier(model, tok), _pools()["tree"], check_tokenizers=False)
    plain = engine.generate(PROMPTS[2], 12)
    r = engine.generate(PROMPTS[2], 12, logprobs=1, prompt_logprobs=TOP)
    assert r.token_ids == plain.token_ids  # scoring the prompt changes nothing else
    ref = _reference(model, PROMPTS[2], r.token_ids)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(PROMPTS[2])
    _check(r.prompt_logprobs[1:], ref[: len(PROMPTS[2]) - 1], PROMPTS[2][1:], TOP)
    assert engine.generate([0], 3, prompt_logprobs=0).prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_logprobs_are_refused_naming_the_field(model, tok, bad):
    engine = Engine(Verifier(model, tok), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^logprobs must be"):
        engine.generate([0, 5], 3, logprobs=bad)
    with pytest.raises(ValueError, match="^prompt_logprobs must be"):
        engine.generate([0, 5], 3, prompt_logprobs=bad)


def test_scheduler_logprobs_equal_generate_per_event_and_in_results(model, tok, monkeypatch):
    monkeypatch.setattr("metasd.core.execution.batch_verifier.PROMPT_LOGPROBS_CHUNK", 3)
    engine = Engine(Verifier(model, tok), _pools()["tree"], check_tokenizers=False)
    expected = [engine.generate(p, n, logprobs=TOP, prompt_logprobs=1) for p, n in zip(PROMPTS, MAX_NEW)]
    with Scheduler(engine, max_batch=3, prefill_chunk=5) as s:  # a long prompt prefills in chunks of 3
        handles = [s.submit(p, n, logprobs=TOP, prompt_logprobs=1) for p, n in zip(PROMPTS, MAX_NEW)]
        streamed = [[lp for e in h.events(timeout=120) for lp in (e.logprobs or [])] for h in handles]
        results = [h.result(timeout=120) for h in handles]
    for want, got, events in zip(expected, results, streamed):
        assert got.token_ids == want.token_ids
        assert [(s.token, s.top) for s in events] == [(s.token, s.top) for s in got.logprobs]
        assert [s.logprob for s in got.logprobs] == pytest.approx([s.logprob for s in want.logprobs], abs=1e-5)
        assert [s and (s.token, s.top[0][0]) for s in got.prompt_logprobs] == \
            [s and (s.token, s.top[0][0]) for s in want.prompt_logprobs]
        assert [s and s.logprob for s in got.prompt_logprobs[1:]] == \
            pytest.approx([s.logprob for s in want.prompt_logprobs[1:]], abs=1e-5)
