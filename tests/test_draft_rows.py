"""A drafter model's forks drafting over ONE set of rows (metasd/core/execution/draft_rows.py): each request's drafter
cache a row of shared buffers, a drafting level of many requests one forward padded to a (rows, tokens, width) bucket
- the shapes CUDA graphs replay on a GPU, run eagerly on the same buffers here. Every request gets what it gets alone
(greedy identity, sampling exactness at depth 2), one drafter forward per level for the batch, every row given back.
Tiny fp32 models (tests/tiny.py)."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler, SchedulerStep
from metasd.core.decoding.drafter import with_components
from metasd.core.engine import Engine
from metasd.core.execution.draft_batch import Feed, feed_groups, run_feed, run_group
from metasd.core.execution.draft_loop import DraftLoop
from metasd.core.execution.batch_cache import BatchCache
from metasd.core.execution.draft_rows import DraftRows, RowKVCache
from metasd.core.execution.kv_memory import KVGeometry
from metasd.core.execution.kv_cache import crop_to, keep_positions
from metasd.core.execution.static_cache import new_cache
from metasd.core.execution.verifier import Verifier
from metasd.drafters import (FusedDrafter, PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter,
                             SteeredDrafter, SuffixDrafter)
from metasd.drafters.budgeted import budget_arms
from metasd.policies import make_policy
from metasd.core.execution.kv_cache import cache_kwargs
from drafting_helpers import MAX_NEW, PROMPTS, sampled_side_by_side, schedule_together
from tiny import tiny_qwen, tiny_tokenizer


def _feeds(model):
    """Feeds of different lengths and masks (a chain's catch-up, a device token, a tree level) as makers of a cache."""
    tree_mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 1, 0],
                              [1, 1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    return [lambda c: Feed(model, None, c, [11, 12, 13], last_only=True),
            lambda c: Feed(model, None, c, torch.tensor([20])),
            lambda c: Feed(model, None, c, [30, 31, 32, 33], mask=tree_mask, positions=torch.tensor([3, 3, 4, 4]))]


@torch.inference_mode()
def test_a_level_over_the_rows_gives_each_row_its_own_forwards_logits_and_cache():
    model = tiny_qwen(seed=3)
    rows = DraftRows(model, capture=False, name="chain")
    prefixes = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 5]]
    alone, together = [], []
    for prefix in prefixes:
        a, b = new_cache(model), rows.take()
        for cache in (a, b):  # a prompt's catch-up: through the row's own view of the buffers
            model(input_ids=torch.tensor([prefix]), **cache_kwargs(model, cache), use_cache=True)
        alone.append(a)
        together.append(b)
    assert [c.row for c in together] == [0, 1, 2] and rows.rows == 4  # rows grown by doubling
    want = [run_feed(make(c)) for make, c in zip(_feeds(model), alone)]
    feeds = [make(c) for make, c in zip(_feeds(model), together)]
    assert feed_groups(feeds) == [[0, 1, 2]] and rows.runs(feeds)
    got = run_group(feeds)
    assert rows.runner.stats.eager == 1 and rows.runner.shapes.keys() == {(4, 4, 256)}  # 3 rows padded to 4
    for w, g, a, b in zip(want, got, alone, together):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert b.get_seq_length() == a.get_seq_length()
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
    # the tree's accepted path kept by an index copy inside the row, as in a cache of its own
    for cache in (alone[2], together[2]):
        keep_positions(cache, 3, torch.tensor([1, 3]))
    for la, lb in zip(alone[2].layers, together[2].layers):
        torch.testing.assert_close(lb.keys, la.keys)
    # the padding row's keys went to the scratch row: row 3, free, holds nothing
    assert all(layer.keys[3].abs().sum() == 0 for layer in rows.layers)


@torch.inference_mode()
def test_rows_grow_all_or_nothing_keeping_what_they_hold_and_are_given_back():
    model = tiny_qwen(seed=3, context=1024)
    rows = DraftRows(model, capture=False)
    first = rows.take()
    model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(model, first), use_cache=True)
    kept = first.layers[0].keys.clone()
    second = rows.take()  # a second row: the buffers reallocated, the first row's keys copied over
    # the second row: 295 positions
    model(input_ids=torch.tensor([list(range(1, 60)) * 5]), **cache_kwargs(model, second), use_cache=True)
    # a forward past the capacity it did not reserve: twice its need, as a StaticKVCache grows (2 x 295 -> 768)
    assert rows.rows == 2 and rows.capacity == 768 and rows.reallocations == 3
    torch.testing.assert_close(first.layers[0].keys, kept)
    assert isinstance(first, RowKVCache) and first.capacity == second.capacity == 768
    rows.give_back(first)
    again = rows.take()
    assert rows.free == [] and again.row == 0
    del again, second  # two forks dropped without their end (requests that failed as they began): ...
    import gc
    gc.collect()
    assert rows.take().row == 0 and rows.take().row == 1 and rows.rows == 2  # ... their rows taken again, no growth


@torch.inference_mode()
def test_one_loop_over_the_rows_drafts_each_rows_tree_as_its_loop_alone_would():
    # a static tree [2, 2, 1] after three prefixes of different lengths: the whole loop for the three rows at once
    # (rows_loop.py, one run padded to 4 rows) against each row's own DraftLoop over a cache of its own
    model = tiny_qwen(seed=3, context=1024)
    rows = DraftRows(model, capture=False, name="static")
    widths = [2, 2, 1]
    alone, own_caches, caches, roots = [], [], [], []
    for prefix in ([1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 5, 1, 2]):
        own, row = new_cache(model), rows.take()
        root = model(input_ids=torch.tensor([prefix]), **cache_kwargs(model, own), use_cache=True).logits[0, -1]
        model(input_ids=torch.tensor([prefix]), **cache_kwargs(model, row), use_cache=True)
        alone.append(DraftLoop(model, None, own, widths, capture=False).run(root))
        own_caches.append(own)
        caches.append(row)
        roots.append(root)
    feeds = [rows.loop_feed(widths, c, r) for c, r in zip(caches, roots)]
    assert feed_groups(feeds) == [[0, 1, 2]]
    got = run_group(feeds)
    for g, want, own, row in zip(got, alone, own_caches, caches):
        assert g.tolist() == want.tolist()
        assert row.get_seq_length() == own.get_seq_length()  # past + the 6 nodes fed
        for la, lb in zip(own.layers, row.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
    (loop,) = rows.loops.values()
    assert loop.stats.eager == 1 and set(loop.shapes) == {(4, 256)}
    assert all(layer.keys[3].abs().sum() == 0 for layer in rows.layers)  # the padding row wrote the scratch row


def _pool(kind: str, model):
    """(drafters, rounds): a pool whose model drafters' forks draft over rows (``graphs: fixed``) and the most drafter
    forwards one step of a request makes - its catch-up, then a level each."""
    if kind == "chain":
        return [PretrainedDrafter(model, k=4, name="chain", graphs="fixed")], 4
    if kind == "tree":
        return [PretrainedTreeDrafter(model, nodes=8, depth=3, width=2, name="tree", graphs="fixed")], 3
    if kind == "rsd_c":
        return [PretrainedTreeDrafter(model, mode="rsd_c", nodes=8, depth=3, branching=[2], name="tree",
                                      graphs="fixed")], 3
    if kind == "static_tree":
        return [StaticTreeDrafter(model, widths=[2, 2, 1], name="static", graphs="fixed")], 3
    cascade = FusedDrafter([SuffixDrafter(max_depth=8, max_nodes=8, name="suffix"),
                            PretrainedTreeDrafter(model, nodes=8, depth=3, width=2, name="tree", graphs="fixed")],
                           enough=4, name="cascade")
    return [*budget_arms(cascade, (4, 8))], 3


def _rows_of(drafters):
    return {d.rows for d in with_components(drafters) if getattr(d, "rows", None) is not None}


@pytest.mark.parametrize("kind", ["chain", "tree", "rsd_c", "static_tree", "cascade"])
def test_concurrent_requests_draft_each_level_in_one_fixed_shape_forward_and_decode_as_alone(kind):
    drafter_model = tiny_qwen(seed=0, logit_scale=1.5)
    drafters, rounds = _pool(kind, drafter_model)
    policy = make_policy("ucb", len(drafters), seed=0) if len(drafters) > 1 else None
    verifier = Verifier(tiny_qwen(seed=0, logit_scale=2.0), tiny_tokenizer(), fixed_shapes=True)
    engine = Engine(verifier, drafters, policy, check_tokenizers=False)
    expected = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    (rows,) = _rows_of(drafters)
    before = rows.runner.stats.eager
    shapes = []  # every drafter forward's (rows, tokens)
    drafter_model.register_forward_pre_hook(lambda m, args, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    results, steps = schedule_together(engine, PROMPTS, MAX_NEW, lambda: len(shapes))
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    if policy is None:  # one arm: the same drafts as alone (a policy learns across requests in another order)
        assert [r.stats.tokens_per_step for r in results] == [e.stats.tokens_per_step for e in expected]
    full = [f for b, f in steps if b == 4]
    assert full and max(full) <= rounds, (kind, steps)  # one drafter forward per level for the whole batch
    assert rows.runner.stats.eager > before and any(r == 4 for r, _ in shapes)  # levels ran on the rows, 4 at a time
    if kind in ("chain", "static_tree"):  # a greedy chain, a static tree: the whole loop for the batch at once
        (loop,) = rows.loops.values()
        assert loop.stats.eager > 0 and any(R == 4 for R, _ in loop.shapes), loop.describe()
    assert not rows.held and rows.rows == 4  # every request's row given back; the buffers kept for the next


def test_sampling_through_levels_over_the_rows_follows_the_verifier_at_depth_two():
    # an RSD-C tree (rejection sampling with the drafter's q): requests sampled side by side, their levels one
    # fixed-shape forward over the rows; the three-token continuations follow the verifier's distribution
    sharp = 20.0
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp)
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp / 2), mode="rsd_c",
                                    nodes=6, depth=2, branching=[2], graphs="fixed")
    engine = Engine(Verifier(verifier, fixed_shapes=True), drafter, seeded_sampling="stream")

    check = sampled_side_by_side(engine)
    assert check.pvalue > 1e-4, check
    drafted, accepted = check.position_drafted[1], check.position_accepted[1]  # steps whose draft reached depth 2
    assert drafted > 200 and 0 < accepted < drafted, check
    assert max(r for r, _, _ in drafter.rows.runner.shapes) > 1  # the levels ran many rows in one forward


def test_graphs_on_names_the_drafter_and_steered_drafters_keep_their_own_caches():
    model = tiny_qwen(seed=0)
    with pytest.raises(ValueError, match="^tree: graphs='on' needs a CUDA device"):
        PretrainedTreeDrafter(model, name="tree", graphs="on")
    steered = SteeredDrafter(model, k=2, name="steered", fixed_shapes=True)  # its hooks bias each forward
    assert steered.rows is None
    assert PretrainedTreeDrafter(model, name="tree").rows is None  # auto on a CPU: nothing fixed


def test_the_servers_metrics_report_each_drafters_levels_over_its_rows():
    from metasd.serve.metrics import ServeMetrics

    drafter = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=1.5), nodes=8, depth=3, width=2, name="tree",
                                    graphs="fixed")
    verifier = Verifier(tiny_qwen(seed=0, logit_scale=2.0), tiny_tokenizer(), fixed_shapes=True)  # buffers kept
    engine = Engine(verifier, drafter, check_tokenizers=False)
    metrics = ServeMetrics("m")
    with Scheduler(engine, max_batch=2) as s:
        metrics.attach(s)
        with s._lock:
            handles = [s.submit(p, 12) for p in PROMPTS[:2]]
        [h.result(timeout=60) for h in handles]
        text = metrics.render().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("metasd:draft_") and 'drafter="tree"' in line}
    assert values == {"metasd:draft_fixed_shapes": len(drafter.rows.runner.shapes), "metasd:draft_graphs_captured": 0.0,
                      "metasd:draft_graph_capture_seconds": 0.0, "metasd:draft_rows_bytes": drafter.rows.held_bytes}
    assert values["metasd:draft_fixed_shapes"] > 0 and values["metasd:draft_rows_bytes"] > 0  # run, not captured


def test_a_request_alone_drafts_its_levels_and_its_prompts_catch_up_at_fixed_shapes():
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=1.5), nodes=8, depth=3, width=2, name="tree",
                                    graphs="fixed")
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tiny_tokenizer()), drafter, check_tokenizers=False)
    expected = engine.generate(PROMPTS[2], 20)
    with Scheduler(engine, max_batch=2) as s:
        got = s.submit(PROMPTS[2], 20).result(timeout=60)
    assert got.token_ids == expected.token_ids and got.stats.tokens_per_step == expected.stats.tokens_per_step
    shapes = drafter.rows.runner.shapes
    # one row: its prompt's catch-up (11 tokens, padded to 16), then its levels (2 tokens a node)
    assert {(R, T) for R, T, _ in shapes} >= {(1, 16), (1, 2)}, shapes


@torch.inference_mode()
def test_rows_follow_the_verifiers_shape_moving_the_held_ones_down():
    model = tiny_qwen(seed=3, context=1024)
    rows = DraftRows(model, capture=False)
    caches = [rows.take() for _ in range(3)]
    for i, cache in enumerate(caches):
        model(input_ids=torch.tensor([[i + 1] * (5 + i)]), **cache_kwargs(model, cache), use_cache=True)
    kept = [cache.layers[1].keys.clone() for cache in caches]
    rows.give_back(caches[0])
    rows.follow(2, 512)  # the verifier's rows shrank to two and grew to 512 positions: rows 1, 2 move to 0, 1
    assert (rows.rows, rows.capacity) == (2, 512) and [c.row for c in caches[1:]] == [0, 1] and rows.free == []
    for cache, keys in zip(caches[1:], kept[1:]):
        torch.testing.assert_close(cache.layers[1].keys, keys)
    rows.follow(0, 0)  # never fewer rows than are held, nor positions than they use (one bucket here)
    assert (rows.rows, rows.capacity) == (2, 256) and [c.get_seq_length() for c in caches[1:]] == [6, 7]
    for cache, keys in zip(caches[1:], kept[1:]):
        torch.testing.assert_close(cache.layers[1].keys, keys)
    for cache in caches[1:]:
        rows.give_back(cache)
    rows.follow(0, 0)  # none held: nothing allocated
    assert (rows.rows, rows.capacity, rows.held_bytes) == (0, 0, 0) and rows.layers[0].keys is None


def test_a_schedulers_kv_budget_counts_the_drafters_rows_as_allocated():
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=1.5), nodes=8, depth=3, width=2, name="tree",
                                    graphs="fixed")
    verifier = Verifier(tiny_qwen(seed=0, logit_scale=2.0), tiny_tokenizer(), fixed_shapes=True)
    engine = Engine(verifier, drafter, check_tokenizers=False)
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    seen = []
    with Scheduler(engine, max_batch=4, kv_budget=2048) as s:
        cache = s.verifier.cache

        def check(record):
            if isinstance(record, SchedulerStep):
                verifier_bytes = cache._physical(cache.rows) * cache.capacity * cache.geometry.bytes_per_token
                seen.append(((drafter.rows.rows, drafter.rows.capacity), (cache.rows, cache.capacity),
                             verifier_bytes + drafter.rows.held_bytes, cache.held_bytes))
        s.add_listener(check)
        with s._lock:
            handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
    assert seen and all(mine == theirs for mine, theirs, _, _ in seen)  # the rows take the verifier's shape ...
    assert all(allocated <= held <= cache.budget_bytes for _, _, allocated, held in seen)  # ... the budget holds them
    assert cache.extra_bytes_per_token == 0
    assert cache.dense_extra_bytes_per_token == drafter.rows.geometry.bytes_per_token


@torch.inference_mode()
def test_rows_grown_past_the_verifiers_shape_count_in_its_budget_until_they_fit_back():
    # a drafter whose text runs longer than the verifier's reservation (another tokenizer) grows its rows past the
    # shape they follow: the verifier's budget counts the excess, refuses what no longer fits, and the rows fit back
    # once no held row needs the excess
    model = tiny_qwen(seed=3, context=2048)
    rows = DraftRows(model, capture=False)
    geometry = KVGeometry.of(model)
    per_row = 256 * geometry.bytes_per_token  # one row of one bucket, in either cache
    cache = BatchCache(geometry, 4, budget_bytes=12 * per_row, dense_extra_bytes_per_token=geometry.bytes_per_token)
    cache.followers = [rows]
    cache.reserve("a", 200)  # 1 row + none scratch (verifier), 1 row + 1 scratch (drafter) of 256 positions
    assert (rows.rows, rows.capacity, rows.bytes_past()) == (1, 256, 0) and cache.held_bytes == 3 * per_row
    assert cache.fits(200)
    row = rows.take()
    model(input_ids=torch.tensor([[5] * 300]), **cache_kwargs(model, row), use_cache=True)  # 300 drafter tokens
    assert (rows.rows, rows.capacity) == (1, 768)  # the row alone doubles its need: 600, bucketed
    assert rows.bytes_past() == 2 * 512 * geometry.bytes_per_token == 4 * per_row
    assert cache.outside_bytes == 4 * per_row and cache.held_bytes == 7 * per_row
    assert cache.fits(200) and not cache.fits(400)  # two rows of 512 fit the budget, not beside the excess
    cache.shrink()
    assert rows.capacity == 768  # the row still needs it
    rows.grow(capacity=800)  # a level's forward needing more: the need, not twice the buffers' positions (1536)
    assert rows.capacity == 1024
    crop_to(row, 100)  # the drafter kept 100 of its tokens
    cache.shrink()  # between steps: fitted back to the verifier's shape
    assert (rows.rows, rows.capacity, rows.bytes_past()) == (1, 256, 0) and cache.held_bytes == 3 * per_row
    assert row.get_seq_length() == 100 and cache.fits(400)
