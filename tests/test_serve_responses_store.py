"""Stored responses on OpenAI's Responses API (metasd/serve/response_store.py) with the official openai client: a
finished response is kept (``store``, true by default) and a request naming it in ``previous_response_id`` continues
its conversation - answered as the chat route answers the whole conversation -, ``GET`` / ``DELETE
/v1/responses/{id}`` read and remove it, ``.../input_items`` lists what it was generated from, and what is not stored
is a 404 naming the field. Tiny fp32 models."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

pytest.importorskip("fastapi")

from metasd.core.engine import Engine  # noqa: E402
from metasd.core.execution.verifier import Verifier  # noqa: E402
from metasd.drafters import PretrainedDrafter  # noqa: E402
from metasd.serve.response_store import ResponseStore  # noqa: E402
from serve_helpers import serving  # noqa: E402
from tiny import tiny_qwen, tiny_tokenizer  # noqa: E402

MODEL = "tiny"


def tiny_engine():
    """The tiny verifier and its twin as the drafter - without the prompt markers of serve_helpers' engine, which an
    answer passed back in a conversation could carry."""
    tok = tiny_tokenizer()
    return Engine(Verifier(tiny_qwen(seed=0), tok, name="tiny"), [PretrainedDrafter(tiny_qwen(seed=0), tok, k=3)])


@pytest.fixture(scope="module")
def server():
    with serving(tiny_engine(), MODEL) as srv:
        yield srv


def _respond(server, **kw):
    return server.client.responses.create(model=MODEL, temperature=0, max_output_tokens=6, **kw)


def _chat(server, messages):
    return server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)


def test_a_continued_response_answers_the_whole_conversation(server):
    first = _respond(server, input="w10 w11 w12", instructions="w30")
    assert first.store is True and first.previous_response_id is None
    second = _respond(server, input="w14 w10", previous_response_id=first.id)
    third = _respond(server, input=[{"role": "user", "content": "w20"}], previous_response_id=second.id)
    # the instructions are the first request's alone (not carried over, as in OpenAI's API)
    turns = [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "w14 w10"}]
    chat2 = _chat(server, turns)
    chat3 = _chat(server, turns + [{"role": "assistant", "content": second.output_text},
                                   {"role": "user", "content": "w20"}])
    assert second.output_text == chat2.choices[0].message.content
    assert second.usage.input_tokens == chat2.usage.prompt_tokens
    assert third.output_text == chat3.choices[0].message.content
    assert third.usage.input_tokens == chat3.usage.prompt_tokens
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    # the same turn with the instructions again: a system turn first
    again = _respond(server, input="w14 w10", previous_response_id=first.id, instructions="w30")
    assert again.usage.input_tokens == _chat(server, [{"role": "system", "content": "w30"}, *turns]).usage.prompt_tokens


def test_a_stored_response_is_read_and_deleted(server):
    made = _respond(server, input="w10 w11")
    got = server.client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()  # the object as it was sent, its record included
    deleted = httpx.delete(f"{server.url}/v1/responses/{made.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as e:
        server.client.responses.delete(made.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        _respond(server, input="w12", previous_response_id=made.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(server):
    made = _respond(server, input="w10 w11", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(made.id)
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "w12", "previous_response_id": made.id},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_a_streamed_response_is_stored_once_it_is_done(server):
    events = list(server.client.responses.create(model=MODEL, input="w10 w11 w12", temperature=0,
                                                 max_output_tokens=6, stream=True))
    final = events[-1].response  # response.incomplete: the budget cut it
    got = server.client.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.status == final.status and got.store is True
    continued = _respond(server, input="w13", previous_response_id=final.id)
    chat = _chat(server, [{"role": "user", "content": "w10 w11 w12"},
                          {"role": "assistant", "content": final.output_text}, {"role": "user", "content": "w13"}])
    assert continued.output_text == chat.choices[0].message.content


def test_the_store_keeps_the_most_recent_and_can_be_off():
    with serving(tiny_engine(), MODEL, max_stored_responses=2) as srv:
        made = [_respond(srv, input=f"w{10 + i}") for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            srv.client.responses.retrieve(made[0].id)  # given up for the two newer ones
        assert [srv.client.responses.retrieve(m.id).id for m in made[1:]] == [m.id for m in made[1:]]
    with serving(tiny_engine(), MODEL, max_stored_responses=0) as srv:
        made = _respond(srv, input="w10")
        assert made.store is False
        r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "w12",
                                                        "previous_response_id": made.id}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert "--max-stored-responses 0" in r.json()["error"]["message"]


def test_an_error_in_the_new_input_is_named_from_its_own_items(server):
    first = _respond(server, input="w10")
    r = httpx.post(server.url + "/v1/responses", json={
        "model": MODEL, "previous_response_id": first.id,
        "input": [{"role": "user", "content": "w11"}, {"type": "item_reference", "id": "msg_1"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.[1].type", r.text


def test_the_store_is_bounded_and_least_recently_used_goes_first():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": f"w{i}"}])
        if i == 1:
            assert store.get("r0") is not None  # r0 used: r1 is now the least recent
    assert [k for k in ("r0", "r1", "r2") if store.get(k)] == ["r0", "r2"] and len(store) == 2
    assert store.delete("r0") and not store.delete("r0")
    off = ResponseStore(0)
    assert not off.put({"id": "x"}, []) and off.get("x") is None and not off.enabled
    with pytest.raises(ValueError):
        ResponseStore(-1)
    json.dumps(store.get("r2").response)  # what a GET returns is the JSON it was given


def test_the_input_items_of_a_continued_response_are_listed_in_pages(server):
    first = _respond(server, input="w10 w11")
    second = _respond(server, input=[{"role": "user", "content": [{"type": "input_text", "text": "w12"}]}],
                      previous_response_id=first.id)
    items = server.client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"),
                                                      ("message", "user")]
    assert [i.content[0].text for i in items.data] == ["w10 w11", first.output_text, "w12"]
    assert items.data[1].id == first.output[0].id and all(i.id.startswith("msg_") for i in items.data)
    assert [i.id for i in server.client.responses.input_items.list(second.id).data] == \
        [i.id for i in items.data][::-1]  # newest first by default
    page = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params={"order": "asc", "limit": 2},
                     timeout=30).json()
    assert [i["id"] for i in page["data"]] == [i.id for i in items.data[:2]] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (items.data[0].id, items.data[1].id)
    rest = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items",
                     params={"order": "asc", "after": page["last_id"]}, timeout=30).json()
    assert [i["id"] for i in rest["data"]] == [items.data[2].id] and rest["has_more"] is False
    for params, name in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        r = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params=params, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert httpx.get(f"{server.url}/v1/responses/resp_x/input_items", timeout=30).status_code == 404
