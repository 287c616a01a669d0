"""Drafting loops driven side by side, as the scheduler's batched drafting does (core/batching/drafting.py), for tests
that compare a drafter's drafts made together with those it makes alone."""
import torch

from metasd.core.execution.draft_batch import feed_groups, run_group

#: four prompts of different lengths (each under LONG_FEED: their first catch-ups share a forward too), their lengths
PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0, 50, 9], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40], [0, 13, 14, 13]]
MAX_NEW = [20, 14, 26, 9]


@torch.inference_mode()  # as the scheduler's draft_together: the loops' own inference-mode blocks end in any order
def drive_together(loops):
    """Drafting loops (``Drafter.drafting``) advanced together: each round's feeds of one network run in one call
    (``feed_groups``, ``run_group``). Returns (each loop's draft, the size of every call made)."""
    drafts, pending, calls = [None] * len(loops), {}, []

    def advance(i, value):
        try:
            pending[i] = loops[i].send(value)
        except StopIteration as done:
            drafts[i] = done.value

    for i in range(len(loops)):
        advance(i, None)
    while pending:
        round_ = sorted(pending.items())
        pending.clear()
        for group in feed_groups([feed for _, feed in round_]):
            calls.append(len(group))
            for g, out in zip(group, run_group([round_[g][1] for g in group])):
                advance(round_[g][0], out)
    return drafts, calls


def schedule_together(engine, prompts, max_new, count):
    """The requests submitted to a ``Scheduler`` before its thread starts any, so that they run side by side.
    ``count()``: a running count (a hook's calls), or a tuple of them, read after every step. Returns (the results, per
    step after the first (its batch size, what ``count`` grew by in it))."""
    from metasd.core.batching.scheduler import Scheduler, SchedulerStep
    per_step = []
    with Scheduler(engine, max_batch=len(prompts)) as s:
        s.add_listener(lambda r: per_step.append((r.batch_size, count())) if isinstance(r, SchedulerStep) else None)
        with s._lock:
            handles = [s.submit(p, n) for p, n in zip(prompts, max_new)]
        results = [h.result(timeout=120) for h in handles]
    def grew(now, before):  # a count, or a tuple of counts
        return tuple(a - b for a, b in zip(now, before)) if isinstance(now, tuple) else now - before
    return results, [(b, grew(n, before)) for (b, n), (_, before) in zip(per_step[1:], per_step)]


def sampled_side_by_side(engine, samples=3000):
    """``joint_check`` of three-token continuations of ``engine`` sampled side by side through a ``Scheduler`` (each
    seed a request, all submitted before its thread starts any): their drafting forwards shared."""
    from metasd.core.batching.scheduler import Scheduler
    from sampling_check import joint_check

    def generate(prompt, seeds):
        with Scheduler(engine, max_batch=16, max_queue=len(seeds)) as s:
            with s._lock:
                # four tokens: the first drawn with the prefill, the step after it drafting two deep
                handles = [s.submit(prompt, 4, temperature=1.0, seed=seed) for seed in seeds]
            return [h.result(timeout=120) for h in handles]

    return joint_check(engine, [3], samples, length=3, generate=generate)
