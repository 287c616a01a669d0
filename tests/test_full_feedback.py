"""Full-information feedback: every arm that can be scored without running it (lookup drafters, model drafters kept in
step with ``track``) is scored after each step, and its counterfactual equals what running it would have given."""
import numpy as np
import pytest
import torch

from metasd.core import Engine, StepContext, Verifier
from metasd.core.decoding.acceptance import accept_greedy
from metasd.core.decoding.sampling import SamplingParams
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from metasd.drafters.suffix import SuffixDrafter
from metasd.policies import UCB1, Hedge
from tiny import plain_greedy, tiny_qwen

# repetitive, so that lookups match; the verifier and a softer copy of it as the model drafters
PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5, 7, 12, 9, 33, 12]


@pytest.fixture(scope="module")
def models():
    return tiny_qwen(seed=0, logit_scale=8.0), tiny_qwen(seed=0, logit_scale=3.0)


def _recording(drafter, seen: list):
    original = drafter.counterfactual

    def record(ctx, feedback):
        result = original(ctx, feedback)
        seen.append((ctx.tokens.tolist(), ctx.max_depth, list(feedback.committed), result))
        return result

    drafter.counterfactual = record


def _true_acceptance(verifier_model, fresh_drafter, tokens: list[int], max_depth: int) -> int:
    """Run the arm for real at that context: its draft, verified greedy by a fresh verifier."""
    ctx = StepContext(tokens=torch.tensor(tokens), prompt_len=len(PROMPT), max_depth=max_depth, sampling=SamplingParams())
    fresh_drafter.begin(ctx)
    draft = fresh_drafter.propose(ctx)
    verifier = Verifier(verifier_model)
    verifier.prefill(torch.tensor(tokens[:-1]))
    out = verifier.verify(tokens[-1], draft)
    return accept_greedy(draft, out.logits.argmax(-1)).n_accepted


@pytest.mark.parametrize("arm", ["ngram", "suffix", "chain", "tree"])
def test_a_counterfactual_equals_what_running_the_arm_gives(models, arm):
    verifier_model, drafter_model = models
    make = {"ngram": lambda: NGramDrafter(k=4, n_max=2, name="arm"),
            "suffix": lambda: SuffixDrafter(max_depth=4, name="arm"),
            "chain": lambda: PretrainedDrafter(drafter_model, k=4, track=True, name="arm"),
            "tree": lambda: PretrainedTreeDrafter(drafter_model, nodes=64, depth=4, width=2, track=True, name="arm")}[arm]
    chosen = PretrainedDrafter(tiny_qwen(seed=5), k=3, name="chosen")  # another model: steps of its own
    scored = make()
    seen: list = []
    _recording(scored, seen)
    engine = Engine(Verifier(verifier_model), [chosen, scored], UCB1(2), feedback="full")
    engine.policy.select = lambda context=None: 0  # always the other arm, so every step scores ``scored``
    result = engine.generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 30)  # exactness untouched
    assert len(seen) == result.stats.steps and any(c.n_accepted > 0 for _, _, _, c in seen)
    for tokens, max_depth, committed, c in seen:
        truth = _true_acceptance(verifier_model, make(), tokens, max_depth)
        if c.censored:  # its draft went past the verified text: a lower bound, at the verified length
            assert c.n_accepted == len(committed) <= truth
        elif arm == "tree":  # the node budget is not modeled: at most what the path rule allows
            assert c.n_accepted >= truth
        else:
            assert c.n_accepted == truth, (tokens, committed)


def test_the_policy_learns_from_every_scored_arm_and_tracking_is_priced(models):
    verifier_model, drafter_model = models
    pool = [PretrainedDrafter(drafter_model, k=3, track=True, name="chain"), NGramDrafter(k=4, n_max=2, name="ngram")]
    rounds = []
    policy = UCB1(2)
    observe = policy.observe
    policy.observe = lambda arm, rewards, context=None: rounds.append((arm, dict(rewards))) or observe(arm, rewards, context)
    full = Engine(Verifier(verifier_model), pool, policy, feedback="full").generate(PROMPT, max_new_tokens=24)
    assert full.token_ids == plain_greedy(verifier_model, PROMPT, 24)
    assert rounds and all(len(r) == 2 and arm in r for arm, r in rounds)  # both arms scored every step
    assert policy.counts.sum() == 2 * len(rounds) and policy.t == len(rounds)
    assert "ngram" in full.stats.drafter_per_step and "chain" in full.stats.drafter_per_step

    # the chain arm's tracking forwards are real work: with the n-gram arm drafting every step, the same steps (same
    # drafts, same commits) earn less under full feedback, whose steps also pay for keeping the chain in step
    def ngram_only(feedback):
        pinned = UCB1(2)
        pinned.select = lambda context=None: 1
        return Engine(Verifier(verifier_model), pool, pinned, feedback=feedback).generate(PROMPT, max_new_tokens=24)

    full, bandit = ngram_only("full"), ngram_only("bandit")
    assert bandit.token_ids == full.token_ids == plain_greedy(verifier_model, PROMPT, 24)
    assert full.stats.drafter_per_step == bandit.stats.drafter_per_step == ["ngram"] * full.stats.steps
    assert full.stats.tokens_per_step == bandit.stats.tokens_per_step
    assert full.stats.modeled_cost > bandit.stats.modeled_cost
    assert all(f < b for f, b in zip(full.stats.rewards, bandit.stats.rewards)), (full.stats.rewards,
                                                                                  bandit.stats.rewards)


def test_full_feedback_needs_a_reward_with_counterfactual_values(models):
    with pytest.raises(ValueError, match="feedback 'full' needs a reward"):
        Engine(Verifier(models[0]), [NGramDrafter(name="a"), NGramDrafter(name="b")], UCB1(2),
               reward="block_divergence", feedback="full")


def test_hedge_prefers_the_arm_with_the_higher_counterfactual_rewards():
    policy = Hedge(3, seed=0)
    rng = np.random.default_rng(0)
    means = [0.2, 0.8, 0.5]
    picks = []
    for _ in range(300):
        arm = policy.select()
        picks.append(arm)
        policy.observe(arm, {a: float(np.clip(rng.normal(m, 0.1), 0, 1)) for a, m in enumerate(means)})
    assert np.bincount(picks[-100:], minlength=3).argmax() == 1
    assert policy.full_info.all()


def test_hedge_weights_a_bandit_fed_arm_by_its_probability():
    """An arm scored only when played adds reward / p: its score does not fall behind full-information arms merely
    because it is scored less often."""
    policy = Hedge(2, seed=0, gamma=0.0, discount=1.0, reward_scale=1.0)
    policy.last_p = np.array([0.25, 0.75])
    policy.observe(0, {0: 0.5, 1: 0.5})  # arm 1 scored without being played: full information
    assert policy.scores.tolist() == [0.5 / 0.25, 0.5]  # arm 0 (never scored unplayed): importance-weighted
    policy.last_p = np.array([0.5, 0.5])
    policy.observe(1, {1: 0.5})
    assert policy.scores.tolist() == [2.0, 1.0]  # arm 1 is full-information: no weight


def test_arms_that_a_chosen_fused_arm_drafted_with_are_scored_after_their_caches_settle(models):
    """A pool offering a tracked tree, a suffix drafter and their fusion: when the fusion drafts, the tree's cache holds
    its draft tree until it is told what was accepted; its counterfactual (a forward over the committed tokens) must
    come after that, or the cache is corrupted and later drafts go wrong."""
    from metasd.drafters.fused import FusedDrafter

    verifier_model, drafter_model = models
    tree = PretrainedTreeDrafter(drafter_model, nodes=8, depth=3, width=2, track=True, name="tree")
    suffix = SuffixDrafter(max_depth=4, name="suffix")
    pool = [tree, suffix, FusedDrafter([tree, suffix], name="fused")]
    policy = UCB1(3)
    policy.select = lambda context=None: 2  # the fusion drafts every step
    full = Engine(Verifier(verifier_model), pool, policy, feedback="full").generate(PROMPT, max_new_tokens=40)
    alone = Engine(Verifier(verifier_model), FusedDrafter([PretrainedTreeDrafter(drafter_model, nodes=8, depth=3,
                                                                                 width=2, name="t"),
                                                           SuffixDrafter(max_depth=4, name="s")])).generate(
        PROMPT, max_new_tokens=40)
    assert full.token_ids == alone.token_ids == plain_greedy(verifier_model, PROMPT, 40)
    assert full.stats.tokens_per_step == alone.stats.tokens_per_step  # scoring the arms changed no draft
    assert policy.counts[0] == policy.counts[1] == full.stats.steps  # both components scored every step
