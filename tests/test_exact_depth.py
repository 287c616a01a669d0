"""Sampling exactness below the first draft token, end to end through the engine.

The two-token checks elsewhere (``max_new_tokens=2``) draft to depth 1 only. Here every drafter type that drafts with
probabilities (ratio rule, recursive rejection) or is verified by sample-and-match generates ``max_new_tokens=3`` in
N independent seeded requests, so the first step drafts to depth 2, and the joint distribution of the three tokens is
compared with the verifier's, enumerated from the verifier alone (``sampling_check.joint_check``: sequences expected
fewer than 5 times pooled into one cell, chi-square). Each test also asserts that the rule really decided at depth
2 - nodes of depth 2 verified, often accepted and often rejected - or the check would prove nothing there.

Power: a rule that is wrong only at depth 2 fails these tests while the depth-1 checks (``max_new_tokens=2``) pass:
the ratio ``r / q**2`` there fails the chain, RSD and shared-vocabulary tests with p below 1e-300; sample-and-match
taking the first child at depth 2 three times in ten when the draw matches none fails the fused, suffix and n-gram
tests with p = 6e-29, 2e-13 and 6e-22. A correct rule fails one with probability ``ALPHA`` at most; the seeds are
fixed, so a run is reproducible.

Cost: one-layer models over 8 tokens, one-token prompts where nothing needs more; a request is 2.5 to 5 model
forwards. Each test takes 15-23 s of one core (5,000 requests), the file about three and a half minutes.
"""
import pytest

from metasd.core import Engine, Verifier
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter
from metasd.drafters.fused import FusedDrafter
from metasd.drafters.suffix import SuffixDrafter
from sampling_check import JointCheck, joint_check
from tiny import as_llama, letter_tokenizer, tiny_qwen

V = 8
SHARP = 20.0  # verifier logit scale: about 90 three-token sequences are expected >= 5 times in N draws (94% of the mass)
N = 5000
ALPHA = 1e-4  # a correct rule passes with probability 1 - ALPHA; a wrong one at depth 2 scores far below
PROMPT = [3]  # one token: no prefill forward
#: for prompt lookup: [3] and the verifier's 16 greedy tokens after it, which settle into a cycle the verifier
#: samples too: the n-gram draft (the cycle) is accepted at depth 2 in about 40% of the requests
NGRAM_PROMPT = [3, 0, 4, 7, 6, 2, 5, 2, 5, 2, 5, 2, 5, 2, 5, 2, 5]
#: for suffix trees: [3] and 40 tokens the verifier sampled after it (seed 5), so the end of the text has
#: been seen before with several continuations, most of them likely: suffix trees branch at depth 2 and are
#: accepted there about half the time
SUFFIX_PROMPT = [3, 4, 7, 6, 2, 5, 6, 2, 7, 2, 6, 2, 5, 2, 5, 2, 5, 2, 5, 2, 5, 2, 2, 5, 2, 5, 2, 5, 2, 5, 5, 2, 5, 5,
                 6, 2, 5, 2, 0, 2, 5]


@pytest.fixture(scope="module")
def verifier():
    return tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP)


@pytest.fixture(scope="module")
def drafter_model():
    """The verifier's weights, less sharp: q differs from p, so the ratio rule rejects often and the residual
    matters, while most drafts still pass depth 1 and reach the rule at depth 2."""
    return tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP / 2)


def check_at_depth(engine, prompt=PROMPT, **sampling) -> JointCheck:
    """The joint check of three tokens, and that the acceptance rule decided at depth 2 in many steps both ways."""
    check = joint_check(engine, prompt, N, length=3, **sampling)
    print(check)
    assert check.pvalue > ALPHA, f"three sampled tokens do not follow the verifier: {check}"
    tried, taken = check.tried_at(2), check.taken_at(2)
    assert taken >= N // 10 and tried - taken >= N // 20, f"depth 2 was not exercised both ways: {check}"
    return check


def test_pretrained_chain_ratio_rule(verifier, drafter_model):
    check_at_depth(Engine(Verifier(verifier), PretrainedDrafter(drafter_model, k=3)))


@pytest.mark.parametrize("params", [dict(mode="rsd_c", branching=[2, 2], nodes=6),
                                    dict(mode="rsd_s", width=3, nodes=6)], ids=["rsd_c", "rsd_s"])
def test_rsd_tree_recursive_rejection(verifier, drafter_model, params):
    check_at_depth(Engine(Verifier(verifier), PretrainedTreeDrafter(drafter_model, depth=2, **params)))


def test_shared_vocabulary_chain_ratio_rule():
    """Cross-tokenizer drafting with the vocabularies' shared tokens (drafters/shared_vocab.py): the verifier's
    letters and 'ab', the drafter's letters in another order and 'cd'. Drafted among the letters, verified by the
    ratio rule; 'ab' comes only from the residual."""
    vtok, dtok = letter_tokenizer("abcde ", [("a", "b")]), letter_tokenizer(" edcba", [("c", "d")])
    verifier = tiny_qwen(seed=7, vocab=len(vtok), layers=1, logit_scale=SHARP)  # 'ab' in 18% of the sequences
    v_ids = vtok.get_vocab()
    model = as_llama(tiny_qwen(seed=7, vocab=len(vtok), layers=1, logit_scale=SHARP / 2), len(dtok),
                     {d: v_ids[c] for c, d in dtok.get_vocab().items() if c in v_ids})
    drafter = PretrainedDrafter(model, dtok, k=3, verifier_tokenizer=vtok, name="letters")
    check_at_depth(Engine(Verifier(verifier, vtok), drafter), prompt=[v_ids["a"]])
    assert drafter.shared is not None and drafter.shared.size == 6  # the ratio rule ran, not sample-and-match


def test_fused_tree_sample_and_match(verifier, drafter_model):
    """A model chain sampled from q and prompt lookup merged into one tree (the cascade's arms): branches from two
    proposals, one of them random, verified by sample-and-match."""
    arms = [NGramDrafter(k=3, n_max=3, name="lookup"), PretrainedDrafter(drafter_model, k=3, name="chain")]
    check_at_depth(Engine(Verifier(verifier), FusedDrafter(arms)), prompt=NGRAM_PROMPT)


def test_static_tree_sample_and_match(verifier, drafter_model):
    """A fixed-shape top-k tree drafted on the device (no probabilities): sample-and-match at depth 2 and beyond."""
    check_at_depth(Engine(Verifier(verifier), StaticTreeDrafter(drafter_model, widths=[2, 2, 1], name="static")))


# The lookup drafters draw nothing from the request's generator, so sample-and-match commits exactly the tokens plain
# sampling commits with the same seed: their samples (and p-values) are plain sampling's on the same prompt, which the
# tests below check the engine keeps while it verifies drafts of depth 2 (tree rows, masks, positions, cache commits).
def test_suffix_tree_sample_and_match(verifier):
    drafter = SuffixDrafter(mode="tree", max_depth=3, max_nodes=8, min_prob=0.05, spec_factor=4.0)
    check_at_depth(Engine(Verifier(verifier), drafter), prompt=SUFFIX_PROMPT)


def test_ngram_chain_sample_and_match(verifier):
    check_at_depth(Engine(Verifier(verifier), NGramDrafter(k=3, n_max=3)), prompt=NGRAM_PROMPT)



#: truncated sampling: each setting drops about 7% of the verifier's mass at the first position (the tokens after its
#: 4 most likely), so q and p both have zeros, and a drafted token the verifier's truncation removed must be rejected
#: and its mass never returned
TRUNCATIONS = {"min_p": dict(min_p=0.1), "top_p": dict(top_p=0.9), "top_k_min_p": dict(top_k=4, min_p=0.05)}


def test_truncations_drop_mass(verifier):
    """The truncations above are not vacuous: each of top-k, top-p and min-p alone removes >= 5% of the mass the
    verifier's first position gives (a verifier that ignored it fails the chi-square test below)."""
    import torch

    from metasd.core.decoding.sampling import SamplingParams, process_logits
    with torch.no_grad():
        logits = verifier(torch.tensor([PROMPT])).logits[0, -1]  # [V]
    full = process_logits(logits, SamplingParams(temperature=1.0))
    for setting in (dict(top_k=4), dict(top_p=0.9), dict(min_p=0.1)):
        kept = process_logits(logits, SamplingParams(temperature=1.0, **setting)) > 0
        assert full[~kept].sum() >= 0.05, setting


@pytest.mark.parametrize("name, tree", [("min_p", False), ("top_p", False), ("top_k_min_p", True)])
def test_truncated_sampling(verifier, drafter_model, name, tree):
    """The ratio rule (a chain) and recursive rejection (a tree) with truncated p and q."""
    drafter = (PretrainedTreeDrafter(drafter_model, depth=2, mode="rsd_c", branching=[2, 2], nodes=6) if tree
               else PretrainedDrafter(drafter_model, k=3))
    check_at_depth(Engine(Verifier(verifier), drafter), temperature=1.0, **TRUNCATIONS[name])
