"""Chat templates as vLLM serves them, over HTTP with the official openai client: ``chat_template_kwargs`` (a variable
the template reads changes the prompt; one it does not read changes nothing and is logged; one of the rendering's own
switches is refused), ``documents`` (rendered where the template reads them, else refused), a request's own
``chat_template`` (only on a server that trusts them), the server's ``--chat-template``, a template's own refusal (a
400 naming the messages, not a 500), and the same fields on ``/tokenize`` and the Responses API."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402

from metasd.cli import main  # noqa: E402
from serve_helpers import serving, tiny_engine  # noqa: E402

MODEL = "tiny-templates"
#: the model's own template: passages first, then the messages; with enable_thinking false the assistant's turn opens
#: with two words more (as Qwen3's template opens an empty thinking block); more than 3 messages refused
TEMPLATE = (
    "{% if messages | length > 3 %}{{ raise_exception('at most 3 messages') }}{% endif %}"
    "{% for d in documents or [] %}<s> system : {{ d['text'] }} </s> {% endfor %}"
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : "
    "{% if enable_thinking is defined and not enable_thinking %}w9 w9 {% endif %}{% endif %}")
#: another template (a server's --chat-template, or a request's own): no documents, the roles left out
PLAIN = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}: {% endif %}"
MSG = [{"role": "user", "content": "w12 w13 w14"}]


def _engine():
    engine = tiny_engine()
    engine.tokenizer.chat_template = TEMPLATE
    return engine


@pytest.fixture(scope="module")
def served():
    with serving(_engine(), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def trusting():
    """A server that takes a request's own template, and renders through PLAIN (--chat-template) by default."""
    with serving(_engine(), MODEL, chat_template=PLAIN, trust_request_chat_template=True) as srv:
        yield srv


def _chat(srv, messages=MSG, **extra):
    return srv.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6,
                                              extra_body=extra)


def _tokens(srv, messages=MSG, **extra) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": messages, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


@pytest.fixture(scope="module")
def reference():
    return _engine()  # the served engines' twin (same seeds), outside any server


def _expected(engine, text: str) -> tuple[int, str]:
    """What the engine answers, greedy, for the prompt ``text`` encodes to: its length and the answer's text."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return len(ids), engine.generate(ids, 6).text


def test_a_variable_the_template_reads_changes_the_prompt_and_the_answer(served, reference):
    plain = _chat(served)
    off = _chat(served, chat_template_kwargs={"enable_thinking": False})
    on = _chat(served, chat_template_kwargs={"enable_thinking": True})
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + 2 == on.usage.prompt_tokens + 2
    n, text = _expected(reference, "<s> user : w12 w13 w14 </s> <s> assistant : w9 w9 ")
    assert (off.usage.prompt_tokens, off.choices[0].message.content) == (n, text)
    assert _tokens(served, chat_template_kwargs={"enable_thinking": False})[-2:] == [9, 9]


def test_a_variable_the_template_does_not_read_changes_nothing_and_is_logged(served, caplog):
    with caplog.at_level(logging.WARNING, logger="metasd.serve"):
        unread = _chat(served, chat_template_kwargs={"reasoning_effort": "low"})
    plain = _chat(served)
    assert (unread.usage.prompt_tokens, unread.choices[0].message.content) == (plain.usage.prompt_tokens,
                                                                                plain.choices[0].message.content)
    assert any("chat_template_kwargs reasoning_effort: not read by the chat template" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("key,hint", [("add_generation_prompt", "send the request's field add_generation_prompt"),
                                      ("tokenize", "the server sets it"), ("messages", "the server sets it")])
def test_the_renderings_own_switches_are_refused_in_chat_template_kwargs(served, key, hint):
    body = _refused(lambda: _chat(served, chat_template_kwargs={key: False}))
    assert body["param"] == f"chat_template_kwargs.{key}" and hint in body["message"]
    r = httpx.post(served.url + "/tokenize", json={"messages": MSG, "chat_template_kwargs": {key: False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}"


def test_documents_are_rendered_where_the_template_reads_them(served, reference):
    docs = [{"title": "a", "text": "w20 w21"}, {"title": "b", "text": "w22"}]
    answer = _chat(served, documents=docs)
    n, text = _expected(reference, "<s> system : w20 w21 </s> <s> system : w22 </s> <s> user : w12 w13 w14 </s> "
                                "<s> assistant : ")
    assert (answer.usage.prompt_tokens, answer.choices[0].message.content) == (n, text)
    assert len(_tokens(served, documents=docs)) == n


def test_documents_a_template_never_reads_are_refused_not_dropped(trusting):
    body = _refused(lambda: _chat(trusting, documents=[{"text": "w20"}]))
    assert (body["param"], body["code"]) == ("documents", "documents_unsupported")


def test_a_request_template_is_refused_unless_the_server_trusts_them(served):
    body = _refused(lambda: _chat(served, chat_template=PLAIN))
    assert body["param"] == "chat_template" and "--trust-request-chat-template" in body["message"]


def test_the_servers_template_and_a_trusted_request_template_are_used(trusting, reference):
    n, text = _expected(reference, "w12 w13 w14 : ")
    own = _chat(trusting)  # --chat-template's PLAIN, not the model's TEMPLATE
    assert (own.usage.prompt_tokens, own.choices[0].message.content) == (n, text)
    theirs = _chat(trusting, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False},
                   documents=[{"text": "w20"}])
    n, text = _expected(reference, "<s> system : w20 </s> <s> user : w12 w13 w14 </s> <s> assistant : w9 w9 ")
    assert (theirs.usage.prompt_tokens, theirs.choices[0].message.content) == (n, text)
    body = _refused(lambda: _chat(trusting, chat_template="{% for m in messages %}"))
    assert body["param"] == "chat_template" and "does not parse" in body["message"]


def test_a_template_that_refuses_the_messages_is_a_400_naming_them(served):
    four = MSG * 4
    body = _refused(lambda: _chat(served, messages=four))
    assert body["param"] == "messages" and "the chat template refused the messages: at most 3 messages" in body[
        "message"]
    r = httpx.post(served.url + "/tokenize", json={"messages": four})
    assert r.status_code == 400 and "at most 3 messages" in r.json()["error"]["message"]


def test_the_responses_api_passes_the_template_fields_on(served):
    plain = served.client.responses.create(model=MODEL, input="w12 w13 w14", max_output_tokens=4, temperature=0)
    off = served.client.responses.create(model=MODEL, input="w12 w13 w14", max_output_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.input_tokens == plain.usage.input_tokens + 2
    body = _refused(lambda: served.client.responses.create(model=MODEL, input="w12", max_output_tokens=4,
                                                           extra_body={"chat_template": PLAIN}))
    assert body["param"] == "chat_template"


@pytest.mark.parametrize("value,message", [("no-such-template.jinja", "no such file, and not a template's text"),
                                           ("{% for m in messages %}", "the template does not parse (line 1")])
def test_a_bad_chat_template_option_exits_2_before_any_model_loads(value, message, capsys):
    assert main(["serve", "--chat-template", value]) == 2
    assert message in capsys.readouterr().err


def test_the_chat_template_option_reads_a_file(tmp_path):
    from metasd.serve.chat_template import read_chat_template

    path = tmp_path / "template.jinja"
    path.write_text(PLAIN)
    assert read_chat_template(str(path)) == read_chat_template(PLAIN) == PLAIN
    path.write_text("  \n")
    with pytest.raises(ValueError, match="the template is empty"):
        read_chat_template(str(path))
