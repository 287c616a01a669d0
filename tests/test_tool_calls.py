"""The tool-call format (metasd/serve/tools.py) without a server: the Hermes parser on well-formed, malformed and
partial text, a stream split at every point giving the whole answer's content and calls, the call grammar accepting
exactly well-formed calls (with the bundled Qwen tokenizer's ``<tool_call>`` token too), Lark constraints, and masks
that never allow a special token the grammar would refuse to consume."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance", reason="tool-call grammars need llguidance (pip install -e '.[structured]')")

from metasd.core.constraints import Constraint, ConstraintError, compile_constraint  # noqa: E402
from metasd.core.decoding.processing import PathProcessing  # noqa: E402
from metasd.core.execution.tree import Draft  # noqa: E402
from metasd.serve.tools import HermesParser, ToolStream, added_tokens, detect_parser, split_answer  # noqa: E402
from test_constraints import _qwen_tokenizer, byte_bpe  # noqa: E402

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}},
                                           "required": ["zone"], "additionalProperties": False}}
TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
       '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')


def _named(calls):
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ("no call here", "no call here", []),
    (TWO, "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    ('<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", {})]),  # the end tag cut off by EOS
    ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
    ('x <tool_call>\n{"name": "f", "arguments": {"a": \n</tool_call>', 'x <tool_call>\n{"name": "f", "arguments": '
                                                                        '{"a": \n</tool_call>', []),  # not JSON
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),  # no name
    ('<tool_call>\n["f"]\n</tool_call>', '<tool_call>\n["f"]\n</tool_call>', []),
])
def test_hermes_parser(text, content, calls):
    got_content, got = HermesParser().parse(text)
    assert got_content == content and _named(got) == calls


def test_one_call_without_parallel_calls_and_openai_bodies():
    content, calls = split_answer(HermesParser(), TWO, parallel=False)
    assert content == "Let me look." and _named(calls) == [("get_weather", {"city": "Paris"})]
    body = calls[0].body(index=0)
    assert body["index"] == 0 and body["type"] == "function" and body["id"].startswith("call_")
    assert json.loads(body["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("text", [TWO, "plain text <tool but no call", "ends in <tool_c", "a <b> c\n\n  ",
                                  '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'])
def test_a_stream_split_anywhere_gives_the_whole_answer(text):
    whole_content, whole_calls = split_answer(HermesParser(), text)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            stream = ToolStream(HermesParser())
            sent = "".join(stream.feed(text[i:min(i + step, cut)]) for i in range(0, cut, step)) + stream.feed(text[cut:])
            rest, calls = stream.finish()
            assert _named(calls) == _named(whole_calls)
            assert (sent + rest or None) == (whole_content if calls else text)
            assert "<tool_call>" not in sent


def test_call_grammar_accepts_well_formed_calls_only():
    tok = byte_bpe(340)
    grammar = HermesParser().grammar([WEATHER, TIME], parallel=True, added=added_tokens(tok))
    compiled = compile_constraint(tok, Constraint.grammar_of(grammar), [0])

    def accepts(text):
        state = compiled.new_state()
        ids = tok.encode(text, add_special_tokens=False)
        for t in ids:
            if not state.mask(len(tok))[t]:
                return False
            state.accept_tokens([t])
        return state.eos_allowed()

    assert accepts(TWO.split("\n", 1)[1])  # both calls, without the content before them
    assert accepts('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_date", "arguments": {"zone": 3}}\n</tool_call>')  # no such tool
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"zone": "x"}}\n</tool_call>')  # bad args
    assert not accepts('<tool_call>\n{"arguments": {"zone": 3}, "name": "get_time"}\n</tool_call>')  # name first
    assert not accepts('Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>')
    one = compile_constraint(tok, Constraint.grammar_of(HermesParser().grammar([TIME], parallel=False)), [0])
    state = one.new_state()
    state.accept_tokens(tok.encode('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>',
                                   add_special_tokens=False))
    assert state.is_complete(), "a second call was allowed without parallel calls"


def test_qwen_tokenizer_writes_calls_with_its_tool_call_token():
    tok = _qwen_tokenizer()
    assert isinstance(detect_parser(tok.chat_template), HermesParser)
    grammar = HermesParser().grammar([WEATHER], added=added_tokens(tok))
    compiled = compile_constraint(tok, Constraint.grammar_of(grammar), [tok.convert_tokens_to_ids("<|im_end|>")])
    state = compiled.new_state()
    start = tok.convert_tokens_to_ids("<tool_call>")
    assert state.mask(len(tok)).nonzero().flatten().tolist() == [start]
    state.accept_tokens(tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                   '</tool_call>', add_special_tokens=False))
    assert state.eos_allowed()


def test_a_mask_never_allows_a_special_token_the_grammar_refuses():
    tok = byte_bpe(340)
    tok.add_tokens(["<tool_call>"])  # an added token: llguidance treats it as special
    special = tok.convert_tokens_to_ids("<tool_call>")
    # the grammar spells the token's text, not the token: llguidance's mask would allow the token (and only it),
    # then refuse to consume it
    compiled = compile_constraint(tok, Constraint.regex("a<tool_call>b"), [0])
    state = compiled.new_state()
    state.accept_tokens(tok.encode("a", add_special_tokens=False))
    mask = state.mask(len(tok))
    assert not mask[special]
    processing = PathProcessing(compiled.new_state(), penalizer=None)
    processing.commit(tok.encode("a", add_special_tokens=False))
    import torch
    with pytest.raises(ConstraintError, match="grammar: allows no token"):  # a clear error, not NaN probabilities
        processing.apply(torch.zeros(1, len(tok)), Draft(tokens=[], parents=[]))
    named = compile_constraint(tok, Constraint.grammar_of('start: "a" <tool_call> "b"'), [0]).new_state()
    named.accept_tokens(tok.encode("a", add_special_tokens=False))
    assert named.mask(len(tok))[special]  # named as a token, it is allowed and consumed
    named.accept_tokens([special])


def test_lark_constraints_name_their_field():
    assert Constraint.grammar_of('start: "a"+') == Constraint.grammar_of('start: "a"+')
    for bad in ("start: (", "", None):
        with pytest.raises(ConstraintError) as e:
            Constraint.grammar_of(bad)
        assert e.value.field == "lark"
    with pytest.raises(ConstraintError, match="lark: is only for kind 'lark'"):
        Constraint("regex", pattern="a", lark="start: x")
