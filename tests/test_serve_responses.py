"""OpenAI's Responses API (``POST /v1/responses``, metasd/serve/openai_responses.py) driven by the official openai
client: a string or a list of messages (with ``instructions``) answered as the chat route answers the same messages,
whole and streamed as the API's events, the token budget and usage in the API's names, and what this server does not
do refused naming the field (stored responses: tests/test_serve_responses_store.py). Each server runs in a thread on
a free 127.0.0.1 port."""
from __future__ import annotations

import httpx
import openai
import pytest

pytest.importorskip("fastapi")

from metasd.serve.openai_responses_request import ResponsesRequest  # noqa: E402
from serve_helpers import serving, tiny_engine  # noqa: E402

MODEL = "tiny"
TEXT = "w10 w11 w12 w10 w11"


@pytest.fixture(scope="module")
def server():
    with serving(tiny_engine(), MODEL) as srv:
        yield srv


def _chat(server, messages, **kw):
    return server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_string_input_is_answered_as_chat_answers_the_user_message(server):
    chat = _chat(server, [{"role": "user", "content": TEXT}], max_tokens=8)
    got = server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=8, temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.model == MODEL
    assert got.object == "response" and got.id.startswith("resp_") and len(got.output) == 1
    message = got.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
    assert got.usage.total_tokens == chat.usage.total_tokens
    assert (got.status, got.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # 8 tokens: length
    assert message.status == "incomplete"  # the message the budget cut, as the response
    assert got.model_extra["metasd"]["steps"] >= 1  # the request's record, as on the chat routes


def test_messages_and_instructions_are_the_chat_messages(server):
    """``instructions`` is a system turn before the input; a ``developer`` message is a system one; content parts
    are joined."""
    items = [{"role": "developer", "content": "w20 w21"},
             {"role": "user", "content": [{"type": "input_text", "text": "w10 w11 "}, {"type": "input_text",
                                                                                       "text": "w12"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "w13"}]},
             {"type": "message", "role": "user", "content": "w14 w10"}]
    messages = [{"role": "system", "content": "w30"}, {"role": "system", "content": "w20 w21"},
                {"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w13"},
                {"role": "user", "content": "w14 w10"}]
    built = ResponsesRequest.model_validate({"input": items, "instructions": "w30", "max_output_tokens": 6})
    assert [m.model_dump(include={"role", "content"}) for m in built.chat_request().messages] == messages
    chat = _chat(server, messages, max_tokens=6)
    got = server.client.responses.create(model=MODEL, input=items, instructions="w30", max_output_tokens=6,
                                         temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.instructions == "w30"


def test_the_stream_is_the_apis_events_carrying_the_same_text(server):
    whole = server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=10, temperature=0)
    events = list(server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=10, temperature=0,
                                                 stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 10 tokens: max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text and kinds.count("response.output_text.delta") >= 2
    last = events[-1].response
    assert events[-2].item.status == last.output[0].status == "incomplete"
    assert last.output_text == whole.output_text and last.usage.output_tokens == whole.usage.output_tokens
    # the client's own stream helper (it needs response.completed: a stop string ends the text before the budget)
    stop = whole.output_text.split()[3]
    with server.client.responses.stream(model=MODEL, input=TEXT, max_output_tokens=10, temperature=0,
                                        extra_body={"stop": [stop]}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == whole.output_text[: whole.output_text.index(stop)]


def test_the_chat_routes_extensions_are_taken_as_they_are(server):
    """vLLM's and llama-server's fields (not OpenAI's) pass to the chat request: min_p 1 samples the greedy text, a
    stop string cuts it."""
    greedy = server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=10, temperature=0).output_text
    sampled = server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=10, temperature=1.0,
                                             extra_body={"min_p": 1.0, "seed": 5})
    assert sampled.output_text == greedy
    stop = greedy.split()[2]
    cut = server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=10, temperature=0,
                                         extra_body={"stop": [stop]})
    assert cut.output_text == greedy[: greedy.index(stop)] and cut.status == "completed"


def test_a_seeded_sampled_response_is_reproducible(server):
    runs = [server.client.responses.create(model=MODEL, input=TEXT, max_output_tokens=12, temperature=1.0,
                                           extra_body={"seed": seed}).output_text for seed in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _scores(entries) -> list[tuple]:
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs or []]) for e in entries]


@pytest.mark.parametrize("held", [False, True])
def test_log_probabilities_are_the_chat_routes_whole_and_streamed(server, held):
    """``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` alternatives) puts chat's log-probabilities
    of the text's tokens on its ``output_text`` part; streamed, each text delta carries its tokens' and the done event
    all of them - also where a stop string held a token's text back (``held``: a stop string that begins with the
    third word, one token a step), so that a chunk brought its log-probabilities without text."""
    extra = {}
    if held:
        third = _chat(server, [{"role": "user", "content": TEXT}], max_tokens=10).choices[0].message.content.split()[2]
        extra = {"stop": [" " + third + " zz"], "metasd": {"speculate": False}}
    chat = _chat(server, [{"role": "user", "content": TEXT}], max_tokens=10, logprobs=True, top_logprobs=2,
                 extra_body=extra)
    kw = {"model": MODEL, "input": TEXT, "max_output_tokens": 10, "temperature": 0, "top_logprobs": 2,
          "include": ["message.output_text.logprobs"], "extra_body": extra}
    got = server.client.responses.create(**kw)
    part = got.output[0].content[0]
    assert got.output_text == chat.choices[0].message.content
    assert _scores(part.logprobs) == _scores(chat.choices[0].logprobs.content) and part.logprobs
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events = list(server.client.responses.create(stream=True, **kw))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [(e.token, e.logprob) for d in deltas for e in d.logprobs]
    assert streamed == [(e.token, e.logprob) for e in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(e.token, e.logprob) for e in done.logprobs] == streamed
    assert _scores(events[-1].response.output[0].content[0].logprobs) == _scores(part.logprobs)
    # include alone: no alternatives; top_logprobs alone: the same entries; neither: none
    alone = server.client.responses.create(**{**kw, "top_logprobs": None})
    assert [(e.token, e.logprob) for e in alone.output[0].content[0].logprobs] == streamed
    assert all(not e.top_logprobs for e in alone.output[0].content[0].logprobs)
    asked = server.client.responses.create(**{**kw, "include": None})
    assert _scores(asked.output[0].content[0].logprobs) == _scores(part.logprobs)
    plain = server.client.responses.create(**{**kw, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("body, field", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),  # no tool template
    ({"tools": [{"type": "web_search"}]}, "tools.[0].type"),  # a hosted tool
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.[0].type"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAA"}]}, "input.[0].encrypted_content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.[0].content.[0].type"),
    ({"input": []}, "input"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),  # over the tiny model's context
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"min_p": 1.5}, "min_p"),  # the chat routes' extensions are checked as there
    ({"n_predict": 5}, "n_predict"),  # llama-server's fields refused as there
])
def test_what_is_not_served_is_a_400_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": TEXT, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="gpt-4o", input=TEXT)
