"""The prefix cache keeps the model drafters' own keys and values beside the verifier's (``PrefixEntry.drafters``): a
request that continues an earlier one (the next turn of a chat) starts its drafters there, so their first catch-up
reads only what follows - with the very drafts (and output) a drafter that read everything again would make. Tiny fp32
models (tests/tiny.py)."""
import logging

import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution.prefix_cache import KVPrefix
from metasd.core.execution.verifier import Verifier
from metasd.drafters import FusedDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from test_prefix_cache import HISTORY, model, tok  # noqa: F401 (the same chat history and models)
from tiny import tiny_qwen


def _pool(kind: str, fixed: bool = False):
    """(the engine's arm, the drafter model) for a pool of ``kind``; ``fixed``: the forks' caches are rows of one set
    of buffers (``DraftRows``, the path a GPU captures). The drafter is the verifier's twin: its drafts are accepted
    whole where its cache is right, so a wrong resumed position shows in the steps."""
    small = tiny_qwen(seed=0, logit_scale=4.0)
    graphs = "fixed" if fixed else "off"
    if kind == "chain":
        return PretrainedDrafter(small, k=3, name="chain", graphs=graphs), small
    tree = PretrainedTreeDrafter(small, nodes=8, depth=3, width=2, name="tree", graphs=graphs)
    if kind == "tree":
        return tree, small
    return FusedDrafter([SuffixDrafter(name="suffix"), tree], enough=4, name="cascade"), small


def _chat(engine, small, keep_drafters: bool, turns: int = 4, new: int = 12):
    """A chat of ``turns`` turns on a scheduler with prefix caching (its drafters' positions kept or not): per turn the
    result, the tokens the drafter model read, and the drafter positions the turn started with."""
    fed = [0]

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed[0] += ids.shape[-1]

    hook = small.register_forward_pre_hook(count, with_kwargs=True)
    out = []
    try:
        with Scheduler(engine, prefix_caching=True) as s:
            s.prefix_cache.drafters = keep_drafters
            prompt = list(HISTORY)
            for t in range(turns):
                fed[0], hits = 0, s.prefix_cache.stats.drafter_hits
                result = s.submit(prompt, new).result(timeout=120)
                out.append((result, fed[0], s.prefix_cache.stats.drafter_hits - hits))
                prompt = prompt + result.token_ids + [50 + t, 51, 52]
    finally:
        hook.remove()
    return out


@pytest.mark.parametrize("kind", ["chain", "tree", "cascade"])
def test_drafters_resume_from_the_stored_prefix_with_the_same_drafts(model, tok, kind):
    arm, small = _pool(kind)
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)
    on, off = _chat(engine, small, True), _chat(engine, small, False)
    for t, ((r_on, fed_on, resumed), (r_off, fed_off, none)) in enumerate(zip(on, off)):
        assert r_on.token_ids == r_off.token_ids == engine.generate(r_on.prompt_ids, 12).token_ids
        # the drafter started with what it had read of the last turn: the same drafts, step for step
        assert r_on.stats.tokens_per_step == r_off.stats.tokens_per_step
        assert r_on.stats.drafted == r_off.stats.drafted
        assert none == 0
        if t == 0:
            assert resumed == 0 and fed_on == fed_off
        else:  # it read only what follows those positions
            assert resumed >= len(on[t - 1][0].prompt_ids), (t, resumed)
            assert fed_on == fed_off - resumed, (t, fed_on, fed_off, resumed)


def test_rows_of_one_set_of_buffers_resume_too(model, tok):
    """The scheduler's fixed-shape path: a fork's cache is a row of the drafter's ``DraftRows``."""
    arm, small = _pool("tree", fixed=True)
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)
    on, off = _chat(engine, small, True, turns=3), _chat(engine, small, False, turns=3)
    assert [r.token_ids for r, _, _ in on] == [r.token_ids for r, _, _ in off]
    assert [r.stats.tokens_per_step for r, _, _ in on] == [r.stats.tokens_per_step for r, _, _ in off]
    assert all(resumed > len(HISTORY) for _, _, resumed in on[1:])
    assert sum(f for _, f, _ in on) < sum(f for _, f, _ in off)
    rows = arm.rows
    assert not rows.held, "every row given back at the end of its request"


def test_an_entry_counts_its_drafters_bytes_and_the_budget_holds_them(model, tok):
    arm, small = _pool("tree")
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)
    with Scheduler(engine, prefix_caching=True, kv_budget=1024) as s:
        s.submit(list(HISTORY) * 3, 8).result(timeout=120)
        (entry,) = s.prefix_cache.entries
        kept = entry.drafters["tree"]
        own = sum(t.numel() * t.element_size() for t in (*entry.keys, *entry.values))
        assert kept.length >= len(HISTORY) * 3 - 1 and entry.nbytes == own + kept.nbytes > own
        assert s.verifier.cache.pinned_bytes == entry.nbytes
        # an entry whose drafter positions would not fit beside the reservations is not stored
        cache = s.prefix_cache
        cache.clear()
        huge = KVPrefix(torch.zeros(16, dtype=torch.long), [torch.zeros(1, 16, 1 << 20)], [torch.zeros(1, 16, 1 << 20)])
        assert not cache.store(list(entry.ids[:20]), 0, {"tree": huge}) and not cache.entries


def test_a_drafter_that_cannot_resume_reads_its_prompt_and_the_request_goes_on(model, tok, monkeypatch, caplog):
    arm, small = _pool("tree")
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)

    def fail(self, prefix, length):
        raise RuntimeError("resume failed on purpose")

    expected = _chat(engine, small, False, turns=2)
    monkeypatch.setattr(PretrainedTreeDrafter, "resume", fail)
    with caplog.at_level(logging.ERROR, logger="metasd.core.batching.scheduler"):
        got = _chat(engine, small, True, turns=2)
    assert [r.token_ids for r, _, _ in got] == [r.token_ids for r, _, _ in expected]
    assert [f for _, f, _ in got] == [f for _, f, _ in expected]  # it read everything, as without kept positions
    assert "drafter tree could not start from the stored prefix" in caplog.text


def test_lookups_and_translating_drafters_keep_no_positions(model, tok):
    suffix = SuffixDrafter(name="suffix")
    assert suffix.kv_prefix(HISTORY) is None
    with pytest.raises(NotImplementedError, match="suffix"):
        suffix.resume(KVPrefix(torch.tensor(HISTORY), [], []), 4)


def test_a_resumed_cache_gives_the_logits_of_reading_everything():
    small = tiny_qwen(seed=0, logit_scale=2.0)
    reader, resumed, fresh = (PretrainedDrafter(small, k=3, name="d", graphs="off") for _ in range(3))
    reader.begin(None)
    reader.sync(HISTORY)
    kept = reader.kv_prefix(HISTORY[:15] + [63])  # the positions that hold a prefix of these tokens
    assert kept.length == 15 and kept.ids.tolist() == HISTORY[:15]
    resumed.resume(kept, 12)
    resumed.begin(None)  # keeps what it resumed
    longer = HISTORY + [3, 4]
    fresh.begin(None)
    torch.testing.assert_close(resumed.sync(longer), fresh.sync(longer), rtol=0, atol=1e-5)
    assert resumed.last_catch_up == len(longer) - 12 - 1 and fresh.last_catch_up == len(longer) - 1


@pytest.mark.parametrize("fixed", [False, True])
def test_a_request_cancelled_in_its_prefill_gives_back_what_its_drafters_resumed(model, tok, monkeypatch, fixed):
    import metasd.core.batching.jobs as jobs

    arm, small = _pool("tree", fixed)
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)
    resume = jobs.resume_drafters

    def resume_then_cancel(job, entry, prefix_cache):
        resume(job, entry, prefix_cache)
        assert job.resumed
        job.handle.cancel()  # it leaves before its prefill (one token a step) is done

    with Scheduler(engine, prefix_caching=True, prefill_chunk=1) as s:
        first = s.submit(list(HISTORY), 12).result(timeout=120)
        second = first.prompt_ids + first.token_ids + [50, 51, 52]
        monkeypatch.setattr(jobs, "resume_drafters", resume_then_cancel)
        events = list(s.submit(second, 12).events(timeout=120))
        monkeypatch.setattr(jobs, "resume_drafters", resume)
        assert events[-1].finish_reason == "cancelled"
        if fixed:
            assert not arm.rows.held
        again = s.submit(second, 12).result(timeout=120)  # its forks, reused, start from the entry as they should
    reference = _chat(engine, small, False, turns=2)[1][0]
    assert again.token_ids == reference.token_ids
    assert again.stats.tokens_per_step == reference.stats.tokens_per_step


def test_the_allocator_prices_only_the_catch_up_past_the_resumed_positions(model, tok, monkeypatch):
    import metasd.core.batching.jobs as jobs
    from metasd.core.batching.adaptive import AdaptiveSpeculation

    arm, small = _pool("cascade")
    engine = Engine(Verifier(model, tok), arm, check_tokenizers=False)
    resume, seen = jobs.resume_drafters, []

    def watch(job, entry, prefix_cache):
        resume(job, entry, prefix_cache)
        seen.append((job.request, [d.name for d in job.resumed]))

    monkeypatch.setattr(jobs, "resume_drafters", watch)
    adaptive = AdaptiveSpeculation(lambda tokens: 1.0 + tokens / 64, max_width=4)
    with Scheduler(engine, prefix_caching=True, adaptive=adaptive) as s:
        first = s.submit(list(HISTORY), 12).result(timeout=120)
        s.submit(first.prompt_ids + first.token_ids + [50, 51, 52], 12).result(timeout=120)
    ((request, names),) = seen
    assert names == ["tree"]  # the lookup keeps nothing; the tree, the cascade's one model drafter, resumed
    assert request.read_at_start >= len(HISTORY)

    class Joining:  # a request as it stands before its first step
        length, read_at_start = len(request.prompt_ids), request.read_at_start

    assert adaptive.unfed(Joining()) == len(request.prompt_ids) - request.read_at_start > 0
    Joining.read_at_start = 0
    assert adaptive.unfed(Joining()) == len(request.prompt_ids)
