"""Every registered drafter type (and each variant of tests/test_conformance.py) drafts for several concurrent requests
through the scheduler - each request with its own forks of the pool (``Drafter.fork``), verified in one batched
forward - and gives ``Engine.generate``'s greedy output for each, token for token. Its drafts are those it drafts
alone (up to exact ties of a drafter's logits, which a shared drafter forward may break otherwise): a request's steps
and accepted tokens are the same as ``Engine.generate``'s (forks sharing state would make them re-feed or draft from
another request's text).

"fixed shapes" runs the scheduler's forwards at the shapes a GPU captures: the batched verify forward padded to its
bucket, and every model drafter's forks over one set of rows (``graphs: fixed``; on a GPU, ``--metasd-device cuda``,
``graphs: auto``: captured), its levels one padded forward and a chain's or static tree's loop one run for the batch."""
import pytest

import test_conformance
from metasd.core.batching.scheduler import Scheduler
from metasd.core.execution.draft_rows import draft_rows_of
from metasd.drafters import DRAFTERS
from test_conformance import (CASES, PROMPT, _device, _engine, _load, _pool, entry, kind_of,  # noqa: F401
                              root)  # root, _device: the conformance module's fixtures (its pools on its device)

PROMPTS = [PROMPT, [0, 7, 12, 9, 33, 7, 12], [0, 5, 41, 5, 41, 5, 9, 9, 12, 33, 41]]
MAX_NEW = [24, 17, 30]


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed shapes"])
@pytest.mark.parametrize("case", CASES)
def test_concurrent_greedy_requests_give_engine_generates_output(root, case, fixed):  # noqa: F811
    """``fixed``: the batched verify forward padded to (rows, tokens, width) buckets, its padding written to the
    cache's scratch row (core/execution/batch_runner.py; CUDA graphs replay these shapes on a GPU)."""
    engine = _fixed_engine(root, case) if fixed else _engine(root, case)
    engine.verifier.fixed_shapes = fixed  # what Verifier(graphs="on") sets on CUDA; the scheduler's verifier reads it
    # a fresh engine per expected request: the suffix drafter's cross-request cache, off in the scheduler, stays empty
    expected = [_engine(root, case).generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    with Scheduler(engine, max_batch=3) as s:
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        results = [h.result(timeout=120) for h in handles]
        runner = s.verifier.runner
    assert (runner is not None) == fixed and (not fixed or runner.stats.eager > 0)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected], case
    # model drafters draft in forwards shared with the other requests (batched drafting): their logits may differ
    # from a forward of their own in the last bit, which changes a draft only where two logits tie exactly - the Llama
    # drafter of another tokenizer ties by construction (its ids outside the word map are zero rows: logit 0)
    if "tokenizer: own" not in str(case):
        assert [r.stats.tokens_per_step for r in results] == [r.stats.tokens_per_step for r in expected], case
        assert [r.stats.catch_up_tokens for r in results] == [r.stats.catch_up_tokens for r in expected], case
    assert sum(r.stats.drafted for r in results) > 0, f"{case}: drafted nothing, so the check checked nothing"
    rows = draft_rows_of(engine.all_drafters) if fixed else []
    if rows:
        assert all(not r.held for r in rows) and any(r.runner.stats.eager + r.runner.stats.replays for r in rows)


def _fixed_engine(root, case):  # noqa: F811  (root: the fixture's value)
    """The case's engine with its model drafters at fixed shapes: over rows, run eagerly on a CPU (``fixed``) and
    captured on CUDA (``auto``)."""
    given = entry(case)(root)
    if "graphs" in DRAFTERS[kind_of(case)].Params.model_fields:
        graphs = "fixed" if test_conformance.DEVICE == "cpu" else "auto"
        given = {**given, "params": {**given.get("params", {}), "graphs": graphs}}
    return _load(root, _pool(root, case, given))
