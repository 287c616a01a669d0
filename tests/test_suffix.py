"""Suffix drafter (drafters/suffix.py) on hand-built token arrays, checked against brute-force definitions (counts,
longest matches, path probabilities recomputed from the token lists), and end to end on a tiny verifier."""
import random
from types import SimpleNamespace

import pytest
import torch

from metasd.core.engine import Engine
from metasd.core.decoding.sampling import SamplingParams
from metasd.core.decoding.drafter import StepContext
from metasd.core.execution.verifier import Verifier
from metasd.drafters.suffix import ROOT, SuffixDrafter, SuffixTrie
from tiny import plain_greedy


def ctx(tokens, max_depth: int = 32) -> StepContext:
    return StepContext(tokens=torch.tensor(tokens, dtype=torch.long), prompt_len=len(tokens), max_depth=max_depth,
                       sampling=SamplingParams())


def request(drafter: SuffixDrafter, tokens: list[int], prompt_len: int | None = None) -> None:
    """One request as the engine runs it: begin with the prompt, draft over the whole text, end."""
    drafter.begin(ctx(tokens[:prompt_len or len(tokens)]))
    drafter.propose(ctx(tokens))
    drafter.end()


# ------------------------------------------------------------------ definitions, by brute force
def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int]]:
    """{string: (occurrences, occurrences followed by a token)} for every substring of <= depth tokens."""
    count: dict[tuple[int, ...], int] = {}
    for x in seqs:
        for i in range(len(x)):
            for j in range(i + 1, min(i + depth, len(x)) + 1):
                count[tuple(x[i:j])] = count.get(tuple(x[i:j]), 0) + 1
    cont = {s: 0 for s in count}
    for s, c in count.items():
        if len(s) > 1:
            cont[s[:-1]] += c
    return {s: (c, cont[s]) for s, c in count.items()}


def brute_longest(tokens: list[int], max_match: int) -> int:
    """Longest suffix (<= max_match tokens) with an occurrence that ends before the last token."""
    T = len(tokens)
    for L in range(min(max_match, T - 1), 0, -1):
        if any(tokens[i:i + L] == tokens[T - L:] for i in range(T - L)):
            return L
    return 0


def path_strings(draft, matched: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The string each draft node spells: the matched suffix, then the tokens on its path."""
    out: list[tuple[int, ...]] = []
    for t, p in zip(draft.tokens.tolist(), draft.parents.tolist()):
        out.append((matched if p < 0 else out[p]) + (t,))
    return out


def path_prob(counts, s: tuple[int, ...], match_len: int) -> float:
    """Product of continuation frequencies count(prefix + t) / cont(prefix) from the match to ``s``."""
    p = 1.0
    for end in range(match_len + 1, len(s) + 1):
        p *= counts[s[:end]][0] / counts[s[:end - 1]][1]
    return p


def node_of(trie: SuffixTrie, s: tuple[int, ...]) -> int:
    u = ROOT
    for t in s:
        u = trie.child(u, t)
        assert u >= 0, f"no node for {s}"
    return u


def check_stamps(trie: SuffixTrie, seqs: list[list[int]], strings=None) -> None:
    """Every node's ``last`` (of ``strings``' nodes; default: all) is the stamp of the latest append that ended an
    occurrence of its string (stamps count the appends of ``seqs``, in order, from 1)."""
    latest, stamp = {}, 0
    for x in seqs:
        for j in range(len(x)):
            stamp += 1
            for i in range(max(j + 1 - trie.depth, 0), j + 1):
                latest[tuple(x[i:j + 1])] = stamp
    strings = trie.as_dict() if strings is None else strings
    assert {s: trie.last[node_of(trie, s)] for s in strings} == {s: latest[s] for s in strings}


def check_links(trie: SuffixTrie) -> None:
    """Every node's suffix link is the node of its string without the first token."""
    for s in trie.as_dict():
        assert trie.link[node_of(trie, s)] == node_of(trie, s[1:]), f"bad suffix link at {s}"


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# ------------------------------------------------------------------ matching and drafting
def test_longest_match_is_found_and_its_continuation_drafted():
    # "2 3" last occurred before 5, but the longest earlier suffix, "1 2 3", continued with 4
    tokens = [7, 3, 8, 1, 2, 3, 4, 2, 3, 5, 1, 2, 3]
    drafter = SuffixDrafter(mode="chain", spec_factor=2.0)
    draft = drafter.propose(ctx(tokens))
    assert drafter.longest_match(torch.tensor(tokens)) == brute_longest(tokens, 16) == 3
    assert draft.meta == {"match_len": 3, "from_cache": False}
    assert draft.tokens.tolist() == [4, 2, 3, 5, 1, 2]  # 2 * 3 tokens of what followed "1 2 3"
    assert SuffixDrafter(mode="chain", max_match=2, spec_factor=2.0).propose(ctx(tokens)).tokens.tolist()[:1] == [5]


def test_no_match_gives_an_empty_draft():
    drafter = SuffixDrafter()
    assert len(drafter.propose(ctx([4, 5, 6, 7]))) == 0 and drafter.longest_match([4, 5, 6, 7]) == 0
    assert drafter.propose(ctx([4, 5, 6, 7, 5])).tokens.tolist() == [6]  # "5" did occur before, then 6


def test_tree_ranks_continuations_by_frequency():
    # after "1 2": 3 three times, 4 twice, 5 once (5 the most recent, 3 the least)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 4, 1, 2, 5, 9, 1, 2]
    draft = SuffixDrafter(max_depth=1, spec_factor=10.0, min_prob=0.0).propose(ctx(tokens))
    assert draft.tokens.tolist() == [3, 4, 5] and draft.parents.tolist() == [-1, -1, -1]
    chain = SuffixDrafter(mode="chain", max_depth=1, spec_factor=10.0, min_prob=0.0).propose(ctx(tokens))
    assert chain.tokens.tolist() == [3]
    # equal counts: the most recent continuation first
    assert SuffixDrafter(mode="chain", min_prob=0.0).propose(ctx([1, 2, 3, 1, 2, 4, 1, 2])).tokens.tolist()[:1] == [4]


@pytest.mark.parametrize("seed", range(6))
def test_tree_holds_the_most_probable_continuations(seed):
    """On random text, the tree is the ``size`` most probable continuations of the match (path probability
    recomputed from the token list), best first, none below min_prob, none deeper than max_depth."""
    rng = random.Random(seed)
    tokens = random_tokens(rng, 80, 3) + [0, 1]
    min_prob, max_depth, max_nodes = [0.0, 0.05, 0.2][seed % 3], 3, 10
    drafter = SuffixDrafter(max_match=6, max_depth=max_depth, max_nodes=max_nodes, spec_factor=3.0, min_prob=min_prob)
    draft = drafter.propose(ctx(tokens))
    L = draft.meta["match_len"]
    assert L == brute_longest(tokens, 6) > 0
    counts = brute_counts([tokens[:-1]], 6 + max_depth)  # the context's last token ends no continuation
    matched = tuple(tokens[len(tokens) - L:])
    drafted = [path_prob(counts, s, L) for s in path_strings(draft, matched)]
    every = sorted((path_prob(counts, s, L) for s in counts
                    if len(s) > L and s[:L] == matched and len(s) - L <= max_depth), reverse=True)
    every = [p for p in every if p >= min_prob]
    size = min(max_nodes, int(3.0 * L))
    assert drafted == sorted(drafted, reverse=True)  # best first
    assert drafted == pytest.approx(every[:size])  # the most probable ones, as many as allowed
    assert draft.depth <= max_depth and len(draft) > 1


def test_min_prob_bounds_the_product_along_the_path():
    # after "1 2": 3 four times, 6 once (P 0.8, 0.2); after "1 2 3": 4 and 5 twice each (P 0.8 * 0.5 = 0.4)
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 6, 1, 2]

    def drafted(min_prob: float) -> set[tuple[int, ...]]:
        draft = SuffixDrafter(max_depth=2, spec_factor=10.0, min_prob=min_prob).propose(ctx(tokens))
        return set(path_strings(draft, ()))

    assert drafted(0.81) == set()
    assert drafted(0.41) == {(3,)}  # 4 and 5 follow "1 2 3" half the time each, but P(3, 4) = 0.4
    assert drafted(0.39) == {(3,), (3, 4), (3, 5)}
    assert drafted(0.21) == {(3,), (3, 4), (3, 5)}
    chain = SuffixDrafter(mode="chain", max_depth=2, spec_factor=10.0, min_prob=0.41).propose(ctx(tokens))
    assert chain.tokens.tolist() == [3]  # the chain too: 0.8 * 0.5 < 0.41
    assert drafted(0.19) == {(3,), (3, 4), (3, 5), (6,), (6, 1)}  # 1 always followed "1 2 6": P(6, 1) = 0.2


@pytest.mark.parametrize("match_len", [1, 2, 4, 6])
def test_draft_size_grows_with_the_match_length(match_len):
    tokens = list(range(10, 30)) + list(range(10, 10 + match_len))  # match_len tokens repeat, then nothing does
    for mode in ("tree", "chain"):
        draft = SuffixDrafter(mode=mode, max_depth=20).propose(ctx(tokens))
        assert draft.meta["match_len"] == match_len
        assert draft.tokens.tolist() == list(range(10 + match_len, 10 + 2 * match_len))  # spec_factor 1


def test_spec_factor_and_depth_limits_bound_the_draft():
    tokens = list(range(10, 30)) + list(range(10, 15))  # a match of 5, then 20 tokens followed it

    def size(max_depth: int = 20, ctx_depth: int = 32, **kw) -> int:
        return len(SuffixDrafter(max_depth=max_depth, **kw).propose(ctx(tokens, ctx_depth)))

    for mode in ("tree", "chain"):
        assert [size(spec_factor=f, mode=mode) for f in (0.2, 0.5, 1.0, 1.6)] == [1, 2, 5, 8]
        assert size(spec_factor=10.0, mode=mode, max_depth=4) == 4
        assert size(spec_factor=10.0, mode=mode, ctx_depth=3) == 3
        assert size(spec_factor=10.0, mode=mode, ctx_depth=0) == 0
    assert size(spec_factor=10.0, mode="chain") == 20  # max_depth
    assert size(spec_factor=10.0) == 16 and size(spec_factor=10.0, max_nodes=6) == 6  # max_nodes (tree only)
    assert size(spec_factor=10.0, max_nodes=6, mode="chain") == 20


# ------------------------------------------------------------------ the structure
def test_incremental_structure_equals_one_built_from_scratch():
    rng = random.Random(0)
    tokens = random_tokens(rng, 150, 4)
    drafter = SuffixDrafter(mode="chain", max_match=4, max_depth=3)
    depth = drafter.trie_depth
    n, trie = 5, None
    while n < len(tokens):
        draft = drafter.propose(ctx(tokens[:n]))
        trie = trie or drafter.trie
        assert drafter.trie is trie and trie._stamp == n  # the same trie, each token appended once
        assert draft.meta["match_len"] == drafter.longest_match(tokens[:n]) == brute_longest(tokens[:n], 4)
        committed = tokens[n:n + rng.randint(1, 4)]
        if rng.random() < 0.7:  # else another drafter's step: caught up at the next propose
            drafter.observe(SimpleNamespace(committed=committed))
        n += len(committed)
    drafter.longest_match(tokens)
    scratch = SuffixTrie(depth)
    scratch.extend(tokens)
    assert trie.as_dict() == scratch.as_dict() == brute_counts([tokens], depth)
    assert trie.n_nodes == scratch.n_nodes == len(scratch.as_dict()) + 1
    check_links(trie)
    check_links(scratch)
    check_stamps(scratch, [tokens])


def test_remove_leaves_the_trie_of_the_other_sequences():
    rng = random.Random(1)
    seqs = [random_tokens(rng, rng.randint(1, 40), 3) for _ in range(5)]
    trie = SuffixTrie(5)
    for s in seqs[:4]:
        trie.extend(s)
    trie.remove(seqs[1])
    assert trie.as_dict() == brute_counts([seqs[0], seqs[2], seqs[3]], 5)
    trie.extend(seqs[4])  # reuses freed ids
    assert trie.as_dict() == brute_counts([seqs[0], seqs[2], seqs[3], seqs[4]], 5)
    assert trie.n_nodes == len(trie.as_dict()) + 1
    check_links(trie)
    check_stamps(trie, seqs, strings=brute_counts([seqs[4]], 5))  # the last sequence's strings: its stamps
    fresh = SuffixTrie(5)  # the same sequences in a trie with nothing freed: new ids only
    fresh.extend(seqs[0] + [7] * 6 + seqs[0])  # a repeat, then a run: strings met again and strings new
    for x in seqs[1:]:
        fresh.extend(x)
    assert fresh.as_dict() == brute_counts([seqs[0] + [7] * 6 + seqs[0], *seqs[1:]], 5)
    check_links(fresh)
    check_stamps(fresh, [seqs[0] + [7] * 6 + seqs[0], *seqs[1:]])
    for s in (seqs[0], seqs[2], seqs[3], seqs[4]):
        trie.remove(s)
    assert trie.as_dict() == {} and trie.n_nodes == 1 and trie.cont[ROOT] == 0
    with pytest.raises(KeyError):
        trie.remove([0, 1])


# ------------------------------------------------------------------ across requests
def test_cross_request_drafts_text_of_an_earlier_request_and_is_off_by_default():
    earlier, prompt = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 4, 5, 6]  # the new prompt repeats nothing of its own
    on, off = SuffixDrafter(mode="chain", cross_request=True), SuffixDrafter(mode="chain")
    assert on.propose(ctx(prompt)).tokens.tolist() == []  # nothing cached yet
    on.end()
    for drafter in (on, off):
        request(drafter, earlier, prompt_len=3)
        drafter.begin(ctx(prompt))
    draft = on.propose(ctx(prompt))
    assert draft.tokens.tolist() == [7, 8] and draft.meta == {"match_len": 3, "from_cache": True}
    assert on.longest_match(prompt) == 3
    assert len(off.propose(ctx(prompt))) == 0 and off.longest_match(prompt) == 0 and off.cache is None


def test_request_text_wins_a_tie_and_a_longer_cached_match_wins():
    drafter = SuffixDrafter(mode="chain", cross_request=True)
    request(drafter, [1, 2, 3, 4, 20, 21, 22])
    # "3 4": followed by 99 in the request, by 20 in the cache: same length, the request's own text
    draft = drafter.propose(ctx([30, 3, 4, 99, 31, 3, 4]))
    assert draft.tokens.tolist()[0] == 99 and draft.meta == {"match_len": 2, "from_cache": False}
    drafter.begin(ctx([2, 3, 4]))  # a new request (the probe above is not cached: it never ended)
    # "2 3 4" in the request (then 99), "1 2 3 4" in the cache (then 20): the longer match
    draft = drafter.propose(ctx([2, 3, 4, 99, 1, 2, 3, 4]))
    assert draft.tokens.tolist()[0] == 20 and draft.meta == {"match_len": 4, "from_cache": True}


def test_cache_match_follows_suffix_links_and_is_the_longest():
    drafter = SuffixDrafter(mode="chain", cross_request=True)
    request(drafter, [1, 2, 3, 4, 3, 9, 10, 11])
    # "1 2 3" matched, then 9: the cache has no "1 2 3 9" nor "2 3 9", but "3 9" (then 10, 11)
    assert drafter.longest_match([1, 2, 3, 9]) == 2
    assert drafter.propose(ctx([1, 2, 3, 9])).tokens.tolist() == [10, 11]
    rng = random.Random(3)  # random cached requests and requests: the match is the brute-force longest
    drafter = SuffixDrafter(cross_request=True, max_match=5, max_depth=2)
    cached = [random_tokens(rng, rng.randint(5, 30), 4) for _ in range(4)]
    for tokens in cached:
        request(drafter, tokens)
    for _ in range(5):
        tokens = random_tokens(rng, 40, 4)
        drafter.begin(ctx(tokens[:3]))
        for n in range(3, len(tokens) + 1):
            in_cache = max((L for L in range(1, min(5, n) + 1) for x in cached
                            if any(x[i:i + L] == tokens[n - L:n] for i in range(len(x) - L))), default=0)
            assert drafter.longest_match(tokens[:n]) == max(in_cache, brute_longest(tokens[:n], 5))


def test_cache_memory_bound_holds_and_evicts_the_oldest_requests():
    rng = random.Random(2)
    bound = 40
    drafter = SuffixDrafter(cross_request=True, max_match=3, max_depth=2, max_cached_tokens=bound)
    depth, cache = drafter.trie_depth, drafter.cache
    history: list[list[int]] = []
    for i in range(16):
        tokens = random_tokens(rng, 70 if i == 9 else rng.randint(3, 25), 6)
        request(drafter, tokens, prompt_len=2)
        history.append(tokens[-bound:])  # a request longer than the bound keeps its last `bound` tokens
        kept: list[list[int]] = []  # the newest requests that fit, oldest evicted first
        for r in reversed(history):
            if sum(map(len, kept)) + len(r) > bound:
                break
            kept.insert(0, r)
        assert cache.n_tokens == sum(map(len, kept)) <= bound
        assert list(cache.requests) == kept
        assert cache.trie.n_nodes <= depth * bound + 1
        assert cache.trie.as_dict() == brute_counts(kept, depth)
    check_links(cache.trie)


def test_evicted_requests_are_no_longer_drafted():
    drafter = SuffixDrafter(mode="chain", cross_request=True, max_cached_tokens=12)
    request(drafter, [50, 51, 52, 53, 54])
    probe = [60, 51, 52]
    assert drafter.propose(ctx(probe)).tokens.tolist() == [53, 54]  # probes never end: they are not cached
    request(drafter, [1, 2, 3, 4, 5, 6])  # 11 tokens cached: both fit
    assert drafter.propose(ctx(probe)).tokens.tolist() == [53, 54]
    request(drafter, [7, 8])  # 13 > 12: the oldest request goes
    assert len(drafter.propose(ctx(probe))) == 0 and drafter.cache.n_tokens == 8


# ------------------------------------------------------------------ requests and the engine
def test_begin_and_end_reset_per_request_state():
    drafter = SuffixDrafter(mode="chain")
    assert drafter.propose(ctx([1, 2, 3, 4, 1, 2])).tokens.tolist() == [3, 4]
    drafter.end()
    assert drafter.trie is None
    drafter.begin(ctx([5, 6]))
    assert len(drafter.propose(ctx([5, 6, 3, 1, 2]))) == 0  # "1 2" was the last request's, not this one's
    drafter.propose(ctx([5, 6, 3, 1, 2, 5, 6]))
    drafter.begin(ctx([8, 9]))  # a new request, the last one never ended
    assert drafter.longest_match([8, 9, 5]) == 0 and drafter.trie._stamp == 3
    # a context that does not extend the one fed (no begin) starts over too
    assert drafter.longest_match([5, 6, 7, 5]) == 1 and drafter.trie._stamp == 4
    # a next turn whose prompt extends the last context: begin still drops the state, the prompt is fed anew
    drafter.begin(ctx([5, 6, 7, 5, 6, 8]))
    assert drafter.trie is None
    assert drafter.propose(ctx([5, 6, 7, 5, 6, 8])).catch_up == 5 and drafter.trie._stamp == 6


def test_cache_gets_the_whole_request_including_the_last_steps_tokens():
    drafter = SuffixDrafter(cross_request=True)
    drafter.begin(ctx([1, 2, 3]))
    drafter.end()  # never drafted: the prompt is cached
    drafter.begin(ctx([4, 5, 6]))
    drafter.propose(ctx([4, 5, 6, 7]))
    drafter.observe(SimpleNamespace(committed=[8, 9]))  # the last step: never fed to a propose
    drafter.end()
    assert list(drafter.cache.requests) == [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert drafter.propose(ctx([0, 7, 8])).tokens.tolist() == [9]


def test_catch_up_counts_the_prompt_and_tokens_other_drafters_committed():
    drafter = SuffixDrafter()
    tokens = [1, 2, 3, 4, 5]
    assert drafter.propose(ctx(tokens)).catch_up == 4  # the prompt, pending token aside
    drafter.observe(SimpleNamespace(committed=[6, 7]))
    assert drafter.propose(ctx(tokens + [6, 7])).catch_up == 0  # its own step's tokens
    assert drafter.propose(ctx(tokens + [6, 7, 8, 9, 10])).catch_up == 2  # another drafter's step


def test_params_are_checked():
    for bad, name in [(dict(mode="beam"), "mode"), (dict(min_prob=1.5), "min_prob"), (dict(spec_factor=0.0), "spec_factor"),
                      (dict(max_match=0), "max_match"), (dict(cross_request=1), "cross_request"),
                      (dict(max_cached_tokens=0), "max_cached_tokens"), (dict(max_nodes=2.0), "max_nodes")]:
        with pytest.raises(ValueError, match=name):
            SuffixDrafter(**bad)


REPEATING = [0, 7, 12, 9, 33, 12, 9, 41, 5, 7, 12, 9, 33, 12, 9, 41]


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_engine_greedy_output_is_the_verifiers_and_drafts_are_accepted(verifier_model, mode):
    engine = Engine(Verifier(verifier_model), SuffixDrafter(mode=mode, max_depth=6))
    result = engine.generate(REPEATING, max_new_tokens=40)
    assert result.token_ids == plain_greedy(verifier_model, REPEATING, 40)
    assert result.stats.accepted > 0 and result.stats.steps < 40
    assert result.stats.drafter_counts["suffix"]["match_len"] > 0


def test_engine_cross_request_reuses_the_previous_answer(verifier_model):
    engine = Engine(Verifier(verifier_model), SuffixDrafter(cross_request=True, max_depth=8))
    first = engine.generate(REPEATING, max_new_tokens=40)
    second = engine.generate(REPEATING, max_new_tokens=40)
    assert second.token_ids == first.token_ids == plain_greedy(verifier_model, REPEATING, 40)
    assert second.stats.drafter_counts["suffix"].get("from_cache", 0) > 0
    assert second.stats.steps < first.stats.steps
