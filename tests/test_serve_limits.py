"""The server's bounds on what one client can make it do (docs/serving.md#limits-and-what-the-server-guarantees): a body
over the limit is a 413 before it is parsed, one too slow to arrive a 408, a request the KV budget could never hold
is a 400 naming ``max_tokens``, requests beyond the budget wait their turn and get their own text, a temperature too
small to divide by is greedy decoding, and parsing and tokenising run off the event loop. Tiny models, a real server
on 127.0.0.1, httpx and the openai client."""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("fastapi")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.engine import Engine  # noqa: E402
from metasd.core.execution.verifier import Verifier  # noqa: E402
from metasd.serve.app import ServeState, create_app  # noqa: E402
from serve_helpers import ServerThread, tiny_engine  # noqa: E402
from tiny import tiny_qwen, tiny_tokenizer  # noqa: E402

MODEL = "tiny"


def _server(engine=None, *, max_body_bytes=64 * 1024, body_timeout_s=60.0, **kw):
    scheduler = Scheduler(engine or tiny_engine(), **kw)
    app = create_app(scheduler, MODEL, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    return ServerThread(app), scheduler


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed():
    srv, scheduler = _server(max_body_bytes=2048)
    try:
        with srv:
            big = {"model": MODEL, "prompt": "w10 " * 1000, "max_tokens": 2}
            r = httpx.post(srv.url + "/v1/completions", json=big)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            # no Content-Length (chunked): refused once what arrived passes the limit
            chunks = (b'{"model": "tiny", "prompt": "' + b"w10 " * 200 for _ in range(4))
            r = httpx.post(srv.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
            assert r.status_code == 413
            ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        scheduler.close()


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes it (or the socket's timeout passes)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pass
    return data


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_holds_up_no_one_else():
    srv, scheduler = _server(body_timeout_s=1.0)
    try:
        with srv:
            port = int(srv.url.rsplit(":", 1)[1])
            slow = socket.create_connection(("127.0.0.1", port), timeout=20)
            t0 = time.monotonic()
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 200\r\n\r\n" + b'{"model": "tiny", ')  # 17 of 200 bytes, then nothing
            ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2})
            assert ok.status_code == 200  # served while the slow body waits
            answer = _answer(slow)
            waited = time.monotonic() - t0
            slow.close()
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"body_timeout"' in answer and 0.9 < waited < 15
            # reads after a complete body are not bounded: a stream outlasting the timeout is whole
            scheduler.add_listener(lambda record: time.sleep(0.6))  # every step (and finish) 0.6 s slower
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            t0 = time.monotonic()
            chunks = list(client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=40, temperature=0,
                                                    stream=True))
            assert time.monotonic() - t0 > 1.0
            assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        scheduler.close()


def test_a_request_without_max_tokens_gets_what_the_kv_budget_holds_not_a_refusal(caplog):
    """A KV budget smaller than the context (here 512 positions, a context of 2,048): a request that leaves max_tokens
    out gets what one request may hold alone (prompt + answer + 17 positions of draft headroom within 512), not a 400
    for a max_tokens it never sent; the start-up log says so; a prompt that leaves no room is refused naming it."""
    from metasd.core.execution.kv_memory import tokens_alone

    tok = tiny_tokenizer()
    engine = Engine(Verifier(tiny_qwen(seed=0, context=2048), tok, name="tiny"), [])
    reference = Engine(Verifier(tiny_qwen(seed=0, context=2048), tok, name="ref"), [])
    with caplog.at_level("WARNING", logger="metasd.serve.app"):
        srv, scheduler = _server(engine, kv_budget=512, max_draft_nodes=16, max_batch=2)
    cache = scheduler.verifier.cache
    assert tokens_alone(cache, 2048, 17) == 512 - 17 and tokens_alone(cache, 400, 17) is None
    assert any("holds one request of at most 495 tokens" in r.getMessage() for r in caplog.records)
    try:
        with srv:
            prompt = [{"role": "user", "content": "w10 w11"}]
            r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": prompt,
                                                                   "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] <= 495
            if r.json()["choices"][0]["finish_reason"] == "length":  # it ran to what fits
                assert usage["prompt_tokens"] + usage["completion_tokens"] == 495
            want = reference.generate(prompt, usage["completion_tokens"]).text
            assert r.json()["choices"][0]["message"]["content"] == want
            long = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10 " * 600,
                                                                 "max_tokens": None})
            assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text
            assert long.json()["error"]["code"] == "kv_budget_exceeded"
    finally:
        scheduler.close()


def test_a_kv_budget_that_holds_no_request_refuses_to_start():
    scheduler = Scheduler(tiny_engine(), kv_budget=16)  # 16 positions: not even a 256-position reservation fits
    try:
        with pytest.raises(ValueError, match="cannot hold one request .* larger --kv-budget"):
            create_app(scheduler, MODEL)
    finally:
        scheduler.close()


def test_a_request_the_kv_budget_could_never_hold_is_a_400_naming_max_tokens_and_others_wait_their_turn():
    tok = tiny_tokenizer()
    engine = Engine(Verifier(tiny_qwen(seed=0, context=2048), tok, name="tiny"), [])
    reference = Engine(Verifier(tiny_qwen(seed=0, context=2048), tok, name="ref"), [])
    srv, scheduler = _server(engine, kv_budget=512, max_draft_nodes=16, max_batch=4)  # two reservations of 256
    prompts = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33", "w12 w11"]
    want = [reference.generate(p, 40).text for p in prompts]
    try:
        with srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt="w10 w11", max_tokens=600)
            assert e.value.param == "max_tokens" and e.value.code == "kv_budget_exceeded"
            assert "KV budget" in e.value.message
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=40,
                                                                        temperature=0).choices[0].text, prompts))
            assert got == want
            deadline = time.monotonic() + 10  # the last answer reaches the client before its step ends and the
            while scheduler.verifier.cache.held_bytes and time.monotonic() < deadline:  # buffers shrink
                time.sleep(0.01)
            assert scheduler.verifier.cache.held_bytes == 0
    finally:
        scheduler.close()


def test_a_temperature_too_small_to_divide_by_is_greedy():
    srv, scheduler = _server()
    try:
        with srv:
            body = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 8}
            greedy = httpx.post(srv.url + "/v1/completions", json=body | {"temperature": 0}, timeout=60)
            tiny_t = httpx.post(srv.url + "/v1/completions", json=body | {"temperature": 1e-40, "seed": 1}, timeout=60)
            assert greedy.status_code == tiny_t.status_code == 200, tiny_t.text
            assert tiny_t.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    finally:
        scheduler.close()


def test_parsing_and_tokenising_run_off_the_event_loop(monkeypatch):
    threads = []
    real = ServeState.prompt_ids
    monkeypatch.setattr(ServeState, "prompt_ids", lambda self, req: threads.append(threading.current_thread().name)
                        or real(self, req))
    srv, scheduler = _server()
    try:
        with srv:
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2})
            assert r.status_code == 200
            loop_thread = srv.thread.name
    finally:
        scheduler.close()
    assert threads and threads[0] != loop_thread
