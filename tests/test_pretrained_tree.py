"""PretrainedTreeDrafter on tiny models: greedy identity per mode, sampling exactness by enumeration (and
its power against siblings drawn with replacement), drafter-side tree masks/positions, cache after
acceptance, parameter validation."""
import pytest
import torch
from transformers import DynamicCache

from metasd.core.decoding.acceptance import Acceptance
from metasd.core.decoding.drafter import DRAFTERS, BuildContext, StepContext, StepFeedback
from metasd.drafters import PretrainedTreeDrafter
from metasd.drafters.growing_tree import GrowingTree, conditional_gumbel, gumbel_top_k
from metasd.core.engine import Engine
from metasd.core.decoding.sampling import SamplingParams
from metasd.core.execution.tree import Draft, children_lists
from metasd.core.execution.verifier import Verifier
from metasd.core.execution.kv_cache import cache_kwargs
from sampling_check import joint_check
from tiny import plain_greedy, tiny_llama, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
MODES = ["dynamic", "rsd_c", "rsd_s"]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0)


def _engine(model, drafter):
    return Engine(Verifier(model), drafter, check_tokenizers=False)


def _ctx(tokens, max_depth=8, temperature=0.0, seed=0):
    sampling = SamplingParams(temperature=temperature)
    gen = None if sampling.greedy else torch.Generator().manual_seed(seed)
    return StepContext(tokens=torch.tensor(tokens), prompt_len=len(tokens), max_depth=max_depth, sampling=sampling,
                       generator=gen)


# ---------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_output_identical_to_plain_decoding(model, mode, which):
    drafter_model = tiny_qwen(seed=0) if which == "same" else tiny_llama(seed=3)
    engine = _engine(model, PretrainedTreeDrafter(drafter_model, mode=mode, nodes=12, depth=5, width=3))
    for n in (1, 7, 40):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(model, PROMPT, n)
        assert result.stats.new_tokens == n == result.stats.committed
    if which == "same":  # the drafter's own argmax path is in every tree: some steps accept several tokens
        assert result.stats.mean_tokens_per_step > 1.5


def test_rsd_modes_fall_back_to_dynamic_under_greedy(model):
    for mode in ("rsd_c", "rsd_s"):
        d = PretrainedTreeDrafter(model, mode=mode, nodes=10, depth=4, width=3)
        d.begin(None)
        draft = d.propose(_ctx(PROMPT))
        assert draft.meta["mode"] == "dynamic" and draft.probs is None
        d.begin(None)
        sampled = d.propose(_ctx(PROMPT, temperature=1.0))
        assert sampled.meta["mode"] == mode and sampled.probs is not None and sampled.without_replacement


def test_budgets_and_max_depth(model):
    for mode, kw in [("dynamic", dict(width=4)), ("rsd_c", dict(branching=[3, 2])), ("rsd_s", dict(width=4))]:
        d = PretrainedTreeDrafter(model, mode=mode, nodes=7, depth=5, **kw)
        for temperature in (0.0, 1.0):
            d.begin(None)
            draft = d.propose(_ctx(PROMPT, temperature=temperature))
            assert 1 <= len(draft) <= 7 and draft.depth <= 5
            d.begin(None)
            assert d.propose(_ctx(PROMPT, max_depth=2, temperature=temperature)).depth <= 2
            assert len(d.propose(_ctx(PROMPT, max_depth=0, temperature=temperature))) == 0
    # rsd_c without a binding budget: exactly the branching factors, children in parent order
    d = PretrainedTreeDrafter(model, mode="rsd_c", nodes=100, depth=3, branching=[3, 2, 1])
    d.begin(None)
    draft = d.propose(_ctx(PROMPT, temperature=1.0))
    assert len(draft) == 3 + 6 + 6 and torch.bincount(draft.depths()).tolist() == [0, 3, 6, 6]
    # dynamic tree with an identical drafter: the greedy chain is inside, siblings are distinct
    d = PretrainedTreeDrafter(model, mode="dynamic", nodes=16, depth=4, width=4)
    d.begin(None)
    draft = d.propose(_ctx(PROMPT))
    for kids in _children(draft):
        toks = [int(draft.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))
    greedy = plain_greedy(model, PROMPT, 1)
    assert greedy[0] in [int(draft.tokens[c]) for c in _children(draft)[0]]


def _path_logprob(model, prompt, draft, node):
    """log prod q(token | prefix) along the path root -> node, by plain forwards (independent of the drafter)."""
    path = []
    while node >= 0:
        path.append(int(draft.tokens[node]))
        node = int(draft.parents[node])
    path.reverse()
    with torch.no_grad():
        logp = model(torch.tensor([prompt + path])).logits[0].float().log_softmax(-1)
    return sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(path))


def test_min_path_prob_expands_only_likely_nodes(model):
    full = PretrainedTreeDrafter(model, mode="dynamic", nodes=40, depth=5, width=3)
    full.begin(None)
    free = full.propose(_ctx(PROMPT))
    level1 = sorted(_path_logprob(model, PROMPT, free, i) for i in range(len(free)) if int(free.parents[i]) < 0)
    threshold = (level1[0] + level1[1]) / 2  # between the two least likely root children: prunes one of them
    d = PretrainedTreeDrafter(model, mode="dynamic", nodes=40, depth=5, width=3, min_path_prob=float(torch.tensor(threshold).exp()))
    d.begin(None)
    draft = d.propose(_ctx(PROMPT))
    kids = _children(draft)
    expanded = [i for i in range(len(draft)) if kids[i + 1]]
    leaves_below = [i for i in range(len(draft)) if _path_logprob(model, PROMPT, draft, i) < threshold]
    assert expanded and leaves_below
    assert all(_path_logprob(model, PROMPT, draft, i) >= threshold for i in expanded)
    assert not any(kids[i + 1] for i in leaves_below)  # below the threshold: drafted, never expanded
    assert len(draft) < len(free) and draft.meta["drafter_forwards"] <= free.meta["drafter_forwards"]
    assert d.describe()["min_path_prob"] == d.min_path_prob > 0
    engine = _engine(model, PretrainedTreeDrafter(model, mode="dynamic", nodes=12, depth=5, width=3, min_path_prob=0.05))
    assert engine.generate(PROMPT, max_new_tokens=30).token_ids == plain_greedy(model, PROMPT, 30)


def _children(draft):
    return children_lists(draft.parents)


# ---------------------------------------------------------------- drafter-side masks and positions
def test_tree_masks_and_positions_hand_built():
    tree = GrowingTree(base=5)
    a, b = tree.add(10, -1), tree.add(11, -1)
    c, d = tree.add(12, a), tree.add(13, a)
    e = tree.add(14, c)
    mask, pos = tree.inputs([a, b])
    expected = torch.zeros(2, 7, dtype=torch.bool)
    expected[:, :5] = True
    expected[0, 5] = expected[1, 6] = True
    assert mask.shape == (1, 1, 2, 7) and torch.equal(mask[0, 0], expected) and pos.tolist() == [[5, 5]]
    tree.mark_fed([a, b])  # slots a: 0, b: 1
    mask, pos = tree.inputs([d, c])  # fed out of order on purpose
    expected = torch.zeros(2, 9, dtype=torch.bool)
    expected[:, :5] = True
    expected[:, 5] = True  # ancestor a
    expected[0, 7] = expected[1, 8] = True  # themselves
    assert torch.equal(mask[0, 0], expected) and pos.tolist() == [[6, 6]]
    tree.mark_fed([d, c])  # slots d: 2, c: 3
    mask, pos = tree.inputs([e])
    expected = torch.zeros(1, 10, dtype=torch.bool)
    expected[0, [0, 1, 2, 3, 4, 5, 8, 9]] = True  # prefix, a, c, itself
    assert torch.equal(mask[0, 0], expected) and pos.tolist() == [[7]]
    with pytest.raises(ValueError, match="already fed"):
        tree.inputs([a])
    f = tree.add(15, e)
    with pytest.raises(ValueError, match="never fed"):
        tree.inputs([f])


@pytest.mark.parametrize("make", [lambda: tiny_qwen(seed=2), lambda: tiny_llama(seed=2)], ids=["qwen", "llama"])
def test_tree_forward_matches_plain_forward_per_path(make):
    """The batched tree forward gives every node the logits of a plain forward over prefix + its path."""
    m = make()
    d = PretrainedTreeDrafter(m)
    d.begin(None)
    d.sync(PROMPT)
    tree = GrowingTree(base=len(PROMPT))
    a, b, c = tree.add(10, -1), tree.add(11, -1), tree.add(12, -1)
    level1 = d._feed(tree, [c, a, b])
    x, y = tree.add(20, a), tree.add(21, c)
    z = tree.add(22, a)
    level2 = d._feed(tree, [x, y, z])
    w = tree.add(30, z)
    level3 = d._feed(tree, [w])
    with torch.no_grad():
        for logits, nodes in ((level1, [c, a, b]), (level2, [x, y, z]), (level3, [w])):
            for row, node in enumerate(nodes):
                path = [tree.tokens[i] for i in tree.path(node)]
                ref = m(torch.tensor([PROMPT + path])).logits[0, -1]
                assert torch.allclose(logits[row], ref, atol=1e-4), (node, path)


# ---------------------------------------------------------------- cache after acceptance
def _fresh_cache(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True)
    return cache


def _assert_cache_equals_fresh(drafter, ids):
    assert drafter.cache.get_seq_length() == len(ids) == len(drafter.cached_ids)
    assert drafter.cached_ids == list(ids)
    fresh = _fresh_cache(drafter.model, ids)
    for a, b in zip(drafter.cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("mode, temperature", [("dynamic", 0.0), ("rsd_c", 1.0), ("rsd_s", 1.0), ("dynamic", 1.0)])
def test_drafter_cache_after_acceptance_equals_fresh_prefill(model, mode, temperature, monkeypatch):
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=0), mode=mode, nodes=12, depth=4, width=3)
    committed: list[int] = []
    gathered = []
    original = PretrainedTreeDrafter.observe

    def checked_observe(self, feedback):
        original(self, feedback)
        before = len(committed)
        committed.extend(feedback.committed)
        # after observe: only committed tokens (the prefix + the accepted nodes that had been fed) ...
        assert before <= len(self.cached_ids) < len(committed) and committed[: len(self.cached_ids)] == self.cached_ids
        _assert_cache_equals_fresh(self, self.cached_ids)
        gathered.append(len(self.cached_ids) - before)
        # ... and after the catch-up of the next step: a fresh prefill of every committed token
        self.sync(list(committed))
        _assert_cache_equals_fresh(self, committed)

    monkeypatch.setattr(PretrainedTreeDrafter, "observe", checked_observe)
    engine = _engine(model, drafter)
    original_begin = PretrainedTreeDrafter.begin

    def begin(self, ctx):
        original_begin(self, ctx)
        committed[:] = list(PROMPT)

    monkeypatch.setattr(PretrainedTreeDrafter, "begin", begin)
    from metasd.core.decoding.commit import Commits
    first_token = Commits.first_token

    def first(self, logits):  # the token drawn with the prefill: committed before any step the drafter observes
        tokens, done = first_token(self, logits)
        committed.extend(tokens)
        return tokens, done

    monkeypatch.setattr(Commits, "first_token", first)
    engine.seeded_sampling = "stream"  # the rules that read q (RSD), whose accepted nodes the cache must gather
    result = engine.generate(PROMPT, max_new_tokens=30, temperature=temperature, seed=3)
    assert len(result.token_ids) == 30 and len(gathered) == result.stats.steps
    assert max(gathered) > 0  # some steps gathered accepted nodes from the tree part of the cache


def test_unobserved_tree_is_dropped_at_next_propose(model):
    d = PretrainedTreeDrafter(tiny_qwen(seed=0), nodes=10, depth=4, width=3)
    d.begin(None)
    d.propose(_ctx(PROMPT))
    assert d.cache.get_seq_length() > len(PROMPT)  # tree nodes are in the cache until settled
    d.propose(_ctx(PROMPT + [3]))  # no observe in between
    d.observe(StepFeedback(Draft.empty(), Acceptance([], 4), [4]))  # someone else's draft: tree dropped
    _assert_cache_equals_fresh(d, PROMPT + [3])


# ---------------------------------------------------------------- sampling exactness by enumeration
SMALL_V = 8
N_SEEDS = 800  # enough: the wrong rules below score p < 1e-17 at this size


@pytest.fixture(scope="module")
def small_pair():
    # an over-confident drafter (sharper than the verifier, often wrong): duplicates under replacement are
    # frequent and rejections common, so a wrong sibling rule shows in 2-token statistics
    return tiny_qwen(seed=5, vocab=SMALL_V, logit_scale=4.0), tiny_qwen(seed=6, vocab=SMALL_V, logit_scale=20.0)


def _sampling_pvalue(engine, n=N_SEEDS):
    """First two tokens of 3-token generations (so the first step drafts a depth-2 tree) vs enumeration
    (``sampling_check``: pairs expected fewer than 5 times pooled into one cell)."""
    return joint_check(engine, [1, 2, 3], n, length=2, max_new_tokens=3).pvalue


TREES = {"rsd_c": dict(mode="rsd_c", branching=[4, 2], nodes=16, depth=2),
         "rsd_s": dict(mode="rsd_s", width=4, nodes=16, depth=2)}


@pytest.mark.parametrize("mode", ["rsd_c", "rsd_s"])
def test_rsd_sampling_matches_the_verifier_distribution(small_pair, mode):
    verifier, drafter = small_pair
    engine = _engine(verifier, PretrainedTreeDrafter(drafter, **TREES[mode]))
    assert _sampling_pvalue(engine) > 1e-3


def _with_replacement_siblings(self, q, k, ctx, tree, parent):
    return torch.multinomial(q, k, replacement=True, generator=ctx.generator).tolist()


def _with_replacement_beam(self, phi, value, logq, k, generator):
    """The beam's extensions drawn WITH replacement (duplicate siblings possible), kept in draw order."""
    cand = (phi[:, None] + logq.double()).flatten()
    picks = torch.multinomial(cand.softmax(-1).float(), k, replacement=True, generator=generator).tolist()
    vocab = logq.shape[-1]
    return [(i // vocab, i % vocab, float(cand[i]), 0.0) for i in picks]


@pytest.mark.parametrize("mode", ["rsd_c", "rsd_s"])
def test_siblings_with_replacement_fail_the_sampling_test(small_pair, mode, monkeypatch):
    """The exactness test has power: siblings drawn with replacement but verified as without are caught."""
    if mode == "rsd_c":
        monkeypatch.setattr(PretrainedTreeDrafter, "_sample_siblings", _with_replacement_siblings)
    else:
        monkeypatch.setattr(PretrainedTreeDrafter, "_beam_select", _with_replacement_beam)
    verifier, drafter = small_pair
    d = PretrainedTreeDrafter(drafter, **TREES[mode])
    engine = _engine(verifier, d)
    assert _sampling_pvalue(engine) < 1e-6


# ---------------------------------------------------------------- Gumbel helpers
def test_gumbel_top_k_draws_without_replacement_in_order():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 4000
    firsts = torch.zeros(4)
    seconds_after_0 = torch.zeros(4)
    for _ in range(n):
        draw = gumbel_top_k(q.log(), 5, g)
        assert sorted(draw) == [0, 1, 2]  # capped at the support, no duplicates
        firsts[draw[0]] += 1
        if draw[0] == 0:
            seconds_after_0[draw[1]] += 1
    assert torch.allclose(firsts / n, q, atol=0.03)
    assert torch.allclose(seconds_after_0 / seconds_after_0.sum(), torch.tensor([0, 0.6, 0.4, 0]), atol=0.04)


def test_conditional_gumbel_keeps_order_and_sets_the_max():
    g = torch.Generator().manual_seed(1)
    perturbed = torch.randn(3, 6, generator=g, dtype=torch.float64) * 3
    perturbed[1, 2] = float("-inf")
    parent = torch.tensor([[0.5], [-2.0], [4.0]], dtype=torch.float64)
    out = conditional_gumbel(parent, perturbed)
    assert torch.allclose(out.max(-1).values, parent[:, 0])
    assert out[1, 2] == float("-inf") and not torch.isnan(out).any()
    for r in range(3):
        assert torch.equal(out[r].argsort(), perturbed[r].argsort())
        assert (out[r] <= parent[r] + 1e-12).all()


# ---------------------------------------------------------------- parameters and config
@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="beam"), "mode"),
    (dict(nodes=0), "nodes"),
    (dict(depth=0), "depth"),
    (dict(width=0), "width"),
    (dict(frontier=0), "frontier"),
    (dict(mode="rsd_c", branching=[]), "branching"),
    (dict(mode="rsd_c", branching=[2, 0]), "branching"),
    (dict(mode="dynamic", branching=[2, 1]), "branching"),
    (dict(depth=2.5), "depth"),
    (dict(min_path_prob=1.0), "min_path_prob"),
    (dict(min_path_prob=-0.1), "min_path_prob"),
    (dict(mode="rsd_s", min_path_prob=0.1), "min_path_prob"),
])
def test_bad_parameters_name_the_parameter(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PretrainedTreeDrafter(model, **kwargs)


def test_from_config(model):
    assert DRAFTERS["pretrained_tree"] is PretrainedTreeDrafter
    build = BuildContext(verifier=None, model="tiny", checkpoint=None, load_model=lambda ref: (model, None))
    d = PretrainedTreeDrafter.from_config("tree", {"mode": "dynamic", "nodes": 16, "depth": 6, "width": 4}, build)
    assert d.describe()["nodes"] == 16 and d.name == "tree" and d.model_ref == "tiny"
    with pytest.raises(ValueError, match="needs a model"):
        PretrainedTreeDrafter.from_config("tree", {}, BuildContext(None, None, None, None))
    from metasd.config import parse_pool_config
    cfg = parse_pool_config({"verifier": {"model": "x"}, "drafters": [
        {"name": "t", "type": "pretrained_tree", "model": "y", "params": {"mode": "rsd_s", "nodes": 16, "depth": 6, "width": 4}}]})
    assert cfg.drafters[0].type == "pretrained_tree"
