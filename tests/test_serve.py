"""``metasd serve``'s app on a tiny-model engine, driven over HTTP by the official ``openai`` client (and httpx for
what the client will not send): both routes streamed and not, greedy outputs of concurrent requests equal
``Engine.generate``'s, seeded sampling, the metasd extension field and its allow-list, every refused input as a 400
naming its field, a disconnect freeing its slot, a failing drafter failing one request, a full queue, an API key,
/metrics, /v1/models, /health and the drain. Each server runs in a thread on a free 127.0.0.1 port."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("fastapi")

from metasd.core.engine import Engine  # noqa: E402
from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.decoding.prompt import render_chat  # noqa: E402
from metasd.core.execution.verifier import Verifier  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.records import SERVED_DRAFTER_COUNTS, SERVED_FIELDS, served_record  # noqa: E402
from serve_helpers import FAIL, GATE, GATED, SLOW, ServerThread, openai_client, tiny_engine  # noqa: E402
from tiny import tiny_qwen, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
MSG = [{"role": "user", "content": "w10 w11 w12 w10 w11"}]


class Recording:
    """The scheduler, with every handle it gave out and every listener record kept (delegates the rest)."""

    def __init__(self, scheduler):
        self._s, self.handles, self.records = scheduler, [], []
        scheduler.add_listener(self.records.append)

    def submit(self, *args, **kwargs):
        handle = self._s.submit(*args, **kwargs)
        self.handles.append(handle)
        return handle

    def __getattr__(self, name):
        return getattr(self._s, name)


def _serve(engine=None, *, api_key=None, app_kwargs=None, **scheduler_kwargs):
    scheduler = Recording(Scheduler(engine or tiny_engine(), **scheduler_kwargs))
    getattr(scheduler, "start", lambda: None)()
    return ServerThread(create_app(scheduler, MODEL, api_key, **(app_kwargs or {}))), scheduler


@pytest.fixture(scope="module")
def server():
    srv, scheduler = _serve(max_batch=8, max_queue=64)
    with srv:
        srv.scheduler = scheduler
        yield srv
    scheduler.close()


@pytest.fixture()
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy decoding of the same verifier through ``Engine.generate`` (a separate copy of its weights)."""
    engine = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer(), name="ref"))
    return lambda prompt, n, **kw: engine.generate(prompt, max_new_tokens=n, **kw)


def _chat(client, messages=MSG, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


# ------------------------------------------------------------------------------ answers
def test_chat_and_completions_streamed_and_not_give_the_greedy_text(client, reference):
    want = reference(MSG, 12)
    whole = _chat(client, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == want.text and whole.choices[0].finish_reason == "length"
    assert whole.object == "chat.completion" and whole.model == MODEL and whole.id.startswith("chatcmpl-")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(want.prompt_ids), 12)
    assert whole.usage.total_tokens == len(want.prompt_ids) + 12

    chunks = list(_chat(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # include_usage: the last chunk

    # vLLM's continuous_usage_stats: every chunk carries its usage so far, growing by the chunk's tokens
    every = list(_chat(client, max_tokens=12, temperature=0, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in every]
    assert so_far[0] == 0 and so_far == sorted(so_far) and so_far[-2:] == [12, 12]
    assert all(c.usage.prompt_tokens == len(want.prompt_ids) for c in every)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in every)
    assert "".join(c.choices[0].delta.content or "" for c in every if c.choices) == want.text
    plain = _chat(client, max_tokens=3, temperature=0, stream=True,
                  stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert all(c.usage is None for c in plain)  # without include_usage: no usage at all, as vLLM

    raw = reference("w10 w11 w12", 9)  # /v1/completions: the prompt as it is, no chat template
    text = client.completions.create(model=MODEL, prompt="w10 w11 w12", max_tokens=9, temperature=0)
    assert text.choices[0].text == raw.text and text.object == "text_completion"
    assert text.usage.prompt_tokens == len(raw.prompt_ids)
    streamed = list(client.completions.create(model=MODEL, prompt=raw.prompt_ids, max_tokens=9, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == raw.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_completions_take_several_prompts_each_choice_indexed_as_vllm(client, server, reference):
    """``prompt`` as a list of strings or of token-id lists (vLLM's batch form): prompt p's choice i is ``index``
    p x n + i, each the text it gets alone; the usage counts every prompt once; streamed, the same per index; echo puts
    each prompt before its own choices; seeded choices sample as a request of that prompt alone."""
    prompts = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33"]
    want = [reference(q, 7) for q in prompts]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, temperature=0, n=2)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [w.text for w in want for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(len(w.prompt_ids) for w in want)
    assert whole.usage.completion_tokens == 6 * 7
    as_ids = client.completions.create(model=MODEL, prompt=[w.prompt_ids for w in want], max_tokens=7, temperature=0)
    assert [c.text for c in as_ids.choices] == [w.text for w in want]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: w.text for i, w in enumerate(want)}
    assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens and chunk.usage.completion_tokens == 3 * 7
    echo = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=3, temperature=0, echo=True)
    assert [c.text for c in echo.choices] == [q + reference(q, 3).text for q in prompts[:2]]
    sampled = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=1.0, seed=5, n=2)
    alone = [client.completions.create(model=MODEL, prompt=q, max_tokens=6, temperature=1.0, seed=5, n=2)
             for q in prompts[:2]]
    assert [c.text for c in sampled.choices] == [c.text for a in alone for c in a.choices]


def test_cached_prompt_tokens_count_each_prompt_once():
    from metasd.serve.responses import Completion

    completion = Completion("text", "m", 20, n=2)  # two prompts, two choices each: per prompt, its choices' most
    assert completion.cached_tokens({0: 5, 1: 3, 2: 0, 3: 7}) == 5 + 7
    assert Completion("chat", "m", 9, n=3).cached_tokens({0: 4, 1: 4, 2: 0}) == 4


def test_four_concurrent_greedy_requests_of_different_lengths_equal_engine_generate(client, server, reference):
    prompts = [[{"role": "user", "content": f"w{10 + i} w{20 + i} w{10 + i} w{30 + i}"}] for i in range(4)]
    lengths = [5, 17, 9, 30]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda a: _chat(client, a[0], max_tokens=a[1], temperature=0), zip(prompts, lengths)))
    for prompt, n, answer in zip(prompts, lengths, answers):
        want = reference(prompt, n)
        assert answer.choices[0].message.content == want.text
        assert answer.usage.completion_tokens == len(want.token_ids) == n


def test_an_assistant_message_continued_is_the_greedy_text_after_it_and_echo_begins_with_it(client, server,
                                                                                          reference):
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt`` false): the answer continues the last message,
    the assistant's start - plain greedy decoding of the template rendered up to its content, left open (its
    end-of-turn removed); with ``echo`` each choice's content begins with that message, streamed and not; ``/tokenize``
    gives the same prompt tokens. Without a last assistant message ``echo`` adds nothing."""
    start = [*MSG, {"role": "assistant", "content": "w20 w21"}]
    tok = tiny_tokenizer()
    ids = tok.encode(render_chat(tok, start, add_generation_prompt=False, continue_final_message=True),
                     add_special_tokens=False)
    assert tok.decode(ids).endswith("assistant : w20 w21")  # open: no "</s>" after the message
    want = reference(ids, 8).text
    assert want != reference(start, 8).text  # a new turn after the message would be another text
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    whole = _chat(client, messages=start, max_tokens=8, temperature=0, extra_body=extra)
    assert whole.choices[0].message.content == want and whole.usage.prompt_tokens == len(ids)
    echoed = _chat(client, messages=start, max_tokens=8, temperature=0, n=2, extra_body=extra | {"echo": True})
    assert [c.message.content for c in echoed.choices] == ["w20 w21" + want] * 2
    chunks = _chat(client, messages=start, max_tokens=8, temperature=0, stream=True, extra_body=extra | {"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w20 w21" + want
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": start} | extra, timeout=60).json()
    assert tokenized["tokens"] == ids
    plain = _chat(client, max_tokens=8, temperature=0, extra_body={"echo": True})  # the last message is the user's
    assert plain.choices[0].message.content == reference(MSG, 8).text


def test_a_logit_bias_gives_plain_decodings_text_under_that_bias(client, reference):
    """OpenAI's ``logit_bias`` (token ids as strings, each in [-100, 100]) gives plain greedy decoding's text with the
    same bias, chat and completions; +100 on a token makes every token that one."""
    bias = {12: 1.5, 11: -100.0}
    want = reference(MSG, 10, logit_bias=bias).text
    assert want != reference(MSG, 10).text  # the bias changes the text: the test can fail
    chat = _chat(client, max_tokens=10, temperature=0, logit_bias={str(t): b for t, b in bias.items()})
    assert chat.choices[0].message.content == want
    text = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=4, temperature=0,
                                     logit_bias={"20": 100})
    assert text.choices[0].text == "w20 w20 w20 w20"
    only = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=6, temperature=0,
                                     extra_body={"allowed_token_ids": [30, 31]})  # vLLM's: nothing else generated
    assert set(only.choices[0].text.split()) <= {"w30", "w31"} and only.usage.completion_tokens == 6
    assert only.choices[0].text == reference("w10 w11", 6, allowed_token_ids=[30, 31]).text


def test_bad_words_give_plain_decodings_text_under_the_same_ban(client, reference):
    """vLLM's ``bad_words``: a one-word ban and a two-word one, chat and completions, streamed too."""
    words = reference(MSG, 10).text.split()
    ban = [words[1], f"{words[3]} {words[4]}"]
    want = reference(MSG, 10, bad_words=ban).text
    assert want != reference(MSG, 10).text  # the ban changes the text: the test can fail
    chat = _chat(client, max_tokens=10, temperature=0, extra_body={"bad_words": ban})
    assert chat.choices[0].message.content == want and words[1] not in want.split()
    chunks = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=8, temperature=0, stream=True,
                                       extra_body={"bad_words": ban})
    assert "".join(c.choices[0].text for c in chunks) == reference("w10 w11", 8, bad_words=ban).text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, server, reference):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (the templated prompt's, on chat), echoed as
    kept; -1 keeps what the context holds."""
    text = client.completions.create(model=MODEL, prompt="w20 w21 w10 w11 w12", max_tokens=6, temperature=0,
                                     echo=True, extra_body={"truncate_prompt_tokens": 3})
    want = reference("w10 w11 w12", 6).text
    assert want != reference("w20 w21 w10 w11 w12", 6).text  # the cut changes the answer: the test can fail
    assert text.choices[0].text == "w10 w11 w12" + want and text.usage.prompt_tokens == 3
    ids = server.scheduler.engine.encode(MSG)
    chat = _chat(client, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": 4})
    assert chat.choices[0].message.content == reference(ids[-4:], 6).text and chat.usage.prompt_tokens == 4
    whole = _chat(client, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)


def test_min_p_one_keeps_only_the_most_likely_token(client, reference):
    """vLLM's and llama-server's ``min_p``: at 1 only tokens as likely as the most likely one stay, so sampling at
    temperature 1 (any seed) gives greedy decoding's text, chat and completions, streamed too."""
    want = reference(MSG, 10).text
    sampled = _chat(client, max_tokens=10, temperature=1.0, seed=3, n=2, extra_body={"min_p": 1.0})
    assert [c.message.content for c in sampled.choices] == [want, want]
    assert _chat(client, max_tokens=10, temperature=1.0, seed=3).choices[0].message.content != want  # without: not
    text = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=6, temperature=1.0, stream=True,
                                     extra_body={"min_p": 1.0})
    assert "".join(c.choices[0].text for c in text) == reference("w10 w11", 6).text


def test_ignore_eos_runs_the_answer_to_max_tokens_and_min_tokens_holds_eos_back(client):
    """vLLM's ``ignore_eos``: with end-of-sequence forced (+100), the answer is one EOS token and stops; asked to
    ignore it, it runs to max_tokens (its EOS tokens left out of the text as special tokens); with ``min_tokens`` it
    stops at the EOS after them. A stop token ends the answer with its text left out unless
    ``include_stop_str_in_output``; ``skip_special_tokens`` false keeps special tokens' text but the ending one's."""
    forced = {"model": MODEL, "prompt": "w10 w11", "max_tokens": 6, "temperature": 0, "logit_bias": {"1": 100}}
    stops = client.completions.create(**forced)
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    runs = client.completions.create(**forced, extra_body={"ignore_eos": True})
    assert runs.choices[0].finish_reason == "length" and runs.usage.completion_tokens == 6
    assert runs.choices[0].text == ""
    held = client.completions.create(**forced, extra_body={"min_tokens": 3})  # vLLM's: no EOS before 3 tokens
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4
    words = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=8, temperature=0).choices[0].text
    third = words.split()[2]  # a stop token: the answer ends at it, its text left out unless included (vLLM's)
    first = words.split().index(third)
    for included in (False, True):
        ends = client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=8, temperature=0, extra_body={
            "stop_token_ids": [int(third[1:])], "include_stop_str_in_output": included})
        assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == first + 1
        assert ends.choices[0].text == " ".join(words.split()[: first + included])
    # skip_special_tokens false: the EOS tokens met past EOS are in the text, the one that ends an answer is not
    kept = client.completions.create(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == " ".join(["</s>"] * 6)
    ended = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    with_it = client.completions.create(**forced, extra_body={"skip_special_tokens": False,
                                                              "include_stop_str_in_output": True})
    assert with_it.choices[0].text == "</s>"


def test_a_stop_string_ends_the_text_before_it_or_after_it_when_included(client, reference):
    text = reference(MSG, 12).text
    stop = text.split()[3]
    answer = _chat(client, max_tokens=12, temperature=0, stop=[stop, "never"])
    assert answer.choices[0].message.content == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output: the text ends after the stop string, streamed or not
    kept = text[: text.index(stop) + len(stop)]
    answer = _chat(client, max_tokens=12, temperature=0, stop=[stop, "never"],
                   extra_body={"include_stop_str_in_output": True})
    assert answer.choices[0].message.content == kept and answer.choices[0].finish_reason == "stop"
    chunks = _chat(client, max_tokens=12, temperature=0, stop=stop, stream=True,
                   extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == kept


def test_sampling_with_a_seed_is_reproducible(client):
    runs = [_chat(client, max_tokens=20, temperature=1.0, seed=seed).choices[0].message.content for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_the_metasd_field_takes_per_request_options_and_serves_the_record(client):
    twin = _chat(client, max_tokens=12, temperature=0, extra_body={"metasd": {"drafter": "twin", "speculate": True}})
    record = twin.model_extra["metasd"]
    assert record["drafter_counts"] == {"twin": {"steps": record["steps"]}}
    assert record["accepted"] > 0 and record["steps"] < 12  # the twin's drafts are the verifier's own tokens
    plain = _chat(client, max_tokens=6, temperature=0, extra_body={"metasd": {"speculate": False}})
    assert plain.model_extra["metasd"]["drafted"] == 0 and plain.model_extra["metasd"]["steps"] == 5  # + the prefill's
    budget = _chat(client, max_tokens=12, temperature=0, extra_body={"metasd": {"drafter": "twin", "draft_budget": 1}})
    assert budget.model_extra["metasd"]["drafted"] <= budget.model_extra["metasd"]["steps"]
    assert budget.choices[0].message.content == twin.choices[0].message.content  # lossless whatever the options


def test_the_drafter_option_picks_one_arm_of_a_pool_of_several():
    from metasd.drafters import NGramDrafter, PretrainedDrafter
    from metasd.policies import UCB1

    tok = tiny_tokenizer()
    arms = [NGramDrafter(k=3, name="ngram"), PretrainedDrafter(tiny_qwen(seed=0), tok, k=3, name="twin")]
    srv, scheduler = _serve(Engine(Verifier(tiny_qwen(seed=0), tok, name="tiny"), arms, UCB1(2)))
    try:
        with srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            answer = _chat(client, max_tokens=8, temperature=0, extra_body={"metasd": {"drafter": "twin"}})
            assert set(answer.model_extra["metasd"]["drafter_counts"]) == {"twin"}
    finally:
        scheduler.close()


def test_served_records_keep_only_the_allow_list():
    record = {"steps": 3, "accepted": 2, "policy_state": {"counts": [9, 1]}, "peer_text": "secret",
              "drafter_counts": {"suffix": {"steps": 3, "from_cache": 2, "match_len": 17}}}
    assert served_record(record) == {"steps": 3, "accepted": 2, "drafter_counts": {"suffix": {"steps": 3}}}


def test_a_shared_suffix_cache_leaves_no_trace_in_the_served_record():
    """With --share-suffix-cache the suffix drafter drafts a second request from the first one's text: its raw
    record says so (from_cache, match_len); the served one does not."""
    from metasd.drafters import SuffixDrafter

    engine = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer(), name="tiny"),
                    [SuffixDrafter(cross_request=True, name="suffix")])
    srv, scheduler = _serve(engine, share_suffix_cache=True)
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        secret = [{"role": "user", "content": "w40 w41 w42 w43 w44 w45 w46 w47"}]
        first = _chat(client, secret, max_tokens=24, temperature=0)
        second = _chat(client, secret, max_tokens=24, temperature=0)
    scheduler.close()
    raw = [r.record for r in scheduler.records if hasattr(r, "record")]
    assert raw[1]["drafter_counts"]["suffix"].get("from_cache", 0) > 0  # the leak the allow-list closes
    for answer in (first, second):
        served = answer.model_extra["metasd"]
        assert set(served) <= set(SERVED_FIELDS) | {"drafter_counts"}
        assert all(set(c) <= set(SERVED_DRAFTER_COUNTS) for c in served["drafter_counts"].values())
        assert "from_cache" not in json.dumps(served) and "match_len" not in json.dumps(served)


# ------------------------------------------------------------------------------ refusals
BAD = [  # (route, body, param at fault); every body is otherwise valid
    ("chat", "{not json", None),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # the template renders no tools
    ("chat", {"max_tokens": "5"}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
    ("chat", {"messages": [{"role": "robot", "content": "w10"}]}, "messages.[0].role"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"stop": 3}, "stop"),
    ("chat", {"stop": [f"w{i}" for i in range(17)]}, "stop"),  # more than MAX_STOPS
    ("chat", {"stop": "w" * 257}, "stop"),  # longer than MAX_STOP_CHARS
    ("chat", {"stop": ["w10", "w" * 257]}, "stop"),
    ("chat", {"n": 17}, "n"),  # more than MAX_CHOICES
    ("chat", {"max_tokens": 250}, "max_tokens"),
    ("chat", {"max_completion_tokens": 250}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": " ".join(["w10"] * 300)}]}, "messages"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # more than MAX_TOP_LOGPROBS
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logit_bias": {"999": 5}}, "logit_bias"),  # outside the tiny vocabulary (refused at submit)
    ("chat", {"logit_bias": {"w12": 5}}, "logit_bias"),
    ("text", {"logit_bias": {"12": 101}}, "logit_bias"),
    ("text", {"min_tokens": -1}, "min_tokens"),
    ("text", {"min_tokens": 5}, "min_tokens"),  # more than max_tokens (4)
    ("text", {"stop_token_ids": [999]}, "stop_token_ids"),
    ("text", {"stop_token_ids": "w10"}, "stop_token_ids"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("text", {"guided_regex": "[unclosed"}, "guided_regex"),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),  # outside OpenAI's [-2, 2]
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"min_p": 1.5}, "min_p"),
    ("chat", {"bad_words": ["w10", " "]}, "bad_words"),
    ("chat", {"bad_words": "w10"}, "bad_words"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"metasd": {"drafter": "nope"}}, "metasd.drafter"),
    ("chat", {"metasd": {"fast": True}}, "metasd.fast"),
    ("chat", {"seed": 2 ** 64}, "seed"),
    ("chat", {"seed": -2 ** 63 - 1}, "seed"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (true)
    ("chat", {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # a user's
    ("text", {"max_completion_tokens": 2}, "max_completion_tokens"),  # a chat field
    ("text", {"max_tokens": 1000}, "max_tokens"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),  # vLLM's, each refused unless "off"
    ("chat", {"allowed_token_ids": [10, 999]}, "allowed_token_ids"),  # outside the tiny vocabulary
    ("chat", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("text", {"truncate_prompt_tokens": 300}, "truncate_prompt_tokens"),  # more than the tiny model's context
    ("text", {"skip_special_tokens": "no"}, "skip_special_tokens"),
    ("text", {"n_predict": 2}, "n_predict"),  # llama-server's
    ("text", {"grammar": 'root ::= "a"'}, "grammar"),
    ("chat", {"json_schema": {"type": "object"}}, "json_schema"),
    ("chat", {"repeat_penalty": 1.1}, "repeat_penalty"),
    ("chat", {"repetition_penalty": 1.2, "repeat_last_n": 64}, "repeat_last_n"),  # a window on a penalty applied
    ("chat", {"response_format": {"type": "json_object", "schema": 5}}, "response_format.schema"),
    ("text", {"logprobs": -1}, "logprobs"),
    ("text", {"prompt": [5, 999]}, "prompt"),
    ("text", {"prompt": []}, "prompt"),
    ("text", {"prompt": [[10], []]}, "prompt"),
    ("text", {"prompt": ["w10", [10]]}, "prompt"),
    ("text", {"prompt": [[10], [5, 999]]}, "prompt"),  # a token id outside the vocabulary in the second prompt
    ("text", {"prompt": ["w10"] * 65}, "prompt"),  # more than MAX_COMPLETIONS
    ("text", {"prompt": ["w10"] * 5, "n": 13}, "prompt"),
    ("text", {"best_of": 3}, "best_of"),
    ("text", {"prompt": "   "}, "prompt"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{r}-{p or 'json'}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field_and_starts_nothing(server, route, body, param):
    base = {"model": MODEL, "max_tokens": 4} | ({"messages": MSG} if route == "chat" else {"prompt": "w10 w11"})
    content = body if isinstance(body, str) else json.dumps(base | body)
    before = len(server.scheduler.handles)
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert len(server.scheduler.handles) == before  # refused before anything was queued


def test_an_unknown_model_is_a_404_and_a_missing_one_the_served_model(client, server):
    before = len(server.scheduler.handles)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    assert e.value.param == "model" and e.value.code == "model_not_found" and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert len(server.scheduler.handles) == before  # refused before anything was queued
    assert client.models.retrieve(MODEL).id == MODEL
    body = {"messages": MSG, "max_tokens": 3, "temperature": 0}
    answers = [httpx.post(server.url + "/v1/chat/completions", json=body | extra).json() for extra in
               ({"model": MODEL}, {}, {"model": None}, {"model": ""})]  # vLLM's: null or "" is the served model
    assert all(a["model"] == MODEL for a in answers), answers
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1


def test_vllm_and_llama_server_off_values_are_accepted(client, reference):
    """Clients built for vLLM or llama-server send their own fields at their "off" values: accepted, the output
    unchanged; vLLM's top_k=-1 is off and its negative seeds are seeds (mod 2**64, as a generator takes them)."""
    off = {"use_beam_search": False, "skip_special_tokens": True, "allowed_token_ids": [], "n_predict": -1,
           "repeat_penalty": 1.0, "typical_p": 1.0, "min_p": 0.0, "top_k": -1,
           "repeat_last_n": 64, "penalty_last_n": 64}  # llama-server's windows: no penalty applied, no change
    got = _chat(client, MSG, max_tokens=6, temperature=0, extra_body=off)
    assert got.choices[0].message.content == reference(MSG, 6).text
    nested = {"messages": [{"role": "user", "content": "w10 w11", "echo": True, "grammar": "x"}], "max_tokens": 2}
    assert httpx.post(client.base_url.__str__().rstrip("/") + "/chat/completions", json=nested).status_code == 200
    sampled = [_chat(client, MSG, max_tokens=8, temperature=1.0, seed=seed).choices[0].message.content
               for seed in (-1, 2 ** 64 - 1, -2 ** 63, 2 ** 63)]
    assert sampled[0] == sampled[1] and sampled[2] == sampled[3]


def test_the_openai_client_gets_its_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, n=99)
    assert e.value.param == "n" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body={"metasd": {"fast": True}})  # metasd's own options stay strict
    assert e.value.param == "metasd.fast" and "Unrecognized request argument" in e.value.message


# ------------------------------------------------------------------------------ faults
def test_a_client_that_disconnects_mid_stream_frees_its_slot_within_one_step(server):
    marks: list[tuple[str, bool]] = []  # per step of any request: (id, was its handle cancelled before the step ended)
    handles = server.scheduler.handles

    def mark(record):
        for r in getattr(record, "requests", []):
            h = next((h for h in handles if h.id == r.id), None)
            marks.append((r.id, bool(h and h.cancelled)))

    server.scheduler.add_listener(mark)
    body = {"model": MODEL, "prompt": f"w10 w{SLOW} w11", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first event: the request is running
        handle = handles[-1]
    handle.result(timeout=30)  # the client closed the connection: the request ends ...
    events = list(handle.events())
    assert events[-1].finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in events) < 50  # ... long before its 200 tokens (0.05 s a step)
    assert sum(1 for rid, cancelled in marks if rid == handle.id and cancelled) <= 1  # at most one step after
    assert server.scheduler.running == 0


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(server):
    body = {"model": MODEL, "prompt": f"w10 w{SLOW} w11", "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    handle = server.scheduler.handles[-1]
    handle.result(timeout=30)
    assert list(handle.events())[-1].finish_reason == "cancelled"


def test_a_request_failing_inside_a_drafter_fails_alone(client, reference):
    failing = [{"role": "user", "content": f"w10 w{FAIL} w11"}]

    def fail_whole():
        with pytest.raises(openai.InternalServerError) as e:
            _chat(client, failing, max_tokens=8, temperature=0)
        return e.value

    def fail_streamed():
        with pytest.raises(openai.APIError) as e:
            list(_chat(client, failing, max_tokens=8, temperature=0, stream=True))
        return e.value

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(fail_whole), pool.submit(fail_streamed),
                pool.submit(_chat, client, MSG, max_tokens=10, temperature=0),
                pool.submit(_chat, client, MSG, max_tokens=14, temperature=0)]
        whole, streamed, ok1, ok2 = (j.result() for j in jobs)
    assert whole.status_code == 500 and whole.type == "server_error"
    with httpx.stream("POST", str(client.base_url).rstrip("/") + "/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": failing, "max_tokens": 8, "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"  # a failed stream ends as every stream does
    for error in (whole, streamed):  # what failed inside stays in the server's log
        assert "on purpose" not in error.message and "the server's log has the error" in error.message
    assert ok1.choices[0].message.content == reference(MSG, 10).text
    assert ok2.choices[0].message.content == reference(MSG, 14).text


def test_more_completions_than_the_queue_can_ever_hold_are_a_400_not_a_429():
    """A 429 says "retry later"; a request for more completions than the queue and the batch hold together would
    get it forever."""
    srv, scheduler = _serve(max_batch=2, max_queue=4)
    try:
        with srv:
            for body, param in (({"prompt": ["w10"] * 4, "n": 2}, "prompt"), ({"prompt": "w10", "n": 7}, "n")):
                r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2} | body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                assert r.json()["error"]["code"] == "too_many_completions"
            assert not scheduler.handles  # refused before anything was queued
            ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": ["w10"] * 3,
                                                                "n": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 6
    finally:
        scheduler.close()


def test_one_failed_choice_fails_the_answer_at_once_and_cancels_the_others(client, server):
    before = len(server.scheduler.handles)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [f"w10 w{SLOW} w11", f"w10 w{FAIL}"], "max_tokens": 200, "temperature": 0})
    assert r.status_code == 500 and "the server's log has the error" in r.json()["error"]["message"], r.text
    slow = server.scheduler.handles[before]
    assert list(slow.events(timeout=30))[-1].finish_reason == "cancelled"  # not left running its 200 tokens


def test_a_full_queue_is_a_429_with_retry_after_and_starts_nothing():
    GATE.clear()
    srv, scheduler = _serve(max_batch=1, max_queue=1)
    gated = {"model": MODEL, "prompt": f"w{GATED} w10", "max_tokens": 3, "temperature": 0}
    try:
        with srv, ThreadPoolExecutor(2) as pool:
            try:  # the gate opens before the pool waits for its requests, whatever happens
                client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
                running = pool.submit(httpx.post, srv.url + "/v1/completions", json=gated, timeout=60)
                _wait(lambda: scheduler.running == 1)
                queued = pool.submit(httpx.post, srv.url + "/v1/completions", json=gated, timeout=60)
                _wait(lambda: scheduler.queue_length == 1)
                with pytest.raises(openai.RateLimitError) as e:
                    client.completions.create(model=MODEL, prompt="w10", max_tokens=2)
                assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
                assert len(scheduler.handles) == 2 and scheduler.queue_length == 1  # nothing started for it
            finally:
                GATE.set()
            assert running.result().status_code == 200 and queued.result().status_code == 200
    finally:
        scheduler.close()


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_an_api_key_guards_every_route_but_health_version_and_metrics(metrics_require_key):
    srv, scheduler = _serve(api_key="sekret", app_kwargs={"metrics_require_key": metrics_require_key})
    guarded = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")]
    try:
        with srv:
            for key in (None, "wrong"):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                for method, path in guarded + [("GET", "/metrics")] * metrics_require_key:
                    r = httpx.request(method, srv.url + path, headers=headers, json={})
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            for path in ("/health", "/version") + ("/metrics",) * (not metrics_require_key):
                assert httpx.get(srv.url + path).status_code == 200, path  # a scraper needs no key by default
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
            good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
            answer = good.completions.create(model=MODEL, prompt="w10", max_tokens=2, temperature=0)
            assert answer.usage.completion_tokens == 2
    finally:
        scheduler.close()


def test_draining_refuses_new_requests_and_finishes_the_running_ones():
    """The signal path of the in-process server (``DrainingServer.handle_exit``, what SIGTERM calls); the real
    signal on a ``metasd serve`` process is in test_serve_cli.py."""
    import signal

    GATE.clear()  # the running request waits at the gate each step until the checks are done
    srv, scheduler = _serve()
    with srv:
        body = {"model": MODEL, "prompt": f"w10 w{GATED}", "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            try:
                lines = r.iter_lines()
                _wait(lambda: scheduler.running == 1)
                srv.server.handle_exit(signal.SIGTERM, None)
                _wait(lambda: srv.server.state.draining)
                refused = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10"})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
                assert httpx.get(srv.url + "/health").status_code == 503
            finally:
                GATE.set()
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the running request finished
        srv.thread.join(30)
        assert not srv.thread.is_alive()  # then the server stopped by itself


# ------------------------------------------------------------------------------ the other routes
def test_models_health_and_an_unknown_route(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_have_vllms_names_and_count(client, server):
    def scrape():
        return _samples(httpx.get(server.url + "/metrics").text)

    labels = f'{{engine="0",model_name="{MODEL}"}}'
    before = after = scrape()

    def grew(name, labels=labels):
        return after.get(name + labels, 0) - before.get(name + labels, 0)

    answer = _chat(client, max_tokens=12, temperature=0)
    record = answer.model_extra["metasd"]
    for _ in range(300):  # the listener may count the last step after the answer is out
        after = scrape()
        drafts = grew("vllm:spec_decode_num_drafts_total")
        if grew("vllm:e2e_request_latency_seconds_count") and drafts == record["steps"]:
            break
        time.sleep(0.02)

    assert grew("vllm:spec_decode_num_drafts_total") == record["steps"]
    assert grew("vllm:spec_decode_num_draft_tokens_total") == record["drafted"]
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == record["accepted"]
    pos0 = f'{{engine="0",model_name="{MODEL}",position="0"}}'
    assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", pos0) == record["position_accepted"][0]
    twin = f'{{drafter="twin",engine="0",model_name="{MODEL}"}}'
    assert grew("metasd:drafter_choices_total", twin) == record["steps"]
    assert grew("vllm:prompt_tokens_total") == answer.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") >= 12
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == record["steps"] - 1
    assert grew("vllm:request_success_total", f'{{engine="0",finished_reason="length",model_name="{MODEL}"}}') == 1
    for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert after[gauge + labels] == 0
    assert not server.server.state.metrics._last_step  # no inter-token clock kept for a finished request


def test_health_fails_after_three_failed_steps_and_says_why_without_internal_text():
    # a load balancer must stop sending requests to a replica whose steps keep failing; one failed step is one fault
    srv, scheduler = _serve()
    with srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        commit = scheduler.verifier.commit

        def broken(*a, **k):
            raise RuntimeError("broken cache")
        scheduler.verifier.commit = broken
        body = {"model": MODEL, "prompt": "w10", "max_tokens": 4, "temperature": 0}
        for i in range(3):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 500 and "broken cache" not in r.text
            health = httpx.get(srv.url + "/health")
            assert health.status_code == (503 if i == 2 else 200)
        assert health.json() == {"status": "failed", "reason": "the last 3 steps failed (every request in them got an "
                                                               "error)"}
        scheduler.verifier.commit = commit
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    scheduler.close()


def test_lookup_only_steps_are_counted_from_the_adaptive_record():
    from metasd.core.batching.adaptive import AdaptiveRecord
    from metasd.core.batching.request_handle import SchedulerStep
    from metasd.serve.metrics import ServeMetrics

    metrics = ServeMetrics("m")
    metrics.on_step(SchedulerStep(3, 9, 0, 0, 0.1, [], AdaptiveRecord(2, [2, 0, 2], 1.5, {}, [1, 0, 1])))
    metrics.on_step(SchedulerStep(1, 1, 0, 0, 0.1, []))  # not adapting: nothing to count
    samples = _samples(metrics.render().decode())
    assert samples['metasd:lookup_only_steps_total{engine="0",model_name="m"}'] == 2
