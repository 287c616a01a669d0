"""The fixed-shape drafting loop (metasd/core/execution/draft_loop.py), run eagerly on the CPU over the very buffers,
masks and cache writes a captured CUDA graph replays (``fixed_shapes=True``): every step drafts what the eager
drafting loop drafts, for a chain and for static trees, across a width bucket and across requests on the kept cache;
sampling stays exact through it; what does not fit the loop drafts eagerly; and the settings are refused where they
cannot hold."""
from __future__ import annotations

import pytest
import torch

from metasd.core import Engine, Verifier
from metasd.core import Scheduler
from metasd.core.execution.draft_batch import drive
from metasd.core.execution.draft_loop import DraftLoop, DraftLoops, tree_shape
from metasd.core.execution.kv_cache import cache_kwargs
from metasd.core.execution.static_cache import new_cache
from metasd.drafters import PretrainedDrafter
from metasd.drafters.static_tree import StaticTreeDrafter
from tiny import plain_greedy, tiny_qwen

PROMPT = [5, 17, 3, 59, 42, 8, 23, 61]


@pytest.fixture(scope="module")
def models():
    """A verifier, a drafter that agrees with it often (its own weights, one layer fewer) and one that does not."""
    return (tiny_qwen(seed=3, context=1024), tiny_qwen(seed=3, layers=1, context=1024),
            tiny_qwen(seed=8, layers=1, context=1024))


def recording(drafter):
    """The drafter, its every draft kept (read on the host after the run)."""
    drafts = []
    drafting = drafter.drafting

    def kept(ctx):
        draft = yield from drafting(ctx)
        drafts.append(draft)
        return draft

    drafter.drafting = kept
    return drafter, drafts


MAKERS = {
    "chain": lambda m, fixed: PretrainedDrafter(m, k=4, fixed_shapes=fixed),
    "static": lambda m, fixed: StaticTreeDrafter(m, fixed_shapes=fixed),
    "static_head_vocab": lambda m, fixed: StaticTreeDrafter(m, widths=[3, 2, 1], head_vocab=40, fixed_shapes=fixed),
}


@pytest.mark.parametrize("drafter_index", [1, 2], ids=["agreeing", "other"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_the_loop_drafts_what_the_eager_loop_drafts(models, kind, drafter_index):
    """300 tokens (the attended width passes a 256-column bucket mid-request), then a second request on the kept
    cache: the same drafts step for step as the eager drafting loop, plain greedy's tokens, and every step drafted
    through the fixed-shape catch-up and the loop (one run of each a step, never a level forward of its own)."""
    verifier, drafter_model = models[0], models[drafter_index]
    runs = {}
    for fixed in (False, True):
        drafter, drafts = recording(MAKERS[kind](drafter_model, fixed))
        engine = Engine(Verifier(verifier), drafter, check_tokenizers=False)
        first = engine.generate(PROMPT, max_new_tokens=300).token_ids
        second = engine.generate(PROMPT[::-1], max_new_tokens=40).token_ids
        runs[fixed] = (first, second, [(d.tokens.tolist(), [int(p) for p in d.parents]) for d in drafts], drafter)
    (eager_first, eager_second, eager_drafts, eager), (first, second, drafts, looped) = runs[False], runs[True]
    assert first == eager_first == plain_greedy(verifier, PROMPT, 300)
    assert second == eager_second == plain_greedy(verifier, PROMPT[::-1], 40)
    assert drafts == eager_drafts
    assert eager.loops is None and looped.loops is not None
    (loop,) = looped.loops.loops.values()  # one shape: the tail of a request cuts the whole shape's draft
    assert loop.stats.eager == sum(1 for t, _ in drafts if t) and loop.stats.captured == 0  # the CPU: no capture
    assert set(loop._columns) == {256, 512}, "the request did not cross a width bucket"
    assert loop.cache is looped.loops.cache  # the second request drafted over the first one's buffers
    # every catch-up (each request's prompt included: 8 tokens) ran at a fixed shape over the same buffers
    assert looped.loops.runner.stats.eager == loop.stats.eager and looped.loops.runner.cache is loop.cache
    if drafter_index == 1:
        assert sum(len(d[0]) for d in drafts) > len(drafts), "the agreeing drafter drafted nothing to compare"


@torch.inference_mode()
def test_a_loop_run_equals_the_level_feeds_and_leaves_the_fed_levels_cached(models):
    """DraftLoop.run after a prefilled cache: the eager static tree's tokens, the cache's length at the committed
    length + the nodes fed, and an output the next run does not overwrite."""
    _, drafter_model, _ = models
    widths = [3, 2, 2]
    eager = StaticTreeDrafter(drafter_model, widths=widths)
    eager.begin(None)
    ctx = type("Ctx", (), {"tokens": torch.tensor(PROMPT), "max_depth": 8})()
    eager_draft = drive(eager.make_draft(ctx))
    cache = new_cache(drafter_model)
    logits = drafter_model(input_ids=torch.tensor([PROMPT]), **cache_kwargs(drafter_model, cache), use_cache=True).logits[0, -1]
    loop = DraftLoop(drafter_model, None, cache, widths, capture=False)
    tokens = loop.run(logits)
    parents, levels = tree_shape(widths)
    assert [int(p) for p in eager_draft.parents] == parents and eager_draft.tokens.tolist() == tokens.tolist()
    assert cache.get_seq_length() == len(PROMPT) + levels[-1][0]  # the levels fed: all but the last
    kept = tokens.clone()
    cache.set_length(len(PROMPT))
    loop.run(logits + torch.randn_like(logits))
    assert torch.equal(tokens, kept)


def test_sampling_stays_exact_through_the_loop():
    """A static tree's sample-and-match through the loop (the joint check of tests/test_exact_depth.py); a sampled
    chain is drawn eagerly (a sample is not a top-k), its loop never run."""
    from test_exact_depth import SHARP, V, check_at_depth

    verifier = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP)
    drafter_model = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP / 2)
    tree = StaticTreeDrafter(drafter_model, widths=[2, 2, 1], name="static", fixed_shapes=True)
    check_at_depth(Engine(Verifier(verifier), tree))
    assert next(iter(tree.loops.loops.values())).stats.eager > 0
    chain = PretrainedDrafter(drafter_model, k=3, fixed_shapes=True)
    check_at_depth(Engine(Verifier(verifier), chain))
    assert chain.loops.loops == {}


def test_a_chain_with_a_stop_rule_drafts_eagerly(models):
    _, drafter_model, _ = models
    chain = PretrainedDrafter(drafter_model, k=4, confidence_threshold=0.5, fixed_shapes=True)
    Engine(Verifier(models[0]), chain, check_tokenizers=False).generate(PROMPT, max_new_tokens=12)
    assert chain.loops.loops == {}


def test_scheduler_forks_draft_level_by_level_batched(models):
    """A scheduler's requests draft with forks of the pool's drafter: without loops (their level feeds join the
    batch's forwards), the same tokens as each request alone."""
    verifier, drafter_model, _ = models
    tree = StaticTreeDrafter(drafter_model, widths=[2, 2, 1], fixed_shapes=True)
    assert tree.fork().loops is None and tree.loops is not None
    prompts = [PROMPT, PROMPT[::-1], PROMPT[2:]]
    engine = Engine(Verifier(verifier), tree, check_tokenizers=False)
    with Scheduler(engine, max_batch=4) as s:
        handles = [s.submit(p, 20) for p in prompts]
        got = [h.result(timeout=120).token_ids for h in handles]
    assert got == [plain_greedy(verifier, p, 20) for p in prompts]
    assert tree.loops.loops == {}


def test_settings_are_refused_naming_the_drafter(models):
    _, drafter_model, _ = models
    with pytest.raises(ValueError, match=r"my-tree: graphs='on' needs a CUDA device"):
        StaticTreeDrafter(drafter_model, name="my-tree", graphs="on")
    with pytest.raises(ValueError, match=r"my-chain: graphs='on' needs a CUDA device"):
        PretrainedDrafter(drafter_model, name="my-chain", graphs="on")
    with pytest.raises(ValueError, match=r"graphs"):
        StaticTreeDrafter(drafter_model, name="t", graphs="yes")
    assert PretrainedDrafter(drafter_model).loops is None  # auto on the CPU: eager
    assert StaticTreeDrafter(drafter_model, graphs="off", fixed_shapes=True).loops is not None
    assert StaticTreeDrafter(drafter_model).describe()["graphs"] == "auto"


def test_draft_loops_refuse_a_loop_before_a_cache(models):
    _, drafter_model, _ = models
    loops = DraftLoops(drafter_model, None, capture=False, name="d")
    with pytest.raises(RuntimeError, match="d: a drafting loop before the request's cache"):
        loops.feed([2, 1], torch.zeros(drafter_model.config.vocab_size))


def test_the_gpu_default_cascade_through_the_loop(models):
    """The GPU default's shape (configs/gpu_default.yaml: a suffix + static-tree cascade) with the tree's loop on its
    buffers: plain greedy's tokens, the loop run wherever the tree drafted (the suffix draft alone where it is deep)."""
    from metasd.drafters import FusedDrafter, SuffixDrafter

    verifier, drafter_model, _ = models
    tree = StaticTreeDrafter(drafter_model, name="qwen0.5b", fixed_shapes=True)
    cascade = FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"), tree], enough=6)
    prompt = PROMPT * 3  # something for the suffix drafter to find
    engine = Engine(Verifier(verifier, fixed_shapes=True), cascade, check_tokenizers=False)
    assert engine.generate(prompt, max_new_tokens=60).token_ids == plain_greedy(verifier, prompt, 60)
    assert next(iter(tree.loops.loops.values())).stats.eager > 0
