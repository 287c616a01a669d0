"""Property-based tests of the acceptance rules on random small trees and distributions (hypothesis).

For any tree and any target/drafter distributions:
* the committed nodes form a root path of the tree (each node's parent is the node before it);
* greedy acceptance is the argmax walk down the tree;
* sampling is lossless: the first committed token (an accepted child of the root, or the bonus) is
  distributed as the target's root row p[0] - for sample-and-match and for recursive rejection sampling
  with siblings drawn without replacement from q, the draft itself drawn afresh on every trial;
* the verifier's KV cache after a commit holds exactly the committed tokens.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasd.core.decoding.acceptance import accept_greedy, accept_match, accept_rejection
from metasd.core.execution.tree import Draft, children_lists
from metasd.core.execution.verifier import Verifier
from tiny import tiny_qwen

V = 5  # vocabulary of the random distributions; at most V children per node (distinct sibling tokens)


@st.composite
def shapes(draw, max_nodes: int = 6):
    """parents [n] with -1 <= parents[i] < i and at most V children per node."""
    n = draw(st.integers(0, max_nodes))
    parents: list[int] = []
    for i in range(n):
        options = [p for p in range(-1, i) if parents.count(p) < V]
        parents.append(draw(st.sampled_from(options)))
    return parents


@st.composite
def distributions(draw, rows: int):
    """[rows, V] rows of probabilities, some entries exactly zero."""
    out = []
    for _ in range(rows):
        w = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1.0)), min_size=V, max_size=V))
        if sum(w) == 0:
            w[draw(st.integers(0, V - 1))] = 1.0
        out.append(w)
    t = torch.tensor(out, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


def _tokens_for(parents: list[int], draw_token) -> list[int]:
    """Distinct tokens per sibling group: draw_token(parent, taken) -> token."""
    tokens: list[int] = []
    for i, p in enumerate(parents):
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(draw_token(p, taken))
    return tokens


def _is_root_path(draft: Draft, path: list[int]) -> bool:
    parents = draft.parents.tolist()
    return all(parents[node] == (path[i - 1] if i else -1) for i, node in enumerate(path))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_greedy_is_the_argmax_walk_along_a_root_path(data):
    parents = data.draw(shapes())
    tokens = _tokens_for(parents, lambda p, taken: data.draw(st.sampled_from([t for t in range(V) if t not in taken])))
    draft = Draft(tokens, parents)
    argmax = torch.tensor(data.draw(st.lists(st.integers(0, V - 1), min_size=len(parents) + 1, max_size=len(parents) + 1)))
    acc = accept_greedy(draft, argmax)
    assert _is_root_path(draft, acc.path)
    # the walk by hand: from the root row, follow the child holding the argmax while there is one
    kids, row, expect = children_lists(draft.parents), 0, []
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == int(argmax[row])), None)
        if nxt is None:
            break
        expect.append(nxt)
        row = nxt + 1
    assert acc.path == expect and acc.bonus == int(argmax[row])


def _first_token_frequencies(trials: int, step) -> torch.Tensor:
    counts = torch.zeros(V)
    for _ in range(trials):
        counts[step()] += 1
    return counts / trials


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sampling_rules_are_lossless_on_random_trees(data):
    parents = data.draw(shapes(max_nodes=5))
    n = len(parents)
    p = data.draw(distributions(n + 1))  # target rows: root, then one per node
    q_parent = data.draw(distributions(n + 1))  # drafter distribution at each node (row 0: the root)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    kids = children_lists(torch.tensor(parents, dtype=torch.long))

    def draw_tree() -> Draft:
        """Siblings drawn without replacement from their parent's q (as RSD-S drafts); a node whose q has no
        token left keeps a token q gives 0 (never accepted by rejection sampling)."""
        def draw(parent: int, taken: set[int]) -> int:
            q = q_parent[parent + 1].clone()
            q[list(taken)] = 0
            if q.sum() <= 0:
                return min(t for t in range(V) if t not in taken)
            return int(torch.multinomial(q / q.sum(), 1, generator=g))
        tokens = _tokens_for(parents, draw)
        probs = torch.stack([q_parent[pa + 1] for pa in parents]) if n else torch.empty(0, V)
        return Draft(tokens, parents, probs, without_replacement=True)

    def first_token(rule) -> int:
        draft = draw_tree()
        acc = rule(draft, p, g)
        assert _is_root_path(draft, acc.path)
        return int(draft.tokens[acc.path[0]]) if acc.path else acc.bonus

    trials = 2000
    for rule in (accept_match, accept_rejection):
        freq = _first_token_frequencies(trials, lambda: first_token(rule))
        tv = 0.5 * float((freq - p[0]).abs().sum())
        assert tv < 0.06, (rule.__name__, parents, p[0].tolist(), freq.tolist())  # sampling noise ~0.02 at 2000 trials
    assert len(kids) == n + 1


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_kv_cache_keeps_exactly_the_committed_tokens(data):
    model = _model()
    prompt = data.draw(st.lists(st.integers(3, 60), min_size=2, max_size=8))
    parents = data.draw(shapes(max_nodes=6))
    tokens = _tokens_for(parents, lambda p, taken: data.draw(st.sampled_from([t for t in range(3, 9) if t not in taken])))
    draft = Draft(tokens, parents)
    verifier = Verifier(model)
    verifier.prefill(torch.tensor(prompt[:-1]))
    out = verifier.verify(prompt[-1], draft)
    # any root path may be committed (greedy picks one by the logits; take the drafted one the data says)
    node_choices = [[]]
    for i in range(len(parents)):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = parents[j]
        node_choices.append(chain[::-1])
    path = data.draw(st.sampled_from(node_choices))
    verifier.commit(path)
    committed = [tokens[i] for i in path]
    fresh = Verifier(model)
    fresh.prefill(torch.tensor(prompt + committed))
    assert verifier.cached == fresh.cached == len(prompt) + len(committed)
    for a, b in zip(verifier.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    assert out.logits.shape[0] == len(parents) + 1


_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_qwen(seed=3)
    return _MODEL
