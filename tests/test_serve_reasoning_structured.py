"""Structured output from a reasoning model over HTTP (official openai client): with ``--reasoning-parser`` and a
tokenizer whose ``<think>`` and ``</think>`` are tokens, a JSON schema holds the answer after the thinking, and the
thinking is free text. The tiny model is steered into and out of its thinking by ``logit_bias`` on the markers."""
from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -e '.[structured]'")

from metasd.serve.reasoning import served_reasoning  # noqa: E402
from serve_helpers import serving, tiny_chain_engine  # noqa: E402
from test_constraints import byte_bpe  # noqa: E402
from test_serve_reasoning import MSG, OPENING, TEMPLATE  # noqa: E402

MODEL = "tiny-thinker"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def _tokenizer(template):
    tok = byte_bpe(340)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=["opening", "plain"])
def served(request):
    tok = _tokenizer(OPENING if request.param == "opening" else TEMPLATE)
    with serving(tiny_chain_engine(tok, MODEL, context=1024), MODEL, reasoning_parser="qwen3") as srv:
        srv.kind, srv.start, srv.end = request.param, *tok.convert_tokens_to_ids(["<think>", "</think>"])
        yield srv


def _bias(srv) -> dict[str, float]:
    """A template that opened the block: a slight pull to close it (a few free tokens first); else open it at once
    (nothing else wins against +99.5) and close it next."""
    if srv.kind == "opening":
        return {str(srv.end): 0.6}
    return {str(srv.start): 99.5, str(srv.end): 100}


def _ask(srv, stream=False, **extra):
    return srv.client.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=60,
                                              response_format=FORMAT, logit_bias=_bias(srv), stream=stream,
                                              extra_body=extra or None)


def _split(message) -> tuple[str | None, str | None]:
    return (message.model_extra or {}).get("reasoning"), message.content


def test_the_schema_holds_the_answer_after_free_thinking(served):
    choice = _ask(served).choices[0]
    reasoning, content = _split(choice.message)
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(content)["a"], int)  # the answer: JSON under the schema
    assert reasoning is not None  # a thinking block was written and read out of the answer
    if served.kind == "opening":
        assert reasoning.strip() and not reasoning.lstrip().startswith("{")  # free text, not held by the schema
    # streamed alike; and the same answer with no drafts (the drafts were masked through the gate, never wrong)
    thought = text = ""
    for chunk in _ask(served, stream=True):
        for c in chunk.choices:
            thought += (c.delta.model_extra or {}).get("reasoning") or ""
            text += c.delta.content or ""
    assert (thought, text) == (reasoning, content)
    plain = _ask(served, metasd={"speculate": False}).choices[0].message
    assert _split(plain) == (reasoning, content)


def test_usage_counts_the_thinking_up_to_the_end_token(served):
    r = _ask(served, logprobs=True, return_tokens_as_token_ids=True)
    ids = [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]
    assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(served.end) + 1


def test_a_tokenizer_that_spells_the_markers_in_pieces_is_named_in_the_log(caplog):
    tok = byte_bpe(340)
    with caplog.at_level(logging.WARNING, logger="metasd.serve.reasoning"):
        parser, ids = served_reasoning("qwen3", tok, TEMPLATE, "tiny")
    assert parser.name == "qwen3" and ids is None
    assert "structured output" in caplog.text and "first token" in caplog.text
    parser, ids = served_reasoning("qwen3", _tokenizer(TEMPLATE), TEMPLATE, "tiny")
    assert ids is not None and len(ids) == 2


def test_the_responses_api_holds_its_text_format_after_the_thinking(served):
    """``text.format`` (the Responses API's ``response_format``) goes through the same gate: a reasoning item with the
    free thinking where the model thought, then a message whose text is JSON under the schema - the chat answer's, with
    its reasoning token count."""
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, input=MSG[0]["content"], max_output_tokens=60, temperature=0, text=text,
              extra_body={"logit_bias": _bias(served)})
    whole = served.client.responses.create(**kw)
    chat = _ask(served)
    reasoning, content = _split(chat.choices[0].message)
    # an empty thinking block (the "plain" template's model closes it at once) is no reasoning item, as in vLLM
    assert [item.type for item in whole.output] == ["reasoning"] * bool(reasoning) + ["message"]
    assert isinstance(json.loads(whole.output_text)["a"], int) and whole.output_text == content
    assert not reasoning or whole.output[0].content[0].text == reasoning
    details = whole.usage.output_tokens_details.reasoning_tokens
    assert details == chat.usage.completion_tokens_details.reasoning_tokens > 0
    events = list(served.client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
