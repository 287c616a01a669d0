"""Log-probabilities over HTTP, driven by the official ``openai`` client: chat ``logprobs`` / ``top_logprobs`` and the
completions route's ``logprobs`` and ``echo``, streamed and not, with speculation on and off - each equal to the
verifier's own log-probabilities from one forward over the prompt and the answer; penalties equal to a plain penalised
decoding loop (tiny fp32 models)."""
from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from serve_helpers import ServerThread, openai_client, tiny_engine  # noqa: E402

MODEL = "tiny"
MSG = [{"role": "user", "content": "w10 w11 w12 w10 w11"}]
PROMPT = "w20 w21 w22 w20 w21"
TOP = 3


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    scheduler = Scheduler(engine, max_batch=4)
    with ServerThread(create_app(scheduler, MODEL)) as srv:
        srv.engine = engine
        yield srv
    scheduler.close()


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served)


def _reference(engine, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """[len(prompt_ids) + len(new_ids) - 1, vocab]: row i the verifier's log-probabilities of token i + 1."""
    with torch.no_grad():
        logits = engine.verifier.model(input_ids=torch.tensor([prompt_ids + new_ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)[:-1]


def _ids(engine, texts: list[str]) -> list[int]:
    vocab = engine.tokenizer.get_vocab()
    return [vocab[t] for t in texts]


@pytest.mark.parametrize("speculate", [True, False])
def test_chat_logprobs_are_the_verifiers_with_speculation_on_and_off(served, client, speculate):
    engine = served.engine
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=TOP, extra_body={"metasd": {"speculate": speculate}})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    new = _ids(engine, [c.token for c in content])
    prompt = engine.encode(MSG)
    ref = _reference(engine, prompt, new)[len(prompt) - 1:]
    for c, row, t in zip(content, ref, new):
        assert c.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert c.bytes == list(c.token.encode())
        assert [a.token for a in c.top_logprobs] == [engine.tokenizer.decode([i]) for i in row.topk(TOP).indices]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4)
    assert " ".join(c.token for c in content) == r.choices[0].message.content
    if speculate:
        assert r.model_extra["metasd"]["accepted"] > 0, "no draft token was accepted: only row 0 was read"


def test_chat_stream_carries_each_chunks_logprobs(client):
    kw = dict(model=MODEL, messages=MSG, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob, [a.token for a in c.top_logprobs]) for c in streamed] == \
        [(c.token, c.logprob, [a.token for a in c.top_logprobs]) for c in whole]
    plain = list(client.chat.completions.create(stream=True, **(kw | {"logprobs": None, "top_logprobs": None})))
    assert all(ch.choices[0].logprobs is None for ch in plain if ch.choices)  # not asked: not sent


def test_no_logprobs_unless_asked(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_and_echo(served, client):
    engine = served.engine
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == plain.choices[0].text and len(lp.tokens) == 8
    prompt, new = engine.encode(PROMPT), _ids(engine, lp.tokens)
    ref = _reference(engine, prompt, new)
    assert lp.token_logprobs == pytest.approx([float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(new)], abs=1e-4)
    for top, row in zip(lp.top_logprobs, ref[len(prompt) - 1:]):
        best = row.topk(2).indices.tolist()
        assert set(top) >= {engine.tokenizer.decode([i]) for i in best} and len(top) in (2, 3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, echo=True)
    e = echo.choices[0]
    assert e.text == PROMPT + plain.choices[0].text
    assert e.logprobs.tokens == [engine.tokenizer.decode([i]) for i in prompt] + lp.tokens
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    expected = [float(ref[i, t]) for i, t in enumerate(prompt[1:] + new)]  # every token but the first, in order
    assert e.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert echo.usage.completion_tokens == 8 and echo.usage.prompt_tokens == len(prompt)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(served, client):
    """vLLM's ``return_tokens_as_token_ids``: every token of the log-probabilities, alternatives included, is
    ``token_id:<id>``, with the same numbers as by text; the answer's text is unchanged."""
    engine = served.engine
    named = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=TOP)
    by_id = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=TOP, extra_body={"return_tokens_as_token_ids": True})
    assert by_id.choices[0].message.content == named.choices[0].message.content
    for a, b in zip(named.choices[0].logprobs.content, by_id.choices[0].logprobs.content):
        assert b.token == f"token_id:{_ids(engine, [a.token])[0]}" and b.bytes == list(b.token.encode())
        assert b.logprob == a.logprob
        assert [x.token for x in b.top_logprobs] == [f"token_id:{i}" for i in _ids(engine, [x.token for x in
                                                                                            a.top_logprobs])]
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True})
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    assert text.choices[0].logprobs.tokens == [f"token_id:{i}" for i in _ids(engine, plain.choices[0].logprobs.tokens)]


def test_completion_stream_with_echo_sends_the_prompt_first(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_echo_without_logprobs_and_token_id_prompts(served, client):
    engine = served.engine
    ids = engine.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(engine.tokenizer.decode(ids)) and r.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")])
def test_bad_completion_logprobs_are_400s(served, body, param):
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("speculate", [True, False])
def test_penalties_over_http_are_plain_penalised_decoding(served, client, speculate):
    from sampling_check import penalised

    engine, prompt = served.engine, served.engine.encode(PROMPT)
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  presence_penalty=penalties["presence_penalty"],
                                  frequency_penalty=penalties["frequency_penalty"],
                                  extra_body={"repetition_penalty": penalties["repetition_penalty"],
                                              "metasd": {"speculate": speculate}})
    out: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            logits = engine.verifier.model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(penalised(logits, prompt, out, **penalties).argmax()))
    assert r.choices[0].text == engine.tokenizer.decode(out, skip_special_tokens=True)
    unpenalised = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert unpenalised.choices[0].text != r.choices[0].text  # the penalties were applied


def test_n_choices_whole_and_streamed(client):
    greedy = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0, n=3,
                                            logprobs=True)
    alone = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {alone.choices[0].message.content}  # greedy: 3 times the same
    assert greedy.usage.completion_tokens == 3 * alone.usage.completion_tokens
    assert all(len(c.logprobs.content) == alone.usage.completion_tokens for c in greedy.choices)
    assert isinstance(greedy.model_extra["metasd"], list) and len(greedy.model_extra["metasd"]) == 3

    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3)
    sampled = client.completions.create(**kw)
    texts = [c.text for c in sorted(sampled.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "choice i samples with seed + i: the choices should differ"
    assert texts[1] == client.completions.create(**(kw | {"seed": 12, "n": 1})).choices[0].text
    chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)]
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens
    assert sorted(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason) == \
        ["length"] * 3


@pytest.mark.parametrize("route", ["chat", "text"])
def test_vllm_prompt_logprobs_are_the_verifiers(served, client, route):
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}} -
    the prompt token first (its rank among the position's tokens), then the top k - from one forward of the verifier;
    beside ``echo`` with fewer alternatives, each gets its own number; refused with stream (as vLLM)."""
    engine = served.engine
    k = 3
    if route == "chat":
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0,
                                           extra_body={"prompt_logprobs": k})
        prompt = engine.encode(MSG)
    else:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
                                      extra_body={"prompt_logprobs": k})
        prompt = engine.encode(PROMPT)
        assert all(len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs[1:])  # echo keeps logprobs=1
    scores = r.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    ref = _reference(engine, prompt, [])
    for i, (entry, token) in enumerate(zip(scores[1:], prompt[1:])):
        row = ref[i]
        first = next(iter(entry))
        assert int(first) == token and entry[first]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[first]["rank"] == int((row > row[token]).sum()) + 1
        assert entry[first]["decoded_token"] == engine.tokenizer.decode([token])
        best = row.topk(k).indices.tolist()
        assert set(map(int, entry)) == {token, *best}
        for rank, t in enumerate(best, start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
            assert entry[str(t)]["rank"] == rank or t == token
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    bad = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                           "stream": True, "prompt_logprobs": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs", bad.text
