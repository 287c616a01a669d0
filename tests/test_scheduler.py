"""The scheduler (metasd/core/batching/scheduler.py): requests served concurrently - one batched verifier forward per
step - give what ``Engine.generate`` gives, token for token; events, cancellation, failures and the queue behave as
documented. Tiny fp32 models (tests/tiny.py)."""
import asyncio
import threading
import time

import pytest
import torch

from metasd.core.execution.batch_cache import BatchCache
from metasd.core.decoding.drafter import Drafter
from metasd.core.engine import Engine, EngineBusyError
from metasd.core.batching.scheduler import (QueueFullError, RequestFinished, RequestOptions, Scheduler,
                                            SchedulerClosedError, SchedulerStep)
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from metasd.drafters import FusedDrafter, NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from sampling_check import sampled_pairs_pvalue
from tiny import tiny_qwen, tiny_tokenizer

# different lengths (a one-token prompt: nothing to prefill), repetitions for the lookup drafters
PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0],
           [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41, 7, 7, 7, 12, 13, 21, 22], [0, 50, 9]]
MAX_NEW = [20, 9, 31, 14]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _engine(model, tok, drafters=None, **kw):
    return Engine(Verifier(model, tok), drafters, check_tokenizers=False, **kw)


def _chain():
    return PretrainedDrafter(tiny_qwen(seed=0, logit_scale=2.0), k=4, name="chain")  # softer: some drafts rejected


def _tree():
    return PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0), nodes=8, depth=3, width=2, name="tree")


def _cascade():  # configs/default.yaml's pool on tiny models: suffix first, the model tree where the match is short
    return FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"),
                         PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0), mode="dynamic", nodes=12, depth=6,
                                               width=3, min_path_prob=0.3, name="model")],
                        enough=6, name="cascade")


POOLS = {"none": lambda: None, "chain": _chain, "tree": _tree, "suffix": lambda: SuffixDrafter(),
         "ngram": lambda: NGramDrafter(k=4, n_max=2), "cascade": _cascade}


def _serve(engine, prompts=PROMPTS, max_new=MAX_NEW, **submit):
    with Scheduler(engine, max_batch=4) as s:
        handles = [s.submit(p, n, **submit) for p, n in zip(prompts, max_new)]
        return [h.result(timeout=120) for h in handles]


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_greedy_outputs_equal_engine_generate(verifier_model, tok, pool):
    engine = _engine(verifier_model, tok, POOLS[pool]())
    expected = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    got = _serve(engine)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.stats.tokens_per_step for r in got] == [r.stats.tokens_per_step for r in expected]  # the same drafts
    if pool != "none":
        assert sum(r.stats.drafted for r in got) > 0 and sum(r.stats.accepted for r in got) > 0, "nothing was checked"


def test_requests_join_while_others_run_and_long_prompts_prefill_in_chunks(verifier_model, tok):
    engine = _engine(verifier_model, tok, _tree())
    max_new = [80] + MAX_NEW[1:]  # the first request runs while the others join
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, max_new)]
    steps, decoding, joined = [], threading.Event(), threading.Event()

    def listen(r):  # on the scheduler thread: after the first request's first step, wait for the others to be queued
        if isinstance(r, SchedulerStep):
            steps.append(r)
            if r.batch_size and not decoding.is_set():
                decoding.set()
                joined.wait(60)

    with Scheduler(engine, max_batch=3, prefill_chunk=4) as s:  # PROMPTS[2] takes 5 steps to prefill
        s.add_listener(listen)
        first = s.submit(PROMPTS[0], max_new[0])
        try:
            assert decoding.wait(60)  # the first request is decoding: the others join it
            handles = [first] + [s.submit(p, n) for p, n in zip(PROMPTS[1:], max_new[1:])]
        finally:
            joined.set()
        got = [h.result(timeout=60).token_ids for h in handles]
    assert got == expected
    sizes = [st.batch_size for st in steps if st.batch_size]
    assert sizes[0] == 1 and 2 <= max(sizes) <= 3, sizes  # joined a running batch, and max_batch held
    assert sum(st.prefill_tokens for st in steps) == sum(len(p) for p in PROMPTS)  # whole: the first token with it
    assert max(st.prefill_tokens for st in steps) <= 4


def test_requests_leave_early_on_stop_strings_eos_and_cancel(tok):
    plain = tiny_qwen(seed=0, logit_scale=4.0)
    full = _engine(plain, tok, _chain()).generate(PROMPTS[0], 20)
    eos_token = full.token_ids[6]
    engine = _engine(tiny_qwen(seed=0, logit_scale=4.0, eos=eos_token), tok, _chain())
    stop = tok.decode(engine.generate(PROMPTS[2], 25).token_ids[5:7])
    cases = [dict(prompt=PROMPTS[0], max_new_tokens=20),  # ends on EOS
             dict(prompt=PROMPTS[2], max_new_tokens=25, stop=[stop, "w63 w63"]),
             dict(prompt=PROMPTS[3], max_new_tokens=30)]
    expected = [engine.generate(c.pop("prompt"), c.pop("max_new_tokens"), **c) for c in [dict(c) for c in cases]]
    with Scheduler(engine, max_batch=4) as s:
        def cancel_long(r):  # on the scheduler thread: after the step that gave "long" its first tokens
            if isinstance(r, SchedulerStep) and any(q.id == "long" for q in r.requests):
                long.cancel()

        with s._lock:  # queued and listened to before the first step
            handles = [s.submit(**c) for c in cases]
            long = s.submit(PROMPTS[2], 60, request_id="long")
            s.add_listener(cancel_long)
        results = [h.result(timeout=60) for h in handles]
        events = list(long.events(timeout=60))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    assert [r.stats.stop_reason for r in results] == [r.stats.stop_reason for r in expected]
    assert expected[0].stats.stop_reason == "eos" and expected[0].token_ids[-1] == eos_token
    assert expected[1].stats.stop_reason == "stop" and stop not in expected[1].text
    assert events[-1].finish_reason == "cancelled" and events[-1].result.stats.stop_reason == "cancelled"
    assert 0 < len(events[-1].result.token_ids) < 60


def test_stop_strings_never_reach_the_event_text(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
    full = engine.generate(PROMPTS[2], 25)
    stop = tok.decode(full.token_ids[10:12])
    expected = engine.generate(PROMPTS[2], 25, stop=stop)
    with Scheduler(engine) as s:
        events = list(s.submit(PROMPTS[2], 25, stop=stop).events(timeout=60))
    streamed = ""
    for e in events:
        streamed += e.text
        assert stop not in streamed
    assert streamed == expected.text and events[-1].finish_reason == "stop"


def test_a_seeded_sampled_request_gives_the_same_tokens_whatever_runs_beside_it(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
    alone = engine.generate(PROMPTS[0], 24, temperature=1.0, seed=7).token_ids
    with Scheduler(engine, max_batch=4) as s:
        others = [s.submit(PROMPTS[2], 30, temperature=0.8, seed=1), s.submit(PROMPTS[3], 10)]
        mine = s.submit(PROMPTS[0], 24, temperature=1.0, seed=7)
        others.append(s.submit(PROMPTS[1], 12, temperature=1.0, top_k=5))
        assert mine.result(timeout=60).token_ids == alone
        [h.result(timeout=60) for h in others]
    with Scheduler(engine, max_batch=4) as s:
        assert s.submit(PROMPTS[0], 24, temperature=1.0, seed=7).result(timeout=60).token_ids == alone


def test_sampling_through_the_batched_path_follows_the_verifiers_distribution(tok):
    sharp = 20.0  # as tests/test_conformance.py: ~300 pairs carry 90% of the two-token mass
    engine = _engine(tiny_qwen(seed=0, logit_scale=sharp), tok,
                     PretrainedDrafter(tiny_qwen(seed=0, logit_scale=sharp / 3), k=3))

    def generate(prompt, seeds):
        with Scheduler(engine, max_batch=8, max_queue=len(seeds)) as s:
            handles = [s.submit(prompt, 3, temperature=1.0, seed=seed) for seed in seeds]  # the 2nd token drafted
            return [h.result(timeout=120) for h in handles]

    pvalue, accepted, drafted = sampled_pairs_pvalue(engine, [0, 7, 12, 9, 33, 7, 12], 400, generate)
    assert pvalue > 1e-3, f"sampled pairs do not follow the verifier (p = {pvalue:.2g})"
    assert drafted > 0 and accepted > 0


class FailingDrafter(Drafter):
    """Drafts the token after the pending one's id; raises inside propose for a request whose prompt has token 60."""

    kind = "failing_test"

    def propose(self, ctx):
        if 60 in ctx.tokens[: ctx.prompt_len].tolist() and ctx.step >= 2:
            raise RuntimeError("drafter broke")
        return Draft.chain([(int(ctx.tokens[-1]) + 1) % 64][: ctx.max_depth])


def test_a_drafter_failing_inside_propose_fails_only_its_request(verifier_model, tok):
    engine = _engine(verifier_model, tok, FailingDrafter())
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    finished = []
    with Scheduler(engine, max_batch=5) as s:
        s.add_listener(lambda r: finished.append(r) if isinstance(r, RequestFinished) else None)
        handles = [s.submit(p, n) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]
        bad = s.submit([0, 60, 61], 20)
        handles += [s.submit(p, n) for p, n in zip(PROMPTS[2:], MAX_NEW[2:])]
        last = list(bad.events(timeout=60))[-1]
        got = [h.result(timeout=60).token_ids for h in handles]
        with pytest.raises(RuntimeError, match="drafter broke"):
            bad.result()
    assert got == expected
    assert last.finish_reason == "error" and isinstance(last.error, RuntimeError) and last.result is None
    assert sorted(r.finish_reason for r in finished) == ["error"] + ["length"] * 4


def test_cancel_frees_the_slot_within_one_step(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
    expected = engine.generate(PROMPTS[3], 5).token_ids
    steps, cancelled_at = [], []
    with Scheduler(engine, max_batch=1) as s:
        def listen(r):  # on the scheduler thread, between steps: cancel after the first's third step
            if isinstance(r, SchedulerStep):
                steps.append([q.id for q in r.requests])
                if len(steps) == 3:
                    first.cancel()
                    cancelled_at.append(len(steps))

        with s._lock:  # both queued and listened to before the first step
            first = s.submit(PROMPTS[0], 100)
            second = s.submit(PROMPTS[3], 5)
            s.add_listener(listen)
        assert second.result(timeout=60).token_ids == expected
    assert first.result().stats.stop_reason == "cancelled"
    assert cancelled_at == [3] and all(ids == [first.id] for ids in steps[:3])
    assert all(ids == [second.id] for ids in steps[3:]), "the cancelled request took another step"


def test_a_full_queue_refuses_without_starting_anything(verifier_model, tok):
    engine = _engine(verifier_model, tok)
    gate, in_step = threading.Event(), threading.Event()
    started = []

    def hold(r):  # the first step waits at the gate, so nothing else moves meanwhile
        if isinstance(r, SchedulerStep):
            started.extend(q.id for q in r.requests)
            in_step.set()
            gate.wait(30)

    with Scheduler(engine, max_batch=1, max_queue=2) as s:
        s.add_listener(hold)
        running = s.submit(PROMPTS[0], 3)
        assert in_step.wait(30)
        queued = [s.submit(PROMPTS[1], 3), s.submit(PROMPTS[3], 3)]
        with pytest.raises(QueueFullError):
            s.submit(PROMPTS[2], 3, request_id="refused")
        assert s.queue_length == 2 and s.running == 1
        gate.set()
        [h.result(timeout=60) for h in [running, *queued]]
    assert "refused" not in started and set(started) == {running.id, *(h.id for h in queued)}


def test_a_burst_at_an_idle_scheduler_fills_its_batch_before_its_queue(verifier_model, tok):
    # max_batch + max_queue requests arriving before the scheduler thread admits any (a Ray Serve router sends a
    # replica that many at once) are all taken: those the next step admits into free slots are not "waiting"
    engine = _engine(verifier_model, tok)
    with Scheduler(engine, max_batch=2, max_queue=1) as s:
        with s._lock:  # the scheduler thread admits nothing meanwhile
            handles = [s.submit(PROMPTS[i], 3) for i in range(3)]
            with pytest.raises(QueueFullError):
                s.submit(PROMPTS[3], 3)
        assert [len(h.result(timeout=60).token_ids) for h in handles] == [3, 3, 3]


def test_each_step_is_one_verifier_forward_for_the_whole_batch(verifier_model, tok):
    engine = _engine(verifier_model, tok, _tree())
    forwards = []
    handle = verifier_model.register_forward_pre_hook(
        lambda m, args, kwargs: forwards.append(isinstance(kwargs.get("cache"), BatchCache)), with_kwargs=True)
    steps = []
    try:
        with Scheduler(engine, max_batch=4) as s:
            s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)
            with s._lock:  # all queued before the first step: steps of several requests are sure to come
                handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
            results = [h.result(timeout=60) for h in handles]
    finally:
        handle.remove()
    batched = sum(forwards)
    assert batched == len([st for st in steps if st.batch_size])
    assert sum(st.batch_size for st in steps) == sum(r.stats.steps for r in results) > batched  # B > 1 per forward
    assert sum(st.forward_tokens for st in steps) >= sum(r.stats.steps + r.stats.drafted for r in results)


def test_events_stream_tokens_and_text(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
    expected = engine.generate(PROMPTS[0], 20)
    with Scheduler(engine) as s:
        events = list(s.submit(PROMPTS[0], 20).events(timeout=60))
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert all(not e.finished for e in events[:-1])
    assert sum((e.token_ids for e in events), []) == expected.token_ids
    assert "".join(e.text for e in events) == expected.text
    assert events[-1].result.token_ids == expected.token_ids


def test_aevents_from_an_asyncio_loop_in_another_thread(verifier_model, tok):
    engine = _engine(verifier_model, tok)
    expected = engine.generate(PROMPTS[3], 9).token_ids

    async def consume(handle):
        return [e async for e in handle.aevents()]

    with Scheduler(engine) as s:
        events = asyncio.run(consume(s.submit(PROMPTS[3], 9)))
    assert sum((e.token_ids for e in events), []) == expected and events[-1].finished


def test_bad_requests_fail_at_submit_naming_the_field(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
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


def test_options_pick_a_drafter_bound_the_draft_or_turn_drafting_off(verifier_model, tok):
    engine = _engine(verifier_model, tok, [_chain(), _tree()], policy=_FirstArm(2))
    expected = engine.generate(PROMPTS[2], 30).token_ids
    with Scheduler(engine) as s:
        tree = s.submit(PROMPTS[2], 30, options=RequestOptions(drafter="tree", draft_budget=3)).result(timeout=60)
        plain = s.submit(PROMPTS[2], 30, options=RequestOptions(speculate=False)).result(timeout=60)
    assert tree.token_ids == plain.token_ids == expected
    assert set(tree.stats.drafter_per_step) == {"tree"} and tree.stats.drafted <= 3 * tree.stats.steps
    assert tree.stats.accepted > 0 and plain.stats.drafted == 0 and plain.stats.steps == 29  # + the prefill's token


def test_the_scheduler_holds_the_engine_and_refuses_after_shutdown(verifier_model, tok):
    engine = _engine(verifier_model, tok)
    s = Scheduler(engine)
    with pytest.raises(EngineBusyError):
        engine.generate(PROMPTS[0], 2)
    s.shutdown()
    with pytest.raises(SchedulerClosedError):
        s.submit(PROMPTS[0], 4)
    assert engine.generate(PROMPTS[0], 2).token_ids  # released


def test_generate_batch_and_listeners(verifier_model, tok):
    engine = _engine(verifier_model, tok, _chain())
    expected = [engine.generate(p, n) for p, n in zip(PROMPTS, [12] * 4)]
    got = engine.generate_batch(PROMPTS, max_new_tokens=12, max_batch=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    records = []
    with Scheduler(engine) as s:
        s.add_listener(records.append)
        result = s.submit(PROMPTS[0], 20, request_id="a").result(timeout=60)
    steps = [r for r in records if isinstance(r, SchedulerStep)]
    done = [r for r in records if isinstance(r, RequestFinished)]
    assert [q.accepted + 1 for st in steps for q in st.requests] == result.stats.tokens_per_step
    assert [q.drafter for st in steps for q in st.requests] == result.stats.drafter_per_step
    per_position = [sum(q.accepted_per_position[i] for st in steps for q in st.requests if len(q.accepted_per_position) > i)
                    for i in range(len(result.stats.position_accepted))]
    assert per_position == result.stats.position_accepted
    assert len(done) == 1 and done[0].id == "a" and done[0].output_tokens == 20 and done[0].finish_reason == "length"
    assert done[0].record["steps"] == result.stats.steps and 0 < done[0].ttft_s <= done[0].e2e_s


class _FirstArm:
    """A policy stand-in that always picks arm 0."""

    def __init__(self, n):
        self.n_arms, self.name, self.contextual = n, "first", False

    def reset(self):
        pass

    def select(self, context=None):
        return 0

    def observe(self, arm, rewards, context=None):
        pass

    def update(self, arm, reward, context=None):
        pass

    def state_dict(self):
        return {}


@pytest.mark.parametrize("share", [False, True])
def test_the_suffix_cross_request_cache_is_shared_only_when_asked(verifier_model, tok, share):
    engine = _engine(verifier_model, tok, SuffixDrafter(cross_request=True, name="suffix"))
    prompt = [0, 30, 31, 32, 33]
    with Scheduler(engine, share_suffix_cache=share) as s:
        first = s.submit(prompt, 30).result(timeout=60)
        again = s.submit(prompt, 30).result(timeout=60)  # the same text again: the cache knows its continuation
    assert again.token_ids == first.token_ids
    from_cache = again.stats.drafter_counts.get("suffix", {}).get("from_cache", 0)
    assert (from_cache > 0) == share
    assert engine.drafters[0].cache is not None  # the pool's own drafter keeps its cache


def test_a_broken_step_fails_its_requests_and_the_scheduler_goes_on(verifier_model, tok):
    # if the batch itself breaks (here its commit) and freeing the rows breaks too, every request of the step ends
    # with an error at once - a client must never wait forever - and the scheduler thread lives on: once the fault
    # is gone, the next request is served (it once died here, taking every later request with it)
    engine = _engine(verifier_model, tok, _chain())
    expected = engine.generate(PROMPTS[0], 6).token_ids
    with Scheduler(engine, max_batch=4) as s:
        commit, remove = s.verifier.commit, s.verifier.remove

        def broken(*a, **k):
            raise RuntimeError("broken cache")
        s.verifier.commit = broken
        s.verifier.remove = broken
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        for h in handles:
            with pytest.raises(RuntimeError, match="broken cache"):
                h.result(timeout=60)
        assert s.failure is None and s.failed_steps >= 1
        deadline = time.monotonic() + 30  # the rows are freed after the requests hear of their failure
        while s.verifier.cache.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.verifier.cache.active == 0
        s.verifier.commit, s.verifier.remove = commit, remove
        assert s.submit(PROMPTS[0], 6).result(timeout=60).token_ids == expected
        assert s.failed_steps == 0 and s.health() == (True, "ok")
        assert not s.verifier.cache.reserved  # every reservation returned
