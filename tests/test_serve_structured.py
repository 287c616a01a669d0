"""Structured output over HTTP with the official openai client: ``response_format`` (a JSON schema, a JSON object) and
vLLM's ``guided_regex`` / ``guided_json`` / ``guided_choice``, with speculation on and off giving the same text under
greedy, the text parsing as JSON valid against the schema (or matching the regex, or one of the choices), and equal to
``Engine.generate`` with the same constraint. Tiny fp32 models over a byte-level BPE trained in the test
(tests/test_constraints.py)."""
from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install -e '.[structured]')")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.constraints import Constraint  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from serve_helpers import ServerThread, openai_client, tiny_chain_engine  # noqa: E402
from test_constraints import CHOICES, REGEX, SCHEMA, byte_bpe, check_schema  # noqa: E402

MODEL = "tiny-json"
MSG = [{"role": "user", "content": "Give me a record."}]


def _engine():
    tok = byte_bpe(340)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    return tiny_chain_engine(tok, MODEL)


@pytest.fixture(scope="module")
def served():
    engine = _engine()
    scheduler = Scheduler(engine, max_batch=4)
    with ServerThread(create_app(scheduler, MODEL)) as srv:
        srv.client = openai_client(srv)
        yield srv
    scheduler.close()
    srv.engine = engine


def _both(create, **kw):
    """The same greedy request with speculation on and off: (on, off)."""
    extra = kw.pop("extra_body", {})
    on = create(temperature=0, extra_body={**extra, "metasd": {"speculate": True}}, **kw)
    off = create(temperature=0, extra_body={**extra, "metasd": {"speculate": False}}, **kw)
    return on, off


def test_json_schema_output_is_valid_and_the_same_with_speculation_on_and_off(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    on, off = _both(served.client.chat.completions.create, model=MODEL, messages=MSG, max_tokens=120,
                    response_format=fmt)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.choices[0].finish_reason == "stop", "the tiny model did not finish the object within max_tokens"
    check_schema(json.loads(on.choices[0].message.content))
    assert on.model_extra["metasd"]["accepted"] > 0, "nothing was accepted: the draft rows were not exercised"


def test_json_object_and_guided_forms(served):
    c = served.client
    obj = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0,
                                    response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = c.completions.create(model=MODEL, prompt="id: ", max_tokens=40, temperature=0,
                                 extra_body={"guided_regex": REGEX})
    assert regex.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, regex.choices[0].text)
    guided = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0,
                                       extra_body={"guided_json": SCHEMA})
    formatted = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "r", "schema": SCHEMA}})
    assert guided.choices[0].message.content == formatted.choices[0].message.content
    llama_server = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0,
                                             response_format={"type": "json_object", "schema": SCHEMA})
    assert llama_server.choices[0].message.content == formatted.choices[0].message.content  # its schema followed


def test_guided_choice_answers_one_of_the_choices(served):
    """vLLM's ``guided_choice``: the answer is one of the strings whole (greedy: the same with speculation on and off;
    sampled: whichever seed), and a bad list or a second structured output is a 400 naming the field."""
    on, off = _both(served.client.chat.completions.create, model=MODEL, messages=MSG, max_tokens=30,
                    extra_body={"guided_choice": CHOICES})
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.choices[0].message.content in CHOICES and on.choices[0].finish_reason == "stop"
    sampled = served.client.completions.create(model=MODEL, prompt="pick: ", max_tokens=30, temperature=1.0, n=6,
                                               seed=1, extra_body={"guided_choice": CHOICES})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in sampled.choices), sampled.choices
    for extra, field in (({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", ""]}, "guided_choice"),
                         ({"guided_regex": REGEX, "guided_choice": ["a"]}, "guided_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            served.client.completions.create(model=MODEL, prompt="pick: ", max_tokens=4, extra_body=extra)
        assert e.value.param == field, e.value.message


def test_the_responses_routes_text_format_is_chats_response_format(served):
    """``/v1/responses`` with ``text.format`` (the schema inline) answers as the chat route with the same format."""
    chat = served.client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}})
    got = served.client.responses.create(model=MODEL, input=MSG[0]["content"], max_output_tokens=120, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "record", "schema": SCHEMA,
                                                          "strict": True}})
    assert got.output_text == chat.choices[0].message.content and got.status == "completed"
    check_schema(json.loads(got.output_text))
    assert got.text.format.type == "json_schema"


def test_answers_equal_engine_generate_with_the_same_constraint(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    got = served.client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0,
                                                response_format=fmt).choices[0].message.content
    regex = served.client.completions.create(model=MODEL, prompt="id: ", max_tokens=40, temperature=0,
                                             extra_body={"guided_regex": REGEX}).choices[0].text
    served.client.close()
    engine = _engine()  # a fresh engine on the same weights: the served one is held by its scheduler
    assert got == engine.generate(MSG, 120, constraint=Constraint.json_schema(SCHEMA)).text
    assert regex == engine.generate("id: ", 40, constraint=Constraint.regex(REGEX)).text
