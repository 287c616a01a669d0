"""Function calling on OpenAI's Responses API (``POST /v1/responses``) with the official openai client: function
``tools`` in the API's flat form and ``tool_choice`` served as the chat route's tools (the same calls, enforced by
the same grammar where a call is required), each call an output item ``function_call`` after the assistant's text,
streamed as the API's events, and a call with its output passed back as input items rendered as chat's tool turns.
The tiny fp32 models and tool template of tests/test_serve_tools.py."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance", reason="tool calls need llguidance (pip install -e '.[structured]')")

from serve_helpers import serving  # noqa: E402
from test_serve_tools import FORCED, MODEL, MSG, TIME, WEATHER, _calls, _engine  # noqa: E402

#: the tools in the Responses API's flat form (chat nests each under "function")
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
INPUT = MSG[0]["content"]


@pytest.fixture(scope="module")
def served():
    with serving(_engine(), MODEL) as srv:
        yield srv


def _respond(served, **kw):
    kw.setdefault("input", INPUT)
    kw.setdefault("tools", TOOLS)
    return served.client.responses.create(model=MODEL, temperature=0, max_output_tokens=80, **kw)


def _chat(served, **kw):
    return served.client.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=80,
                                                 tools=[WEATHER, TIME], **kw)


def _items(response) -> list[tuple]:
    """The output as (type, text) for a message, (type, name, arguments) for a call."""
    return [(o.type, o.content[0].text) if o.type == "message" else (o.type, o.name, json.loads(o.arguments))
            for o in response.output]


def test_a_named_function_is_the_chat_routes_call_as_an_output_item(served):
    got = _respond(served, tool_choice={"type": "function", "name": "get_weather"})
    chat = _chat(served, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert got.status == "completed" and [o.type for o in got.output] == ["function_call"] * len(got.output)
    assert [(name, args) for _, name, args in _items(got)] == _calls(chat.choices[0]) and got.output
    call = got.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert got.output_text == ""  # no message: the model only called
    assert (got.tool_choice.type, got.tool_choice.name) == ("function", "get_weather")
    assert [t.name for t in got.tools] == ["get_weather", "get_time"] and got.parallel_tool_calls is True
    assert got.usage.input_tokens == chat.usage.prompt_tokens  # the tools reached the template alike


def test_text_before_a_call_is_the_message_then_the_call(served):
    got = _respond(served, tool_choice="auto", extra_body={"guided_grammar": FORCED})
    items = _items(got)
    assert [i[:2] for i in items] == [("message", "Sure."), ("function_call", "get_time")]
    assert got.output_text == "Sure." and got.status == "completed"
    plain = _respond(served, tool_choice="none", top_logprobs=1, extra_body={"guided_grammar": FORCED})
    assert [o.type for o in plain.output] == ["message"] and "<tool_call>" in plain.output_text  # never read for calls
    assert len(plain.output[0].content[0].logprobs) == plain.usage.output_tokens  # none: log-probabilities served
    one = _respond(served, tool_choice="required", parallel_tool_calls=False)
    assert [o.type for o in one.output] == ["function_call"] and one.parallel_tool_calls is False


def test_the_stream_is_the_apis_events_for_each_call(served):
    named = {"tool_choice": {"type": "function", "name": "get_weather"}}
    forced = {"tool_choice": "auto", "extra_body": {"guided_grammar": FORCED}}
    for kw, expect in ((named, []), (forced, ["message"])):
        whole = _respond(served, **kw)
        events = list(_respond(served, stream=True, **kw))
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        calls = [i for i, k in enumerate(kinds) if k == "response.function_call_arguments.done"]
        assert len(calls) == len(whole.output) - len(expect) >= 1
        for at in calls:  # each call: added in progress, its arguments whole in one delta, done, the item done
            added, delta, done, item = events[at - 2], events[at - 1], events[at], events[at + 1]
            assert (added.type, added.item.status, added.item.arguments) == ("response.output_item.added",
                                                                             "in_progress", "")
            assert delta.delta == done.arguments == item.item.arguments and item.type == "response.output_item.done"
            assert added.output_index == done.output_index == item.output_index
            assert added.item.id == done.item_id == item.item.id
        if expect:  # the message is item 0 and closes before the first call opens
            assert kinds.index("response.output_item.done") < calls[0] - 2
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
        else:
            assert "response.content_part.added" not in kinds and "response.output_text.delta" not in kinds
        final = events[-1].response
        assert events[-1].type == "response.completed" and _items(final) == _items(whole)
        assert [o.output_index for o in events if o.type == "response.output_item.done"] == list(
            range(len(whole.output)))
    with served.client.responses.stream(model=MODEL, input=INPUT, tools=TOOLS, temperature=0, max_output_tokens=80,
                                        **named) as stream:  # the client's own helper reads the events
        assert _items(stream.get_final_response()) == _items(_respond(served, **named))


def test_a_call_and_its_output_passed_back_are_the_chat_routes_tool_turns(served):
    first = _respond(served, tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    again = _respond(served, input=[{"role": "user", "content": INPUT}, *first.output, result])
    chat = served.client.chat.completions.create(model=MODEL, temperature=0, max_tokens=80, tools=[WEATHER, TIME],
                                                 messages=[*MSG, {"role": "assistant", "content": None, "tool_calls": [
                                                     {"id": call.call_id, "type": "function", "function": {
                                                         "name": call.name, "arguments": call.arguments}}]},
                                                     {"role": "tool", "tool_call_id": call.call_id,
                                                      "content": "21 degrees"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.output_text == (chat.choices[0].message.content or "")
    # text and calls of one turn are one assistant message; a list output is its text parts joined
    parts = {**result, "output": [{"type": "input_text", "text": "21 "}, {"type": "input_text", "text": "degrees"}]}
    turn = [{"role": "user", "content": INPUT}, {"role": "assistant", "content": "Sure."}, *first.output, parts]
    merged = _respond(served, input=turn)
    with_text = served.client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, tools=[WEATHER, TIME],
        messages=[*MSG, {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}])
    assert merged.usage.input_tokens == with_text.usage.prompt_tokens


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.[0].name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.[0].call_id"),
    ({"tools": TOOLS, "top_logprobs": 1}, "top_logprobs"),  # log-probabilities with calls: on chat
    ({"tools": TOOLS, "include": ["message.output_text.logprobs"]}, "include"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(served, body, field):
    r = httpx.post(served.url + "/v1/responses", json={"model": MODEL, "input": INPUT, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()
    assert "OpenAI's own servers" in r.json()["error"]["message"] or field != "tools.[0].type"



def test_a_stored_call_is_answered_by_its_output_alone(served):
    """``previous_response_id``: the stored conversation holds the call, so the next request sends only its output."""
    first = _respond(served, tool_choice={"type": "function", "name": "get_weather"})
    result = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "21 degrees"}
    continued = _respond(served, input=[result], previous_response_id=first.id)
    explicit = _respond(served, input=[{"role": "user", "content": INPUT}, *first.output, result])
    assert continued.usage.input_tokens == explicit.usage.input_tokens
    assert _items(continued) == _items(explicit) and continued.previous_response_id == first.id
