"""What clients and operators of ``metasd serve`` meet beyond generation, on a tiny-model app driven by the official
``openai`` client and httpx: fields a client sends that change nothing are accepted and named in a warning, fields
that would change the output are refused naming them; ``/tokenize``, ``/detokenize`` and ``/version`` in vLLM's
shapes; HTTP-status and process metrics; the access log; ``max_model_len``; the periodic stats line."""
from __future__ import annotations

import logging
import time
from importlib.metadata import version

import httpx
import openai
import pytest

pytest.importorskip("fastapi")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.stats_log import StatsLogger  # noqa: E402
from serve_helpers import ServerThread, openai_client, tiny_engine  # noqa: E402

MODEL = "tiny"
MSG = [{"role": "user", "content": "w10 w11 w12 w10 w11"}]


@pytest.fixture(scope="module")
def server():
    scheduler = Scheduler(tiny_engine(), max_batch=4, max_queue=8)
    getattr(scheduler, "start", lambda: None)()
    srv = ServerThread(create_app(scheduler, MODEL, max_model_len=64))
    with srv:
        srv.scheduler = scheduler
        yield srv
    scheduler.close()


@pytest.fixture()
def client(server):
    return openai_client(server)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSG), temperature=0, **kw)


# ------------------------------------------------------------------------------ fields
def test_inert_fields_are_accepted_and_named_in_a_warning(client, caplog):
    plain = _chat(client).choices[0].message.content
    history = MSG + [{"role": "assistant", "content": "w13", "refusal": None, "tool_calls": None, "audio": None},
                     {"role": "user", "content": "w10"}]
    with caplog.at_level(logging.WARNING, logger="metasd.serve"):
        answer = _chat(client, store=True, metadata={"run": "7"}, user="u-1", parallel_tool_calls=False,
                       service_tier="auto", tool_choice="none", extra_body={"prompt_cache_key": "k"})
        with_history = _chat(client, messages=history, stream_options=None)
    assert answer.choices[0].message.content == plain  # nothing changed
    assert with_history.choices[0].finish_reason == "length"
    warned = " ".join(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    for name in ("store", "metadata", "user", "service_tier", "prompt_cache_key",
                 "messages.[1].refusal", "messages.[1].audio"):
        assert name in warned, (name, warned)


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tools"),  # this chat template does not render tools
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"guided_grammar": "root ::= 'a'"}}, "guided_grammar"),  # GBNF, not Lark
    ({"extra_body": {"logits_processors": ["my_module.Processor"]}}, "logits_processors"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),  # the legacy form of tools
    ({"messages": MSG + [{"role": "tool", "content": "21"}]}, "messages.[1]"),  # no tool_call_id
])
def test_fields_that_would_change_the_output_are_refused_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **kw)
    assert e.value.param == param, e.value.message


# ------------------------------------------------------------------------------ tokenize, detokenize, version
def test_tokenize_detokenize_and_version_have_vllms_shapes(server):
    engine, url = server.scheduler.engine, server.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "w10 w11 w12", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": engine.encode("w10 w11 w12"),
                 "token_strs": ["w10", "w11", "w12"]}
    chat = httpx.post(url + "/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"] == engine.encode(MSG) and chat["count"] == len(chat["tokens"]) and chat["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "w10 w11 w12"}
    assert httpx.get(url + "/version").json() == {"version": version("metasd")}
    for path, body, field, status in (("/tokenize", {"prompt": "w10", "model": "other"}, "model", 404),
                                      ("/tokenize", {"prompt": "w10", "messages": MSG}, "messages", 400),
                                      ("/detokenize", {"tokens": [10, 10**9]}, "tokens", 400),
                                      ("/detokenize", {"tokens": "w10"}, "tokens", 400)):
        bad = httpx.post(url + path, json=body)
        assert bad.status_code == status and bad.json()["error"]["param"] == field, bad.text


# ------------------------------------------------------------------------------ limits
def test_max_model_len_caps_the_context_served(client, server):
    assert client.models.list().data[0].model_extra["max_model_len"] == 64
    with pytest.raises(openai.BadRequestError) as e:  # the tiny model's own context is 256
        client.completions.create(model=MODEL, prompt=[10] * 60, max_tokens=8)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(ValueError, match="--max-model-len 300 exceeds the context of m"):
        create_app(server.scheduler, "m", max_model_len=300)


# ------------------------------------------------------------------------------ metrics and logs
def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_count_http_statuses_per_route_and_the_process(client, server, caplog):
    def count(handler, status, method="POST"):
        key = f'http_requests_total{{handler="{handler}",method="{method}",status="{status}"}}'
        return _samples(httpx.get(server.url + "/metrics").text).get(key, 0)

    before = (count("/v1/chat/completions", "2xx"), count("/v1/chat/completions", "4xx"), count("none", "4xx", "GET"))
    with caplog.at_level(logging.INFO, logger="metasd.serve.access"):
        _chat(client)
        with pytest.raises(openai.BadRequestError):
            _chat(client, n=99)
        assert httpx.get(server.url + "/no/such/path").status_code == 404
    after = (count("/v1/chat/completions", "2xx"), count("/v1/chat/completions", "4xx"), count("none", "4xx", "GET"))
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1]
    samples = _samples(httpx.get(server.url + "/metrics").text)
    assert samples["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in samples
    assert 0 <= samples[f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}}'] <= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "metasd.serve.access"]
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in x for x in lines), lines
    assert any('"POST /v1/chat/completions HTTP/1.1" 400' in x for x in lines), lines
    assert any('"GET /no/such/path HTTP/1.1" 404' in x for x in lines), lines


def test_the_access_log_can_be_turned_off(caplog):
    scheduler = Scheduler(tiny_engine(), max_batch=1)
    getattr(scheduler, "start", lambda: None)()
    try:
        with ServerThread(create_app(scheduler, MODEL, access_log=False)) as srv, \
                caplog.at_level(logging.INFO, logger="metasd.serve.access"):
            assert httpx.get(srv.url + "/health").status_code == 200
        assert not [r for r in caplog.records if r.name == "metasd.serve.access"]
    finally:
        scheduler.close()


def test_the_stats_line_sums_up_each_interval_and_is_silent_when_idle(client, server):
    now = [0.0]
    stats = StatsLogger(server.server.state.metrics, server.scheduler, interval=10, clock=lambda: now[0])
    assert stats.line() is None  # nothing happened
    answer = _chat(client, max_tokens=8)
    record, tokens = answer.model_extra["metasd"], answer.usage.completion_tokens
    for _ in range(300):  # the listener may count the last step just after the answer is out
        totals = stats._totals()
        if totals["finished"] == stats._last["finished"] + 1 and \
                totals["vllm:spec_decode_num_drafts"] == stats._last["vllm:spec_decode_num_drafts"] + record["steps"]:
            break
        time.sleep(0.02)
    now[0] = 2.0
    line = stats.line()
    assert line.startswith(f"prompt {answer.usage.prompt_tokens / 2:.1f} tokens/s, generation {tokens / 2:.1f} "
                           f"tokens/s, running 0, waiting 0, KV "), line
    assert f"drafts accepted {100 * record['accepted'] / record['drafted']:.1f}% ({record['accepted']} of " \
           f"{record['drafted']} tokens), mean acceptance length {1 + record['accepted'] / record['steps']:.2f}" in line
    now[0] = 4.0
    assert stats.line() is None  # an idle interval again
