"""The fixed-shape runner behind CUDA graphs (metasd/core/execution/graph_runner.py), run eagerly on the CPU over the
very buffers, buckets, masks and cache writes a captured graph replays: greedy identity with plain decoding for
chains and trees across token and width buckets and across requests, the same logits and hidden states as the eager
verifier, sampling exactness through it, and the settings refused where they cannot hold."""
from __future__ import annotations

import pytest
import torch

from metasd.config import ConfigError, parse_pool_config
from metasd.core import Engine, Verifier
from metasd.core.execution.graph_runner import GraphRunner, resolve_graphs, token_bucket
from metasd.core.execution.tree import Draft
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from tiny import plain_greedy, tiny_qwen

PROMPT = [5, 17, 3, 59, 42, 8, 23, 61]


@pytest.fixture(scope="module")
def models():
    return tiny_qwen(seed=3, context=1024), tiny_qwen(seed=4, layers=1, context=1024)


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram"])
def test_greedy_identity_through_fixed_shapes(models, kind):
    """300 tokens (the attended width passes a 256-column bucket mid-request, the buffers grow once), then a second
    request on the same buffers: both equal plain greedy decoding, and every verify forward ran at a fixed shape."""
    model, drafter_model = models
    drafter = {"chain": lambda: PretrainedDrafter(drafter_model, k=3),
               "tree": lambda: PretrainedTreeDrafter(drafter_model, nodes=8, depth=3, width=2),
               "ngram": lambda: NGramDrafter(k=4)}[kind]()
    verifier = Verifier(model, fixed_shapes=True)
    engine = Engine(verifier, drafter, check_tokenizers=False)
    assert engine.generate(PROMPT, max_new_tokens=300).token_ids == plain_greedy(model, PROMPT, 300)
    widths = {w for _, w in verifier.runner.shapes}
    assert {256, 512} <= widths, f"the request did not cross a width bucket: {sorted(verifier.runner.shapes)}"
    first = verifier.runner
    second = PROMPT[::-1]
    assert engine.generate(second, max_new_tokens=40).token_ids == plain_greedy(model, second, 40)
    assert verifier.runner is first and first.stats.eager > 0 and first.stats.captured == 0  # the CPU: never captured


@torch.inference_mode()
def test_a_tree_verify_matches_the_eager_verifier(models):
    """The same tree verified by the eager path and the fixed-shape path: logits and hidden states agree, and the
    accepted path's commit leaves the same cache (the next step's logits agree)."""
    model, _ = models
    draft = Draft(tokens=[3, 4, 5, 6, 7], parents=[-1, -1, 1, 1, 3])
    outs = []
    for fixed in (False, True):
        v = Verifier(model, fixed_shapes=fixed)
        v.prefill(torch.tensor(PROMPT[:-1]), hidden_layers=(1, 2), reserve=64)
        out = v.verify(PROMPT[-1], draft)
        v.commit([1, 3, 4], out)
        after = v.verify(9, Draft(tokens=[10, 11], parents=[-1, 0]))
        outs.append((out, after, v))
    (eager, eager_next, ve), (fixed, fixed_next, vf) = outs
    assert vf.runner is not None and ve.runner is None
    assert torch.allclose(eager.logits, fixed.logits, atol=1e-5)
    assert all(torch.allclose(eager.hidden[k], fixed.hidden[k], atol=1e-5) for k in (1, 2))
    assert torch.allclose(eager_next.logits, fixed_next.logits, atol=1e-5)
    assert vf.cached == ve.cached == len(PROMPT) - 1 + 4 + 3


@torch.inference_mode()
def test_outputs_are_copies_the_next_forward_cannot_overwrite(models):
    model, _ = models
    v = Verifier(model, fixed_shapes=True)
    v.prefill(torch.tensor(PROMPT[:-1]))
    first = v.verify(PROMPT[-1], Draft.chain([1, 2, 3]))
    kept = first.logits.clone()
    v.commit([0], first)
    v.verify(1, Draft.chain([4, 5, 6]))  # the same (4 tokens, 256 columns) shape: its buffers are written again
    assert torch.equal(first.logits, kept)


def test_buckets_and_settings():
    assert [token_bucket(n) for n in (1, 2, 3, 5, 9, 100, 128)] == [1, 2, 4, 8, 16, 128, 128]
    assert token_bucket(129) is None
    assert resolve_graphs("auto", torch.device("cpu"), "v") is False
    assert resolve_graphs("off", torch.device("cpu"), "v") is False
    assert resolve_graphs("fixed", torch.device("cpu"), "v") is False  # fixed shapes, never captured
    with pytest.raises(ValueError, match=r"my-verifier: graphs='on' needs a CUDA device"):
        resolve_graphs("on", torch.device("cpu"), "my-verifier")
    with pytest.raises(ValueError, match=r"graphs must be one of"):
        resolve_graphs("yes", torch.device("cpu"), "v")


def test_a_forward_past_the_largest_bucket_is_refused(models):
    model, _ = models
    v = Verifier(model, fixed_shapes=True)
    v.prefill(torch.tensor(PROMPT[:-1]))
    runner = GraphRunner(model, v.cache, capture=False, buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="5 tokens in one forward; the largest bucket is 4"):
        runner.forward(torch.arange(5), torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril())


def test_pool_config_refuses_graphs_on_a_cpu():
    pool = {"verifier": {"model": "bundled:x", "device": "cpu", "graphs": "on"}}
    with pytest.raises(ConfigError, match=r"graphs"):
        parse_pool_config(pool)
    pool["verifier"]["graphs"] = "off"
    assert parse_pool_config(pool).verifier.graphs == "off"


def test_sampling_stays_exact_at_depth_two_through_fixed_shapes():
    """The chain's ratio rule and an RSD tree's recursive rejection through the fixed-shape verifier (the joint check
    of tests/test_exact_depth.py)."""
    from test_exact_depth import SHARP, V, check_at_depth

    verifier = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP)
    drafter_model = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP / 2)
    check_at_depth(Engine(Verifier(verifier, fixed_shapes=True), PretrainedDrafter(drafter_model, k=3)))
    tree = PretrainedTreeDrafter(drafter_model, depth=2, mode="rsd_c", branching=[2, 2], nodes=6)
    check_at_depth(Engine(Verifier(verifier, fixed_shapes=True), tree))
