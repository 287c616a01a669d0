"""Structured output after a reasoning model's thinking (``AfterThinking``): the thinking between ``<think>`` and
``</think>`` is free, the answer after it follows the grammar. Every tree row is checked against a replay of its path
(committing the path, then the mask), across the gate's phases; commits are all or nothing; the answer is held to
the grammar exactly as the wrapped constraint alone holds a text."""
from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -e '.[structured]'")

from metasd.core.constraints import (AfterThinking, Constraint, ConstraintCompiler, ConstraintViolation,  # noqa: E402
                                     reachable_nodes, thinking_tokens)
from test_constraints import EOS, byte_bpe, encode, paths, replay_mask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    tok = byte_bpe(340)
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.fixture(scope="module")
def inner(tok):
    return ConstraintCompiler().compile(tok, Constraint.json_schema(SCHEMA))


def gate(tok, inner, inside):
    start, end = thinking_tokens(tok)
    return AfterThinking(inner, start, end, inside)


def test_the_markers_must_each_be_one_token(tok):
    start, end = thinking_tokens(tok)
    assert tok.decode([start]) == "<think>" and tok.decode([end]) == "</think>"
    assert thinking_tokens(byte_bpe(340)) is None  # spelt in pieces: no gate (the server then says so)


def test_the_thinking_is_free_and_the_answer_follows_the_grammar(tok, inner):
    start, end = thinking_tokens(tok)
    free = encode(tok, "not JSON at all } {")
    answer = encode(tok, '{"a": 12}')
    state = gate(tok, inner, inside=False).new_state()
    state.accept_tokens([start] + free + [end])
    assert not state.is_complete() and not state.is_terminated()
    state.accept_tokens(answer)
    assert state.is_complete() and state.eos_allowed()
    state.accept_tokens([EOS])
    assert state.is_terminated() and state.num_committed == len(free) + len(answer) + 3
    # the same text with no block: the grammar holds it from the first token
    with pytest.raises(ConstraintViolation) as e:
        gate(tok, inner, inside=False).new_state().accept_tokens(free)
    assert e.value.index == 0
    # after the block, text outside the grammar is refused at its own index, and nothing is committed
    state = gate(tok, inner, inside=False).new_state()
    bad = [start] + free + [end] + encode(tok, '{"b"')
    with pytest.raises(ConstraintViolation) as e:
        state.accept_tokens(bad)
    assert e.value.index == len(free) + 3 and state.num_committed == 0 and state.phase == "open"
    state.accept_tokens([start] + free + [end] + answer)  # still at the start: the good text commits
    assert state.is_complete()


def test_a_prompt_that_opened_the_block_starts_inside_it(tok, inner):
    start, end = thinking_tokens(tok)
    state = gate(tok, inner, inside=True).new_state()
    assert bool(state.mask(tok.vocab_size + 2)[:len(tok)].all())  # every token of the tokenizer, none past it
    state.accept_tokens(encode(tok, "hmm") + [start] + encode(tok, "]]") + [end])  # a <think> inside is just text
    assert state.phase == "answer"
    with pytest.raises(ConstraintViolation):
        state.fork().accept_tokens([start])  # the answer's grammar never writes the marker
    state.accept_tokens(encode(tok, '{"a": 1}') + [EOS])
    assert state.is_terminated()


def test_an_answer_that_does_not_open_a_block_is_held_from_its_first_token(tok, inner):
    start, _ = thinking_tokens(tok)
    state = gate(tok, inner, inside=False).new_state()
    mask = state.mask(len(tok))
    assert mask[start] and torch.equal(mask.clone().index_fill_(0, torch.tensor([start]), False),
                                       inner.new_state().mask(len(tok)))  # the grammar's tokens, and the marker
    state.accept_tokens(encode(tok, "{"))
    with pytest.raises(ConstraintViolation):
        state.fork().accept_tokens([start])  # too late to think


def test_an_end_of_sequence_token_while_thinking_ends_the_request(tok, inner):
    start, end = thinking_tokens(tok)
    state = gate(tok, inner, inside=False).new_state()
    state.accept_tokens([start] + encode(tok, "abc") + [EOS])
    assert state.is_terminated() and state.is_complete()
    assert state.mask(len(tok)).nonzero().flatten().tolist() == [EOS]
    with pytest.raises(ConstraintViolation):
        state.fork().accept_tokens([end])
    state.accept_tokens([EOS])


def _random_tree(g, prefix, n, rng, vocab, start, end):
    """n nodes under random parents: tokens the gate allows on the parent's path (by replay), the markers, the
    end-of-sequence token and random ids."""
    parents, tokens = [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        path = [] if p < 0 else paths(parents, tokens)[p]
        allowed = replay_mask(g, prefix, path, vocab).nonzero().flatten().tolist()
        r = rng.random()
        t = (rng.choice(allowed) if r < 0.55 and allowed else end if r < 0.7 else start if r < 0.78
             else EOS if r < 0.85 else rng.randrange(vocab))
        parents.append(p)
        tokens.append(t)
    return parents, tokens


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("prefix_text", ["", "<think>", "<think> x", "<think> x</think>", '<think></think>{"a'])
def test_tree_rows_equal_a_replay_of_each_path(tok, inner, inside, prefix_text):
    g = gate(tok, inner, inside)
    vocab = len(tok) + 3  # the model's logits are wider than the tokenizer
    prefix = tok.encode(prefix_text, add_special_tokens=False)
    if inside and prefix_text.startswith("<think>"):
        prefix = prefix[1:]
    start, end = thinking_tokens(tok)
    rng = random.Random(f"{inside}/{prefix_text}")
    state = g.new_state()
    state.accept_tokens(prefix)
    before = (state.phase, state.num_committed)
    seen = set()
    for _ in range(6):
        parents, tokens = _random_tree(g, prefix, rng.randrange(1, 14), rng, vocab, start, end)
        masks = state.tree_masks(parents, tokens, vocab)  # [n+1, vocab]
        assert masks.shape == (len(tokens) + 1, vocab)
        assert torch.equal(masks[0], replay_mask(g, prefix, [], vocab))
        reach = reachable_nodes(masks, parents, tokens)
        for i, path in enumerate(paths(parents, tokens)):
            want = replay_mask(g, prefix, path, vocab)
            assert torch.equal(masks[i + 1], want), (prefix_text, parents, tokens, i)
            assert bool(reach[i]) == bool(want.any())
            seen.add(bool(reach[i]))
    assert (state.phase, state.num_committed) == before  # the committed state is not changed by a tree
    assert seen == {False, True}  # reachable and unreachable nodes were both met


def test_greedy_walk_through_the_gate_writes_thinking_then_valid_json(tok, inner):
    """A fake verifier that thinks for a while (the end marker gains as the text grows): the walk's text after
    ``</think>`` is JSON under the schema, the thinking before it is not."""
    start, end = thinking_tokens(tok)
    g = gate(tok, inner, inside=False)
    vocab = len(tok)
    state, out = g.new_state(), []
    while not state.is_terminated():
        assert len(out) < 300
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(len(out)))
        logits[start] += 50 if not out else 0
        logits[end] += len(out) - 6  # closes after a few free tokens
        logits[EOS] -= 20  # not while thinking; the grammar leaves it alone once the JSON is complete
        t = int(logits.masked_fill(~state.mask(vocab), float("-inf")).argmax())
        state.accept_tokens([t])
        out.append(t)
    assert out[0] == start and end in out
    k = out.index(end)
    assert k > 2  # some free thinking
    assert json.loads(tok.decode(out[k + 1:-1]))["a"] is not None


def test_engine_generate_with_drafts_through_the_gate_is_the_plain_greedy_answer():
    """The Python API (``Engine.generate(..., constraint=AfterThinking(...))``) on a tiny model whose prompt opened
    the block: free thinking, then JSON under the schema; a chain drafter's masked drafts change no token."""
    from metasd.core.constraints import compile_constraint
    from metasd.core.engine import Engine
    from serve_helpers import tiny_chain_engine

    tok = byte_bpe(340)
    tok.add_tokens(["<think>", "</think>"])
    engine = tiny_chain_engine(tok, "tiny", context=512)
    start, end = thinking_tokens(tok)
    g = AfterThinking(compile_constraint(tok, Constraint.json_schema(SCHEMA), sorted(engine.eos_ids())), start, end,
                      inside=True)
    kw = dict(constraint=g, logit_bias={end: 0.6})  # a slight pull to close the block: a few free tokens first
    drafted = engine.generate("What is it? <think>", 60, **kw)
    plain = Engine(engine.verifier, [], check_tokenizers=False).generate("What is it? <think>", 60, **kw)
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted > 0
    ids = drafted.token_ids
    assert ids[-1] == EOS and 0 < ids.index(end)
    assert isinstance(json.loads(tok.decode(ids[ids.index(end) + 1:-1]))["a"], int)
