"""A reasoning model's thinking read out of its answer (``--reasoning-parser``), over HTTP with the official openai
client: ``<think>...</think>`` in ``message.reasoning`` / ``reasoning_content`` and the rest in ``content``, streamed
as deltas of each; a block the prompt opened (a template ending in ``<think>``) and DeepSeek-R1's answers, which
start inside one; a block the budget cut; tool calls read from the content only; ``include_reasoning: false``; an
earlier answer's thinking passed back to the template; and the splitter itself against every cut of its input. The
tiny model is made to write such answers by a grammar (``guided_grammar``)."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance", reason="the answers are forced by a grammar: pip install -e '.[structured]'")

from metasd.serve.reasoning import PARSERS  # noqa: E402
from serve_helpers import serving, tiny_chain_engine  # noqa: E402
from test_constraints import byte_bpe  # noqa: E402

MODEL = "tiny-reasoning"
TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}, called as <tool_call>...</tool_call>\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% if m.reasoning_content %} (thought: {{ m.reasoning_content }}){% endif %}\n{% endfor %}assistant: ")
#: a template that opens the thinking block itself, as Qwen3's thinking models' do
OPENING = TEMPLATE + "<think>"
THINK = r'''start: "<think>" "Let me see." "</think>" "\n\nIt is " /[0-9]/ "."'''
NO_THINK = r'''start: "It is " /[0-9]/ "."'''
INSIDE = r'''start: "Let me see." "</think>" "It is " /[0-9]/ "."'''
MSG = [{"role": "user", "content": "What is it?"}]


def _tokenizer(template=TEMPLATE):
    tok = byte_bpe(340)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def served():
    with serving(tiny_chain_engine(_tokenizer(), MODEL, context=1024), MODEL, reasoning_parser="qwen3") as srv:
        yield srv


def _create(srv, grammar, stream=False, **kw):
    return srv.client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSG), temperature=0,
                                              max_tokens=kw.pop("max_tokens", 60), stream=stream,
                                              extra_body={"guided_grammar": grammar, **kw.pop("extra_body", {})}, **kw)


def _reasoning(message) -> tuple[str | None, str | None]:
    extra = message.model_extra or {}
    return extra.get("reasoning"), extra.get("reasoning_content")


def _streamed(srv, grammar, **kw) -> tuple[str, str, list]:
    """The stream's reasoning and content, joined, and its tool calls."""
    reasoning, content, calls = "", "", []
    for chunk in _create(srv, grammar, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            thought, older = _reasoning(delta)
            assert thought == older  # both names carry each piece
            reasoning += thought or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
    return reasoning, content, calls


def test_the_thinking_is_split_from_the_content_whole_and_streamed(served):
    message = _create(served, THINK).choices[0].message
    assert _reasoning(message) == ("Let me see.", "Let me see.")
    assert message.content.startswith("\n\nIt is ") and "<think>" not in message.content
    reasoning, content, _ = _streamed(served, THINK)
    assert (reasoning, content) == ("Let me see.", message.content)


def test_an_answer_without_thinking_is_all_content(served):
    message = _create(served, NO_THINK).choices[0].message
    assert _reasoning(message) == (None, None) and message.content.startswith("It is ")
    assert _streamed(served, NO_THINK)[:2] == ("", message.content)


def test_a_block_the_budget_cut_is_all_reasoning(served):
    budget = len(_tokenizer().encode("<think>Let me"))  # about that far: the block is open when the budget ends
    message = _create(served, THINK, max_tokens=budget).choices[0].message
    thought, _ = _reasoning(message)
    assert message.content == "" and thought and "Let me see.".startswith(thought)
    assert _streamed(served, THINK, max_tokens=budget)[:2] == (thought, "")


def test_an_answer_ending_in_what_may_start_a_marker_keeps_it(served):
    """The splitter holds back "</" (the end marker may follow) and "<th" (an opening one may): at the answer's end
    they are the thinking's and the content's last characters."""
    for grammar, expected in ((r'start: "<think>" "a </"', ("a </", "")), (r'start: "<th"', (None, "<th"))):
        message = _create(served, grammar).choices[0].message
        assert (_reasoning(message)[0], message.content) == expected
        assert _streamed(served, grammar)[:2] == (expected[0] or "", expected[1])


def test_include_reasoning_false_leaves_the_thinking_out(served):
    message = _create(served, THINK, extra_body={"include_reasoning": False}).choices[0].message
    assert _reasoning(message) == (None, None) and message.content.startswith("\n\nIt is ")
    assert _streamed(served, THINK, extra_body={"include_reasoning": False})[0] == ""


def test_tool_calls_are_read_from_the_content_only(served):
    weather = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
    # a call written inside the thinking is thought, not made; the one after it is made
    grammar = (r'''start: "<think>" <tool_call> "x" </tool_call> "</think>" <tool_call> "\n{\"name\": \"get_time\", '''
               r'''\"arguments\": {\"zone\": " /[0-9]/ "}}\n" </tool_call>''')
    tools = {"tools": [weather], "tool_choice": "auto"}
    choice = _create(served, grammar, **tools).choices[0]
    assert _reasoning(choice.message)[0] == "<tool_call>x</tool_call>"
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    reasoning, content, calls = _streamed(served, grammar, **tools)
    assert reasoning == "<tool_call>x</tool_call>" and [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments) == json.loads(choice.message.tool_calls[0].function.arguments)


def test_an_earlier_answers_thinking_reaches_the_template(served):
    import httpx

    history = [*MSG, {"role": "assistant", "content": "It is 4.", "reasoning_content": "w"}, MSG[0]]
    ids = httpx.post(served.url + "/tokenize", json={"messages": history}).json()["tokens"]
    decoded = httpx.post(served.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "assistant: It is 4. (thought: w)" in decoded
    history[1] = {"role": "assistant", "content": "It is 4.", "reasoning": "v"}  # vLLM's name
    ids = httpx.post(served.url + "/tokenize", json={"messages": history}).json()["tokens"]
    assert "(thought: v)" in httpx.post(served.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_the_responses_api_answers_the_thinking_as_a_reasoning_item(served):
    kw = dict(model=MODEL, input="What is it?", max_output_tokens=60, temperature=0,
              extra_body={"guided_grammar": THINK})
    whole = served.client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me see." and whole.output_text.startswith("\n\nIt is ")
    events = list(served.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me see."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Let me see." and final.output_text == whole.output_text
    # the output passed back as input: the thinking reaches the template (a longer prompt than without it)
    turn = [{"role": "user", "content": "What is it?"}]
    back = [item.model_dump(exclude_none=True) for item in whole.output]
    later = [{"role": "user", "content": "And then?"}]
    plain = dict(model=MODEL, max_output_tokens=2, temperature=0)
    with_thought = served.client.responses.create(input=turn + back + later, **plain).usage.input_tokens
    without = served.client.responses.create(input=turn + back[1:] + later, **plain).usage.input_tokens
    assert with_thought == without + len(_tokenizer().encode(" (thought: Let me see.)"))
    continued = served.client.responses.create(input=later, previous_response_id=whole.id, **plain)
    assert continued.usage.input_tokens == with_thought


def _thinking_tokens(ids: list[int], inside: bool = False) -> int:
    """The tokens up to the one whose text completes "</think>" (a linear scan of the decoded prefixes)."""
    tok = _tokenizer()
    for k in range(1, len(ids) + 1):
        if "</think>" in tok.decode(ids[:k]):
            return k
    return len(ids) if inside or tok.decode(ids).lstrip().startswith("<think>") else 0


def test_usage_counts_the_thinking_tokens(served):
    """``usage.completion_tokens_details.reasoning_tokens``: the answer's tokens up to the one that completes the end
    marker (here spelt in several tokens), whole, streamed and in the Responses API; 0 with no block."""
    for grammar, budget in ((THINK, 60), (NO_THINK, 60), (THINK, 6)):  # 6: the budget ends inside the block
        r = _create(served, grammar, max_tokens=budget, logprobs=True,
                    extra_body={"return_tokens_as_token_ids": True})
        ids = [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]
        want = _thinking_tokens(ids)
        assert (want > 0) == (grammar == THINK) and r.usage.completion_tokens == len(ids)
        assert budget == 60 or want == len(ids) == budget  # a block never closed: all thinking
        assert r.usage.completion_tokens_details.reasoning_tokens == want
        chunks = list(_create(served, grammar, stream=True, max_tokens=budget,
                              stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want
    reply = served.client.responses.create(model=MODEL, input="What is it?", max_output_tokens=60, temperature=0,
                                           extra_body={"guided_grammar": THINK})
    whole = _create(served, THINK).usage.completion_tokens_details.reasoning_tokens
    assert reply.usage.output_tokens_details.reasoning_tokens == whole > 0


@pytest.mark.parametrize("template,parser", [(OPENING, "qwen3"), (TEMPLATE, "deepseek_r1")])
def test_answers_that_start_inside_the_block(template, parser):
    """A template that opens the block (qwen3 reads it from the prompt), or DeepSeek-R1's format (always inside)."""
    engine = tiny_chain_engine(_tokenizer(template), MODEL, context=1024)
    with serving(engine, MODEL, reasoning_parser=parser) as srv:
        message = _create(srv, INSIDE).choices[0].message
        assert _reasoning(message)[0] == "Let me see." and message.content.startswith("It is ")
        assert _streamed(srv, INSIDE)[:2] == ("Let me see.", message.content)


def test_a_server_without_a_parser_says_so_where_the_template_thinks(caplog):
    with caplog.at_level("WARNING", logger="metasd.serve.reasoning"):
        with serving(tiny_chain_engine(_tokenizer(OPENING), MODEL, context=1024), MODEL):
            pass
        with serving(tiny_chain_engine(_tokenizer(TEMPLATE), MODEL, context=1024), MODEL):
            pass
    hints = [r for r in caplog.records if "writes <think>: start with --reasoning-parser" in r.getMessage()]
    assert len(hints) == 1  # the template that opens a block, not the other


def test_an_unknown_reasoning_parser_is_refused_naming_the_option():
    from metasd.serve.reasoning import reasoning_parser_named

    with pytest.raises(ValueError, match="--reasoning-parser must be one of qwen3, deepseek_r1"):
        reasoning_parser_named("r2")


#: (answer, whether it starts inside a block) -> (reasoning, content)
SPLITS = {("<think>\nhmm</think>\n\nanswer", False): ("\nhmm", "\n\nanswer"),
          ("plain answer", False): (None, "plain answer"), ("plain answer", True): ("plain answer", ""),
          ("  <think>x</think>y", False): ("x", "y"), ("<think>never closed", False): ("never closed", ""),
          ("a</think>b", False): (None, "a</think>b"), ("a</think>b", True): ("a", "b"),
          ("<thi", False): (None, "<thi"), ("<think></think>", False): ("", ""),
          ("x <think> y", False): (None, "x <think> y"),
          ("<think>a</ b</think>c</think>d", False): ("a</ b", "c</think>d"), ("<think>a</thin", False): ("a</thin", "")}


@pytest.mark.parametrize("text,inside", sorted(SPLITS))
def test_the_splitter_streamed_in_any_pieces_splits_as_whole(text, inside):
    parser = PARSERS["qwen3"]
    assert parser.split(text, inside) == SPLITS[text, inside]
    rng = random.Random(text)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(5, len(text)))))
        stream, reasoning, content = parser.stream(inside), "", ""
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
            r, c = stream.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert ((reasoning + r) if stream.reasoned else None, content + c) == SPLITS[text, inside]
