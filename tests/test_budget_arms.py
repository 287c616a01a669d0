"""Draft budgets and "no speculation" as arms (drafters/budgeted.py): the pool syntax, one shared drafter per entry,
exact free counterfactuals for smaller budgets, and exact output whatever the policy picks."""
import dataclasses

import pytest
import torch
from metasd.drafters import NGramDrafter, PretrainedTreeDrafter
from metasd.drafters.budgeted import BudgetedArm, NoSpeculation, budget_arms
from metasd.drafters.fused import FusedDrafter
from metasd.policies import UCB1
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

from metasd.bench.experiment import load_experiment
from metasd.config import (
    ConfigError,
    ModelCache,
    build_engine,
    parse_pool_config,
    read_pool_config,
    select_entries,
)
from metasd.core import Draft, Drafter, Engine, StepContext, StepFeedback, Verifier
from metasd.core.decoding.acceptance import Acceptance, accept_greedy
from metasd.core.decoding.sampling import SamplingParams

# repetitive, so that lookups match; the verifier and a softer copy of it as the model drafter
PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5, 7, 12, 9, 33, 12]


@pytest.fixture(scope="module")
def models():
    return tiny_qwen(seed=0, logit_scale=8.0), tiny_qwen(seed=0, logit_scale=3.0)


def _pool(drafters, **top):
    return {"verifier": {"model": "tiny-verifier", "dtype": "fp32", "device": "cpu"}, "drafters": drafters, **top}


CASCADE = [{"name": "lookup", "type": "ngram", "arm": False, "params": {"k": 4, "n_max": 2}},
           {"name": "tree", "type": "pretrained_tree", "model": "tiny-drafter", "arm": False,
            "params": {"nodes": 24, "depth": 6, "width": 3}},
           {"name": "cascade", "type": "fused", "params": {"arms": ["lookup", "tree"], "enough": 3},
            "budgets": [16, 2, 6]}]


# ---------------------------------------------------------------- the pool syntax
def test_budgets_make_one_arm_per_budget_in_order_then_none():
    config = parse_pool_config(_pool([{"name": "ngram", "type": "ngram"}, *CASCADE], no_speculation_arm=True))
    assert config.drafters[3].budgets == [2, 6, 16]  # sorted on load
    assert config.arm_names == ["ngram", "cascade@2", "cascade@6", "cascade@16", "none"] and config.n_arms == 5
    plain = parse_pool_config(_pool([{"name": "ngram", "type": "ngram"}, {"name": "suffix", "type": "suffix"}]))
    assert plain.arm_names == ["ngram", "suffix"] and not plain.no_speculation_arm  # without the keys: as before
    assert read_pool_config(None).arm_names == ["cascade"]  # the embedded default pool


@pytest.mark.parametrize("entry, top, error", [
    ({"budgets": [4, 4]}, {}, r"drafters\.1\.budgets: budgets must be distinct, got \[4, 4\]"),
    ({"budgets": [0, 3]}, {}, r"drafters\.1\.budgets: budgets must be integers >= 1"),
    ({"budgets": []}, {}, r"drafters\.1\.budgets: give at least one budget"),
    ({"budgets": ["4"]}, {}, r"drafters\.1\.budgets\.0: Input should be a valid integer"),
    ({"budgets": 4}, {}, r"drafters\.1\.budgets: Input should be a valid list"),
    ({"budgets": [2], "arm": False}, {}, (r"drafters\.1\.budgets: budgets makes the entry one arm per budget; it "
                                          r"cannot be given with arm: false")),
    ({"name": "none"}, {"no_speculation_arm": True}, r"drafters\.1\.name: 'none' is the no-speculation arm's name"),
    ({"name": "a@2"}, {}, r"drafters: arm names must be unique; repeated: \['a@2'\]"),
    ({}, {"no_speculation_arm": "yes"}, r"no_speculation_arm: Input should be a valid boolean"),
])
def test_each_bad_budget_setting_is_refused_naming_its_field(entry, top, error):
    drafters = [{"name": "a", "type": "ngram", "budgets": [2, 8]}, {"name": "b", "type": "ngram", **entry}]
    with pytest.raises(ConfigError, match=error):
        parse_pool_config(_pool(drafters, **top))
    ok = parse_pool_config(_pool([{"name": "none", "type": "ngram"}]))  # reserved only with the none arm
    assert ok.arm_names == ["none"]


def test_a_pool_builds_budget_arms_sharing_one_drafter_and_a_none_arm(models):
    verifier_model, drafter_model = models
    tok = tiny_tokenizer()
    cache = ModelCache("cpu")
    cache.put("tiny-verifier", "fp32", (verifier_model, tok))
    cache.put("tiny-drafter", "fp32", (drafter_model, tok))
    config = parse_pool_config(_pool(CASCADE, no_speculation_arm=True, feedback="full"))
    engine = build_engine(config, models=cache)
    assert [d.name for d in engine.drafters] == ["cascade@2", "cascade@6", "cascade@16", "none"]
    assert engine.policy.n_arms == 4
    inner = engine.drafters[0].inner
    assert isinstance(inner, FusedDrafter) and all(d.inner is inner for d in engine.drafters[:3])
    assert [d.budget for d in engine.drafters[:3]] == [2, 6, 16]
    assert sum(d is inner for d in engine.all_drafters) == 1  # begun, ended and locked once
    result = engine.generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 24)


def test_forks_of_budget_arms_share_one_forked_drafter(models):
    _, drafter_model = models
    inner = FusedDrafter([NGramDrafter(k=4, n_max=2, name="lookup"),
                          PretrainedTreeDrafter(drafter_model, nodes=8, depth=3, width=2, name="tree")], name="f")
    arms = budget_arms(inner, (2, 8))
    memo: dict = {}
    forks = [a.fork(memo=memo) for a in arms]
    assert forks[0].inner is forks[1].inner and forks[0].inner is not inner
    assert forks[0].inner.arms[1] is not inner.arms[1] and forks[0].inner.arms[1].model is drafter_model
    assert [f.name for f in forks] == ["f@2", "f@8"] and [f.budget for f in forks] == [2, 8]


def test_forks_of_an_entrys_budget_arms_share_one_new_holder_per_fork():
    inner = NGramDrafter(k=4, n_max=2, name="lookup")
    arms = budget_arms(inner, (2, 8, 32))
    assert all(a.shared is arms[0].shared for a in arms)  # one holder for the entry
    ctx = _ctx(PROMPT)
    arms[1].propose(ctx)  # a proposal in the original's holder
    first, second = ({}, {})
    forks = [[a.fork(memo=first) for a in arms], [a.fork(memo=second) for a in arms]]
    for fork in forks:
        holder = fork[0].shared
        assert all(f.shared is holder and f.inner is fork[0].inner for f in fork)  # shared within a fork
        assert holder is not arms[0].shared and holder.last is None and holder.inner_cf is None  # new, empty
    assert forks[0][0].shared is not forks[1][0].shared  # not across forks (requests)
    assert forks[0][0].inner is not forks[1][0].inner
    assert arms[0].shared.last is not None and arms[0].shared.last.ctx is ctx  # the original's holder kept its own


# ---------------------------------------------------------------- drafting less
def _ctx(tokens, max_depth=8, max_nodes=None):
    return StepContext(tokens=torch.tensor(tokens), prompt_len=len(PROMPT), max_depth=max_depth,
                       sampling=SamplingParams(), max_nodes=max_nodes)


@pytest.mark.parametrize("n", [1, 3, 5, 11])
def test_a_tree_drafter_honouring_max_nodes_drafts_the_first_nodes_of_its_draft(models, n):
    _, drafter_model = models
    tokens = PROMPT + [7, 12]

    def draft(max_nodes):
        d = PretrainedTreeDrafter(drafter_model, nodes=16, depth=6, width=3)
        d.begin(_ctx(tokens))
        return d.propose(_ctx(tokens, max_nodes=max_nodes))

    full, small = draft(None), draft(n)
    assert len(full) == 16
    cut = full.first(n)
    assert small.tokens.tolist() == cut.tokens.tolist() and small.parents.tolist() == cut.parents.tolist()
    if n <= 3:  # the best few nodes need fewer levels grown
        assert small.meta["drafter_forwards"] < full.meta["drafter_forwards"]
    assert len(draft(0)) == 0


def test_a_fused_drafter_passes_max_nodes_on_and_stops_when_full(models):
    _, drafter_model = models
    tokens = PROMPT + [7, 12]

    def draft(max_nodes):
        tree = PretrainedTreeDrafter(drafter_model, nodes=12, depth=5, width=3, name="tree")
        fused = FusedDrafter([NGramDrafter(k=4, n_max=2, name="lookup"), tree])
        for d in (*fused.arms, fused):
            d.begin(_ctx(tokens))
        return fused.propose(_ctx(tokens, max_nodes=max_nodes))

    full = draft(None)
    for n in (2, 5, 9):
        small, cut = draft(n), full.first(n)
        assert small.tokens.tolist() == cut.tokens.tolist() and small.parents.tolist() == cut.parents.tolist()
    assert draft(2).meta.get("budget_stop")  # the lookup's draft filled the budget: the tree did not draft


class Fixed(Drafter):
    """Proposes the same hand-built draft every step and records what it is given and told."""

    kind = ""

    def __init__(self, tokens, parents, name="fixed"):
        super().__init__(name)
        self.tokens, self.parents, self.asked, self.seen = tokens, parents, [], []

    def propose(self, ctx):
        self.asked.append(ctx.max_nodes)
        return Draft(self.tokens, self.parents)

    def observe(self, feedback):
        self.seen.append((feedback.draft, feedback.acceptance.path))


def test_a_budget_arm_passes_its_budget_down_cuts_the_draft_and_tells_the_drafter_its_own_draft():
    inner = Fixed([5, 6, 7, 8, 9], [-1, 0, 1, 0, -1])
    arm = BudgetedArm(inner, 3)
    draft = arm.propose(_ctx(PROMPT))
    assert inner.asked == [3] and draft.tokens.tolist() == [5, 6, 7] and draft.parents.tolist() == [-1, 0, 1]
    arm.propose(_ctx(PROMPT, max_nodes=2))  # a tighter bound from above (a scheduler's) is passed on
    assert inner.asked == [3, 2]
    draft = arm.propose(_ctx(PROMPT))
    arm.observe(StepFeedback(draft.first(2), Acceptance([0, 1], 4), committed=[5, 6, 4]))
    (told, path), = inner.seen
    assert len(told) == 5 and path == [0, 1]  # its own 5-node draft: the path's indices are its own
    deep = arm.propose(_ctx(PROMPT, max_depth=1))  # cut to depth 1 first (renumbered), then to the budget
    assert deep.tokens.tolist() == [5, 9]


# ---------------------------------------------------------------- counterfactuals for free
def _recording(drafter, seen: list):
    original = drafter.counterfactual

    def record(ctx, feedback):
        result = original(ctx, feedback)
        seen.append((ctx.tokens.tolist(), ctx.max_depth, result))
        return result

    drafter.counterfactual = record


def _make_inner(kind, drafter_model):
    tree = lambda: PretrainedTreeDrafter(drafter_model, nodes=24, depth=5, width=3, name="tree")
    if kind == "tree":
        return tree()
    return FusedDrafter([NGramDrafter(k=4, n_max=2, name="lookup"), tree()], enough=4, name="cascade")


def _run_for_real(verifier_model, arm, tokens, max_depth):
    """The arm at that context, run for real: a fresh drafter drafts, a fresh verifier verifies greedy."""
    ctx = _ctx(tokens, max_depth)
    for d in (arm, *arm.inner.components(), arm.inner):
        d.begin(ctx)
    draft = arm.propose(ctx)
    verifier = Verifier(verifier_model)
    verifier.prefill(torch.tensor(tokens[:-1]))
    out = verifier.verify(tokens[-1], draft)
    return accept_greedy(draft, out.logits.argmax(-1)).n_accepted, len(draft), draft.depth


@pytest.mark.parametrize("kind", ["tree", "fused"])
def test_a_smaller_budgets_counterfactual_equals_running_that_budget(models, kind):
    verifier_model, drafter_model = models
    inner = _make_inner(kind, drafter_model)
    small, large = budget_arms(inner, (3, 16))
    seen: list = []
    _recording(small, seen)
    engine = Engine(Verifier(verifier_model), [small, large], UCB1(2), feedback="full")
    engine.policy.select = lambda context=None: 1  # the large budget drafts every step; the small one is scored
    result = engine.generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 40)
    assert len(seen) == result.stats.steps >= 5
    cut = 0
    for (tokens, max_depth, c), accepted in zip(seen, [t - 1 for t in result.stats.tokens_per_step]):
        truth = _run_for_real(verifier_model, BudgetedArm(_make_inner(kind, drafter_model), 3), tokens, max_depth)
        assert c is not None and (c.n_accepted, c.drafted, c.depth) == truth, (tokens, c, truth)
        assert not c.censored and c.drafting_cost >= 0 and not c.forwards
        cut += c.n_accepted < accepted
    assert cut > 0 and any(c.n_accepted > 0 for _, _, c in seen)  # the cut mattered, and it still accepted some
    assert any(c.drafting_cost > 0 for _, _, c in seen)  # the model drafted (priced as the larger budget metered)


def test_a_lookup_only_draft_scores_no_sibling_budget():
    # a scheduler's lookup-only step: the draft is the lookups' alone, not what the arm drafts - no counterfactual
    small, large = budget_arms(Fixed([5, 6, 7, 8], [-1, 0, 1, 2]), (2, 4))
    for lookup_only, expected in ((False, 2), (True, None)):
        ctx = dataclasses.replace(_ctx(PROMPT), lookup_only=lookup_only)
        draft = large.propose(ctx)
        feedback = StepFeedback(draft, Acceptance([0, 1, 2], 4), committed=[5, 6, 7, 4])
        c = small.counterfactual(ctx, feedback)
        assert (c if c is None else c.n_accepted) == expected


def test_a_larger_budget_is_scored_only_when_the_drafter_drafted_less_than_the_budget_verified(models):
    verifier_model, drafter_model = models
    inner = _make_inner("tree", drafter_model)
    small, large = budget_arms(inner, (4, 64))
    seen: list = []
    _recording(large, seen)
    engine = Engine(Verifier(verifier_model), [small, large], UCB1(2), feedback="full")
    engine.policy.select = lambda context=None: 0
    result = engine.generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 30)
    assert seen and all(c is None for _, _, c in seen[:-1])  # 4 of 24 nodes verified: the rest is unknown

    # a drafter that drafted fewer nodes than the budget verified: a larger budget would have proposed the same
    for nodes, expected in (([5, 6, 7], [-1, 0, -1]), (2, 3, 2)), (([5, 6, 7, 8, 9], [-1, 0, -1, 1, 3]), None):
        inner = Fixed(*nodes)
        small, large = budget_arms(inner, (4, 8))
        ctx = _ctx(PROMPT)
        draft = small.propose(ctx)
        c = large.counterfactual(ctx, StepFeedback(draft, Acceptance([0, 1], 4), committed=[5, 6, 4]))
        assert (c if c is None else (c.n_accepted, c.drafted, c.depth)) == expected


def test_the_none_arm_is_plain_decoding_and_its_counterfactual_is_known(models):
    verifier_model, drafter_model = models
    alone = Engine(Verifier(verifier_model), [NoSpeculation()]).generate(PROMPT, max_new_tokens=20)
    assert alone.token_ids == plain_greedy(verifier_model, PROMPT, 20)
    assert alone.stats.steps == 19 and set(alone.stats.drafter_per_step) == {"none"}  # after the prefill's token
    assert alone.stats.drafted == 0 and alone.stats.tokens_per_step == [1] * 19  # one verifier row, one token a step
    arm, none = BudgetedArm(_make_inner("tree", drafter_model), 4), NoSpeculation()
    seen: list = []
    _recording(none, seen)
    engine = Engine(Verifier(verifier_model), [arm, none], UCB1(2), feedback="full")
    engine.policy.select = lambda context=None: 0
    engine.generate(PROMPT, max_new_tokens=20)
    assert seen and all((c.n_accepted, c.drafted, c.depth, c.forwards) == (0, 0, 0, []) for _, _, c in seen)


def test_a_budget_arm_scored_when_another_entry_drafted_uses_its_drafters_own_counterfactual(models):
    verifier_model, _ = models
    lookup = NGramDrafter(k=4, n_max=2, name="lookup")  # a lookup drafter: its counterfactual drafts again
    arms = budget_arms(lookup, (2, 8))
    other = PretrainedTreeDrafter(tiny_qwen(seed=5), nodes=4, depth=3, width=2, name="other")
    seen = {2: [], 8: []}
    for a in arms:
        _recording(a, seen[a.budget])
    engine = Engine(Verifier(verifier_model), [*arms, other], UCB1(3), feedback="full")
    engine.policy.select = lambda context=None: 2
    engine.generate(PROMPT, max_new_tokens=30)
    assert len(seen[2]) == len(seen[8]) > 0
    for (_, _, c2), (_, _, c8) in zip(seen[2], seen[8]):
        assert c8 is not None and c8.drafted <= 4  # k=4: every draft fits the budget of 8
        assert (c2 is c8) if c8.drafted <= 2 else c2 is None  # one counterfactual per step, when it fits


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("feedback", ["bandit", "full"])
def test_greedy_output_with_a_bandit_over_budget_arms_is_plain_greedy(models, feedback):
    verifier_model, drafter_model = models
    inner = _make_inner("fused", drafter_model)
    pool = [*budget_arms(inner, (1, 4, 16)), NoSpeculation()]
    engine = Engine(Verifier(verifier_model), pool, UCB1(4), feedback=feedback)
    result = engine.generate(PROMPT, max_new_tokens=48)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 48)
    assert len(set(result.stats.drafter_per_step)) >= 3  # the policy tried several arms


def test_choosing_arms_keeps_an_entry_others_draft_with_as_a_part_without_its_budgets():
    entries = [{"name": "lookup", "type": "ngram", "budgets": [2, 4]},
               {"name": "both", "type": "fused", "params": {"arms": ["lookup", "lookup2"]}},
               {"name": "lookup2", "type": "suffix"}]
    entries = [entries[0], entries[2], entries[1]]
    kept = select_entries(entries, ["both"])
    assert [(e["name"], e["arm"], e.get("budgets")) for e in kept] == [("lookup", False, None), ("lookup2", False, None),
                                                                       ("both", True, None)]
    assert parse_pool_config(_pool(kept)).arm_names == ["both"]
    kept = select_entries(entries, ["both", "lookup"])  # chosen as well: an arm again, with its budgets
    assert parse_pool_config(_pool(kept)).arm_names == ["lookup@2", "lookup@4", "both"]


@pytest.mark.parametrize("mode", ["dynamic", "rsd_c"])  # sample-and-match; recursive rejection (drafts with q)
def test_under_sampling_a_smaller_budgets_counterfactual_is_running_it_with_the_same_draws(models, mode):
    verifier_model, drafter_model = models
    make = lambda: PretrainedTreeDrafter(drafter_model, mode=mode, nodes=12, depth=4, width=3,
                                         branching=[3, 2] if mode == "rsd_c" else None, name="tree")
    differ = 0
    for seed in range(12):
        prompt = PROMPT[seed:] + PROMPT[:seed]  # other contexts, other draws
        inner = make()
        small, large = budget_arms(inner, (2, 12))
        seen: list = []
        _recording(small, seen)
        engine = Engine(Verifier(verifier_model), [small, large], UCB1(2), feedback="full")
        engine.policy.select = lambda context=None: 1
        ran_large = engine.generate(prompt, max_new_tokens=8, temperature=1.0, seed=seed)
        alone = Engine(Verifier(verifier_model), BudgetedArm(make(), 2))
        ran_small = alone.generate(prompt, max_new_tokens=8, temperature=1.0, seed=seed)
        c = seen[0][2]  # the first step: the same context and the same random stream in both requests
        assert (c.n_accepted, c.drafted) == (ran_small.stats.tokens_per_step[0] - 1, 2), seed
        differ += c.n_accepted != ran_large.stats.tokens_per_step[0] - 1
    assert differ > 0  # some steps accepted past the second node


def test_batched_requests_run_budget_arms_on_forks_sharing_one_drafter_each(models, monkeypatch):
    verifier_model, drafter_model = models
    inner = _make_inner("fused", drafter_model)
    pool = [*budget_arms(inner, (2, 8)), NoSpeculation()]
    engine = Engine(Verifier(verifier_model), pool, UCB1(3), feedback="full")
    used: dict[int, set] = {}  # request (its ctx.request mapping) -> the inner drafters its budget arms drafted with
    drafting = BudgetedArm.drafting  # what a request runs to draft (its propose runs it too)
    monkeypatch.setattr(BudgetedArm, "drafting", lambda self, ctx: used.setdefault(id(ctx.request), set()).add(
        id(self.inner)) or drafting(self, ctx))
    prompts = [PROMPT, PROMPT[3:], PROMPT[:9] + [5, 7]]
    results = engine.generate_batch(prompts, max_new_tokens=20, max_batch=3)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == plain_greedy(verifier_model, prompt, 20)
    assert len(used) == 3 and all(len(ids) == 1 for ids in used.values())  # one drafter per request, all budgets
    assert len(set.union(*used.values()) - {id(inner)}) == 3  # each request's own fork


def test_an_experiment_names_budget_arms_as_the_pool_does(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "coding", "turns": ["hi"]}\n')
    pool = _pool([{"name": "ngram", "type": "ngram", "budgets": [2, 8]}], no_speculation_arm=True)
    exp = load_experiment({"name": "budgets", "pools": [{"name": "p", "config": pool}], "datasets": [str(questions)],
                           "max_new_tokens": 4, "runs": [{"single": True}, {"drafters": ["ngram@2", "none"], "policy": {"name": "ucb"}}],
                           "baselines": ["plain"], "warmup": False, "plots": False}, base_dir=tmp_path)
    methods = [(m.name, m.drafters) for m in exp.pools[0].methods]
    assert methods[:3] == [("single:ngram@2", ["ngram@2"]), ("single:ngram@8", ["ngram@8"]), ("single:none", ["none"])]
    assert methods[3][1] == ["ngram@2", "none"]
