"""The scheduler (metasd/core/scheduler.py): requests served concurrently give what ``Engine.generate`` gives, token for
token; events, cancellation, failures and the queue behave as documented."""
import asyncio
import threading

import pytest
import torch

from metasd.core.engine import Engine
from metasd.core.scheduler import (QueueFullError, RequestFinished, RequestOptions, Scheduler, SchedulerClosedError,
                                   SchedulerStep)
from metasd.core.verifier import Verifier
from metasd.drafters import NGramDrafter, PretrainedDrafter
from tiny import tiny_qwen, tiny_tokenizer

PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0, 3, 8], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41, 7, 7, 7, 12, 13],
           [0, 50]]
MAX_NEW = [20, 9, 31, 14]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _engine(verifier_model, tok, drafters=None, **kw):
    return Engine(Verifier(verifier_model, tok), drafters, check_tokenizers=False, **kw)


def _chain(engine_model):
    return PretrainedDrafter(tiny_qwen(seed=0, logit_scale=2.0), k=4, name="chain")


def test_results_equal_engine_generate(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain(verifier_model))
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    with Scheduler(engine, max_batch=4) as s:
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        got = [h.result(timeout=60).token_ids for h in handles]
    assert got == expected


def test_events_stream_tokens_and_text(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain(verifier_model))
    expected = engine.generate(PROMPTS[0], 20)
    with Scheduler(engine) as s:
        h = s.submit(PROMPTS[0], 20)
        events = list(h.events(timeout=60))
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert all(not e.finished for e in events[:-1])
    assert sum((e.token_ids for e in events), []) == expected.token_ids
    assert "".join(e.text for e in events) == expected.text
    assert events[-1].result.token_ids == expected.token_ids


def test_aevents_from_an_asyncio_loop(verifier_model, tok):
    engine = _engine(verifier_model, tok)
    expected = engine.generate(PROMPTS[1], 9).token_ids

    async def consume(handle):
        return [e async for e in handle.aevents()]

    with Scheduler(engine) as s:
        h = s.submit(PROMPTS[1], 9)
        events = asyncio.run(consume(h))
    assert sum((e.token_ids for e in events), []) == expected and events[-1].finished


def test_bad_requests_fail_at_submit_naming_the_field(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain(verifier_model))
    with Scheduler(engine) as s:
        for kwargs, field in [(dict(prompt=[], max_new_tokens=4), "prompt"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=0), "max_new_tokens"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=400), "context"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, temperature=-1), "temperature"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, top_p=0), "top_p"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, top_k=-2), "top_k"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, seed=-1), "seed"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, stop=[""]), "stop"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, options=RequestOptions(drafter="nope")), "drafter"),
                              (dict(prompt=PROMPTS[0], max_new_tokens=4, options=RequestOptions(draft_budget=-1)),
                               "draft_budget")]:
            with pytest.raises(ValueError, match=field):
                s.submit(**kwargs)
        assert s.queue_length == 0 and s.running == 0


def test_submit_after_shutdown_is_refused(verifier_model, tok):
    s = Scheduler(_engine(verifier_model, tok))
    s.shutdown()
    with pytest.raises(SchedulerClosedError):
        s.submit(PROMPTS[0], 4)


def test_listeners_get_steps_and_finished_requests(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain(verifier_model))
    records = []
    with Scheduler(engine) as s:
        s.add_listener(records.append)
        result = s.submit(PROMPTS[0], 20, request_id="a").result(timeout=60)
    steps = [r for r in records if isinstance(r, SchedulerStep)]
    done = [r for r in records if isinstance(r, RequestFinished)]
    assert len(steps) == result.stats.steps
    assert sum(r.committed for st in steps for r in st.requests) == 20
    assert [r.accepted for st in steps for r in st.requests] == [
        n for n in _accepted_per_step(result.stats)]
    assert len(done) == 1 and done[0].id == "a" and done[0].output_tokens == 20
    assert done[0].record["steps"] == result.stats.steps and done[0].ttft_s is not None


def _accepted_per_step(stats):
    return [t - 1 for t in stats.tokens_per_step]
