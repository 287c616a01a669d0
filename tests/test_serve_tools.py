"""Tool calls over HTTP with the official openai client: tools shown to the model through its chat template, its calls
read out of its text in its own format (Hermes: ``<tool_call>`` JSON ``</tool_call>``), ``tool_choice`` "required"
and a named function enforced by the grammar of that format (arguments valid under the tool's schema), the same
calls with speculation on and off under greedy and streamed as whole, multi-turn tool messages rendered as the
template expects. Tiny fp32 models over a byte-level BPE with ``<tool_call>`` and ``</tool_call>`` as added tokens,
as Qwen's tokenizer has them."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance", reason="tool calls need llguidance (pip install -e '.[structured]')")

import openai  # noqa: E402

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.constraints import Constraint  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.tools import HermesParser, added_tokens  # noqa: E402
from serve_helpers import ServerThread, openai_client, serving, tiny_chain_engine  # noqa: E402
from test_constraints import byte_bpe  # noqa: E402

MODEL = "tiny-tools"
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n{% endfor %}assistant: ")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: a Lark grammar (``<tool_call>``: the added token) of text then a call: what a model that calls a tool may write
FORCED = r'''start: "Sure." "\n" <tool_call> "\n{\"name\": \"get_time\", \"arguments\": {\"zone\": " /[0-9]/ "}}\n" </tool_call>'''


def _tokenizer():
    tok = byte_bpe(340)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    return tok


def _engine(tok=None):
    tok = tok or _tokenizer()
    return tiny_chain_engine(tok, MODEL, context=1024)


@pytest.fixture(scope="module")
def served():
    with serving(_engine(), MODEL) as srv:
        yield srv


def _create(served, speculate=True, **kw):
    kw.setdefault("messages", MSG)
    return served.client.chat.completions.create(model=MODEL, temperature=0, max_tokens=80,
                                                 extra_body={"metasd": {"speculate": speculate},
                                                             **kw.pop("extra_body", {})}, **kw)


def _calls(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_a_named_tool_is_called_with_arguments_valid_under_its_schema(served):
    on = _create(served, tools=[WEATHER, TIME], tool_choice=NAMED)
    off = _create(served, speculate=False, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = on.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice)
    assert [name for name, _ in calls] == ["get_weather"] * len(calls) and calls
    for _, args in calls:
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 8
    assert calls == _calls(off.choices[0]), "speculation changed the greedy tool call"
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert on.model_extra["metasd"]["accepted"] > 0, "nothing was accepted: the draft rows were not exercised"


def test_required_makes_one_call_without_parallel_calls(served):
    out = _create(served, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = _calls(out.choices[0])
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")
    assert out.choices[0].finish_reason == "tool_calls"


def test_the_served_call_is_engine_generate_under_the_call_grammar(served):
    got = _calls(_create(served, tools=[WEATHER], tool_choice="required").choices[0])
    tok = _tokenizer()
    grammar = HermesParser().grammar([WEATHER["function"]], True, added_tokens(tok))
    assert "<tool_call>" in grammar and '"<tool_call>"' not in grammar, "the added token was not named as a token"
    engine = _engine(tok)
    text = engine.generate(engine.encode(MSG, tools=[WEATHER]), 80, constraint=Constraint.grammar_of(grammar)).text
    assert text.startswith("<tool_call>\n")
    assert [(c.name, c.arguments) for c in HermesParser().parse(text)[1]] == got


def test_auto_reads_calls_the_model_writes_and_leaves_other_text_as_content(served):
    plain = _create(served, tools=[WEATHER])  # auto: the tiny model writes no call
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length")
    # a model that writes a call with text before it: forced here by a grammar, read by auto's parser
    forced = _create(served, tools=[WEATHER, TIME], tool_choice="auto", extra_body={"guided_grammar": FORCED})
    choice = forced.choices[0]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    assert len(_calls(choice)) == 1 and _calls(choice)[0][0] == "get_time"
    none = _create(served, tools=[WEATHER, TIME], tool_choice="none", extra_body={"guided_grammar": FORCED})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.startswith("Sure.\n<tool")


def test_a_stream_carries_the_same_content_and_calls_as_the_whole_answer(served):
    for kw in ({"tool_choice": NAMED, "tools": [WEATHER, TIME]},
               {"tool_choice": "auto", "tools": [WEATHER, TIME], "extra_body": {"guided_grammar": FORCED}}):
        whole = _create(served, **dict(kw)).choices[0]
        content, calls, reasons = "", {}, []
        for chunk in _create(served, stream=True, **dict(kw)):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                calls[c.index] = (c.function.name, json.loads(c.function.arguments))
            reasons.append(chunk.choices[0].finish_reason)
        assert (content or None) == whole.message.content
        assert [calls[i] for i in sorted(calls)] == _calls(whole)
        assert reasons[-1] == "tool_calls" and "<tool_call>" not in content


def test_a_tool_result_turn_renders_arguments_as_an_object(served):
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = _create(served, messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content is not None
    served_prompt = out.usage.prompt_tokens
    tok = _tokenizer()
    rendered = [MSG[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    text = tok.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris", "unit": "c"}' in text  # an object, not JSON text quoted again
    assert served_prompt == len(tok.encode(text, add_special_tokens=False))
    import httpx
    got = httpx.post(f"{served.url}/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kw, field", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"extra_body": {"functions": [WEATHER["function"]]}}, "functions"),
    ({"messages": [*MSG, {"role": "tool", "content": "21"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
      "tool_choice": "required"}, "tools"),  # parameters that are no JSON schema
])
def test_bad_tool_requests_get_a_400_naming_the_field(served, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        _create(served, **kw)
    assert (e.value.body.get("param") or "").startswith(field), e.value.body


def test_models_that_cannot_take_or_write_tools_refuse_them():
    plain = _tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    scheduler = Scheduler(_engine(plain), max_batch=2)
    with ServerThread(create_app(scheduler, MODEL)) as srv:
        with pytest.raises(openai.BadRequestError) as e:
            _create(type("S", (), {"client": openai_client(srv)}), tools=[WEATHER])
        assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]
    unread = Scheduler(_engine(), max_batch=2)
    with ServerThread(create_app(unread, MODEL, tool_call_parser="none")) as srv:
        client = type("S", (), {"client": openai_client(srv)})
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, tools=[WEATHER])
        assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]
        shown = _create(client, tools=[WEATHER], tool_choice="none")  # shown to the model, never read
        assert shown.choices[0].message.tool_calls is None
    scheduler.close()
    unread.close()


def test_an_echoed_message_begins_the_content_with_tools_too(served):
    """``echo`` with ``continue_final_message``: the continued assistant message begins the content, whole and
    streamed, when the answer goes through the tool-call parser too."""
    messages = MSG + [{"role": "assistant", "content": "Sure, "}]
    kw = dict(messages=messages, tools=[WEATHER, TIME], tool_choice="auto",
              extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    whole = _create(served, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in _create(served, stream=True, **kw) if c.choices)
    assert whole.startswith("Sure, ") and streamed == whole
