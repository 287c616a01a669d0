"""Prefix caching over HTTP with the official openai client: the second turn of a chat reuses the first turn's
prompt and answer (``usage.prompt_tokens_details.cached_tokens``, ``vllm:prefix_cache_hits``; its drafter's own
positions too, ``metasd:drafter_prefix_cache_hits``) and answers exactly
what ``Engine.generate`` answers; ``--enable-prefix-caching``'s default follows the pool. Tiny fp32 models."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.cli import SchedulerSettings  # noqa: E402
from serve_helpers import ServerThread, openai_client, tiny_engine  # noqa: E402

MODEL = "tiny"
TURN1 = [{"role": "system", "content": " ".join(f"w{10 + i % 40}" for i in range(60))},
         {"role": "user", "content": "w10 w11 w12 w10 w11"}]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_the_second_turn_of_a_chat_hits_the_prefix_cache_with_identical_output():
    engine = tiny_engine()
    scheduler = Scheduler(engine, max_batch=2, prefix_caching=True)
    with ServerThread(create_app(scheduler, MODEL)) as srv:
        client = openai_client(srv)
        first = client.chat.completions.create(model=MODEL, messages=TURN1, max_tokens=10, temperature=0)
        turn2 = TURN1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "w20 w21"}]
        second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=10, temperature=0)
        streamed = list(client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=10, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        # a request for its prompt's log-probabilities prefills it all and does not consult the cache: no query
        client.completions.create(model=MODEL, prompt="w10 w11 w12 w13", max_tokens=2, temperature=0, echo=True,
                                  logprobs=1)
        hits, queries = _metric(srv.url, "vllm:prefix_cache_hits_total"), _metric(srv.url, "vllm:prefix_cache_queries_total")
        drafter_hits = _metric(srv.url, "metasd:drafter_prefix_cache_hits_total")
    scheduler.close()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(engine.encode(TURN1)), cached  # at least the whole first prompt was reused
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= cached  # the same history, reused once more
    expected = engine.generate(turn2, 10)
    assert second.choices[0].message.content == expected.text
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text
    assert hits == cached + streamed[-1].usage.prompt_tokens_details.cached_tokens
    assert queries == first.usage.prompt_tokens + 2 * second.usage.prompt_tokens
    # the drafter started the later turns from its own positions of the history too
    assert drafter_hits == scheduler.prefix_cache.stats.drafter_hits >= len(engine.encode(TURN1))


def test_prefix_caching_default_follows_the_pool():
    engine = tiny_engine()
    for setting, on in ((None, True), (False, False), (True, True)):
        scheduler = SchedulerSettings(max_batch=1, prefix_caching=setting).make(engine)
        try:
            assert (scheduler.prefix_cache is not None) is on
        finally:
            scheduler.close()
