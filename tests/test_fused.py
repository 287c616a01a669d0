"""Fused drafts: several arms' drafts merged into one tree, verified in one forward, exact."""
import pytest
import torch
import yaml

import metasd.core.decoding.commit
import metasd.core.decoding.request
from metasd.config import ConfigError, parse_pool_config
from metasd.core import Draft, Drafter, Engine, Verifier
from metasd.core.decoding.acceptance import Acceptance
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from metasd.drafters.fused import FusedDrafter
from test_engine import SMALL_V, _sampling_pvalue, small_pair  # noqa: F401  (fixture)
from tiny import plain_greedy, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5, 7, 12, 9, 33, 12]


class Fixed(Drafter):
    """Proposes the same hand-built draft every step and records what it is told."""

    kind = ""

    def __init__(self, tokens, parents, name):
        super().__init__(name)
        self.tokens, self.parents, self.seen = tokens, parents, []

    def propose(self, ctx):
        return Draft(self.tokens, self.parents)

    def observe(self, feedback):
        self.seen.append((feedback.acceptance.path, feedback.acceptance.bonus))


def test_shared_prefixes_merge_and_budgets_bound_each_arm():
    a = Fixed([5, 6, 7, 8], [-1, 0, 1, 0], "a")  # 5 -> 6 -> 7, 5 -> 8
    b = Fixed([5, 6, 9, 3], [-1, 0, 1, -1], "b")  # 5 -> 6 -> 9, 3
    fused = FusedDrafter([a, b], nodes=[4, 3]).propose(None)
    # a's 4 nodes, then b's 5 and 6 are shared and its 9 is new under 6; b's 3 is past its budget of 3
    assert fused.tokens.tolist() == [5, 6, 7, 8, 9] and fused.parents.tolist() == [-1, 0, 1, 0, 1]
    assert fused.meta == {"nodes_a": 4, "shared_a": 0, "nodes_b": 3, "shared_b": 2}
    capped = FusedDrafter([a, b], max_nodes=5).propose(None)
    assert capped.tokens.tolist() == [5, 6, 7, 8, 9]  # b's root 3 would be the 6th node


def test_each_arm_learns_what_its_own_draft_had_accepted():
    a = Fixed([5, 6, 7], [-1, 0, 1], "a")
    b = Fixed([5, 9], [-1, 0], "b")
    fused = FusedDrafter([a, b])
    draft = fused.propose(None)
    from metasd.core import StepFeedback
    fused.observe(StepFeedback(draft, Acceptance([0, 1], 4), committed=[5, 6, 4]))
    assert a.seen == [([0, 1], 4)]  # 5 and 6 accepted, then the verifier's 4
    assert b.seen == [([0], 6)]  # b's draft accepts 5; the verifier then committed 6, not its 9


def test_greedy_output_is_the_verifiers_and_the_fused_tree_accepts_more_than_either_arm():
    verifier = tiny_qwen(seed=0, logit_scale=8.0)
    drafter = tiny_qwen(seed=0, logit_scale=3.0)
    tree = PretrainedTreeDrafter(drafter, nodes=6, depth=3, width=2, name="tree")
    lookup = NGramDrafter(k=4, n_max=2, name="lookup")
    fused = FusedDrafter([tree, lookup], name="fused")
    results = {}
    for arm in (tree, lookup, fused):
        result = Engine(Verifier(verifier), arm).generate(PROMPT, max_new_tokens=40)
        assert result.token_ids == plain_greedy(verifier, PROMPT, 40)
        results[arm.name] = result.stats.mean_tokens_per_step
    assert results["fused"] >= max(results["tree"], results["lookup"]) - 1e-9


def test_sampling_from_a_fused_tree_follows_the_verifiers_distribution(small_pair):  # noqa: F811
    verifier, drafter = small_pair
    fused = FusedDrafter([PretrainedDrafter(drafter, k=2, name="chain"),
                          PretrainedTreeDrafter(tiny_qwen(seed=7, vocab=SMALL_V), nodes=4, depth=2, width=2, name="tree")])
    assert _sampling_pvalue(Engine(Verifier(verifier), fused)) > 1e-3


def test_a_wrong_rule_for_fused_trees_fails_the_sampling_test(small_pair, monkeypatch):  # noqa: F811
    """The branches come from different proposal distributions; a rule that treats the tree as if one drafter's q
    held everywhere is wrong. Here: always follow the first child (a rule that trusts the drafters) - the test sees it."""
    def first_child(draft, p, generator=None):
        path, row = [], 0
        kids = {int(par): i for i, par in reversed(list(enumerate(draft.parents.tolist())))}
        while row - 1 in kids:
            path.append(kids[row - 1])
            row = path[-1] + 1
        return Acceptance(path, int(torch.multinomial(p[row], 1, generator=generator)))

    monkeypatch.setattr(metasd.core.decoding.commit, "accept_match", first_child)
    verifier, drafter = small_pair
    fused = FusedDrafter([PretrainedDrafter(drafter, k=2, name="chain"), NGramDrafter(k=2, name="lookup")])
    assert _sampling_pvalue(Engine(Verifier(verifier), fused)) < 1e-6


def _pool(drafters):
    return {"verifier": {"model": "bundled:qwen2.5-coder-1.5b-instruct"}, "drafters": drafters}


def test_pool_files_name_the_arms_of_a_fused_entry():
    ok = parse_pool_config(_pool([{"name": "lookup", "type": "ngram", "arm": False},
                                  {"name": "suffix", "type": "suffix", "arm": False},
                                  {"name": "both", "type": "fused", "params": {"arms": ["lookup", "suffix"]}}]))
    assert ok.n_arms == 1
    with pytest.raises(ConfigError, match=r"drafters\.0\.params\.arms: \['later', 'x'\] are not earlier entries"):
        parse_pool_config(_pool([{"name": "both", "type": "fused", "params": {"arms": ["later", "x"]}},
                                 {"name": "later", "type": "ngram"}, {"name": "x", "type": "ngram"}]), source="p")
    with pytest.raises(ConfigError, match=r"entries \['idle'\] have arm: false and no entry drafts with them"):
        parse_pool_config(_pool([{"name": "idle", "type": "ngram", "arm": False}, {"name": "a", "type": "ngram"}]))
    with pytest.raises(ConfigError, match="nodes gives 1 budgets for 2 arms"):
        parse_pool_config(_pool([{"name": "a", "type": "ngram"}, {"name": "b", "type": "ngram"},
                                 {"name": "f", "type": "fused", "params": {"arms": ["a", "b"], "nodes": [3]}}]))
    assert yaml.safe_dump(ok.model_dump())  # a pool with components stays plain data


def test_a_cascade_stops_after_a_draft_deep_enough():
    class Counting(Fixed):
        calls = 0

        def propose(self, ctx):
            self.calls += 1
            return super().propose(ctx)

    deep = Fixed([5, 6, 7], [-1, 0, 1], "lookup")  # depth 3
    model = Counting([9], [-1], "model")
    assert FusedDrafter([deep, model], enough=3).propose(None).meta["cascade_stop"] and model.calls == 0
    # not deep enough: the model drafts too, and its nodes come first
    assert FusedDrafter([deep, model], enough=4).propose(None).tokens.tolist() == [9, 5, 6, 7] and model.calls == 1


class _Lookup(Fixed):
    lookup = True


def test_a_lookup_only_step_drafts_with_the_lookup_arms_and_tells_only_them():
    from metasd.core import StepContext, StepFeedback
    from metasd.core.decoding.drafter import drafts_lookups
    from metasd.core.decoding.sampling import SamplingParams

    suffix, model = _Lookup([5, 6], [-1, 0], "suffix"), Fixed([5, 9, 3], [-1, 0, 1], "model")
    fused = FusedDrafter([suffix, model], enough=6)
    assert drafts_lookups(fused) and not fused.lookup and not drafts_lookups(model)
    ctx = StepContext(tokens=torch.tensor(PROMPT), prompt_len=len(PROMPT), max_depth=8, sampling=SamplingParams(),
                      lookup_only=True)
    draft = fused.propose(ctx)
    assert draft.tokens.tolist() == [5, 6] and draft.meta["lookup_only"] and "nodes_model" not in draft.meta
    fused.observe(StepFeedback(draft, Acceptance([0], 4), committed=[5, 4]))
    assert suffix.seen == [([0], 4)] and model.seen == []  # the model drafted nothing: it is told nothing
    full = fused.propose(None)
    assert full.tokens.tolist() == [5, 9, 3, 6]  # outside a lookup-only step both arms draft, the model's nodes first


def test_a_cascade_bounded_where_the_lookup_was_shallow_keeps_the_models_nodes():
    # four one-token guesses (shallow, but wide enough to fill a 3-node bound) and a model's 3-node chain: the model's
    # nodes come first, so the bound keeps them - and the bounded draft is the unbounded one's first nodes (what budget
    # arms and acceptance curves assume)
    from metasd.core import StepContext
    from metasd.core.decoding.sampling import SamplingParams

    suffix, model = _Lookup([5, 6, 7, 8], [-1, -1, -1, -1], "suffix"), Fixed([9, 3, 4], [-1, 0, 1], "model")
    fused = FusedDrafter([suffix, model], enough=2)
    unbounded = fused.propose(None)
    assert unbounded.tokens.tolist() == [9, 3, 4, 5, 6, 7, 8]
    assert unbounded.parents.tolist() == [-1, 0, 1, -1, -1, -1, -1]
    ctx = StepContext(tokens=torch.tensor(PROMPT), prompt_len=len(PROMPT), max_depth=8, sampling=SamplingParams(),
                      max_nodes=3)
    bounded = fused.propose(ctx)
    assert bounded.tokens.tolist() == [9, 3, 4]
    assert bounded.meta["nodes_model"] == 3 and bounded.meta["nodes_suffix"] == 0
    deep = FusedDrafter([_Lookup([5, 6], [-1, 0], "suffix"), model], enough=2).propose(ctx)
    assert deep.tokens.tolist() == [5, 6] and deep.meta["cascade_stop"]  # deep enough: the lookup alone, as before
