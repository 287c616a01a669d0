"""metasd.core.constraints: grammar masks for structured output, on the committed prefix and along every path of a
draft tree. Tokenizers are byte-level BPEs trained in the test on a few JSON texts (Qwen's kind of tokenizer, with
multi-character tokens that cross JSON's syntax), plus the bundled Qwen tokenizer where its cache is present."""
import json
import os
import random
import re

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install -e '.[structured]')")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from metasd.core.constraints import (Constraint, ConstraintCompiler, ConstraintError, ConstraintViolation,  # noqa: E402
                                     apply_mask, compile_constraint, reachable_nodes, unpack_bitmask)

CORPUS = ['{"name": "Alice", "age": 42, "tags": ["a", "bc"], "kind": "x"}', '{"ok": true, "v": null, "n": [1, 2.5]}',
          '{"nested": {"k": "v"}, "ok": false}', "123-abc.def", "907-xy.z", '{\n  "name": "Bob",\n  "age": 7\n}']
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
                   "kind": {"enum": ["x", "y"]}},
    "required": ["name", "age", "kind"], "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{1,4}(\.[a-z]{1,3}){0,2}"
#: vLLM's guided_choice: one prefix of another, and the characters a Lark string literal must escape
CHOICES = ["no", "not sure", 'say "hi"', "back\\slash\n", "ünï ✓", "a|b"]
SPECS = {"json_object": Constraint.json_object(), "json_schema": Constraint.json_schema(SCHEMA),
         "regex": Constraint.regex(REGEX), "choice": Constraint.choice(CHOICES)}
PREFIXES = {"json_object": ['', '{"name": "Al', '{"n": [1, 2', '{"a": {}}'],
            "json_schema": ['', '{"name": "Al', '{"name": "Bob", "age": 4', '{"name": "", "age": 1, "kind": "x"}'],
            "regex": ['', '12', '123-ab', '123-ab.c'], "choice": ['', 'no', 'say "', 'back\\']}


def byte_bpe(vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte a token, then merges learnt on CORPUS up to ``vocab``); '<eos>' = 0, '<pad>' = 1
    (a special token no grammar allows)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


TOKENIZERS = {"bpe": byte_bpe(340), "bytes": byte_bpe(258)}  # 258: bytes only, a character-level tokenizer
EOS = 0


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def decode(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != EOS])


def replay_mask(compiled, prefix: list[int], path: list[int], vocab: int) -> torch.Tensor:
    """The mask after prefix + path from a fresh state (all False when the grammar refuses the path)."""
    state = compiled.new_state()
    state.accept_tokens(prefix)
    try:
        state.accept_tokens(path)
    except ConstraintViolation:
        return torch.zeros(vocab, dtype=torch.bool)
    return state.mask(vocab)


def paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(path[::-1])
    return out


def random_tree(compiled, prefix: list[int], n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """n nodes under random parents: mostly tokens the grammar allows on the parent's path (found by replay), some
    random ids (mostly refused, ids past the tokenizer's included), some end-of-sequence tokens."""
    parents, tokens = [], []
    vocab = compiled.vocab_size
    for i in range(n):
        p = rng.randrange(-1, i)
        path = [] if p < 0 else paths(parents, tokens)[p]
        allowed = replay_mask(compiled, prefix, path, vocab).nonzero().flatten().tolist()
        r = rng.random()
        if r < 0.7 and allowed:
            t = rng.choice(allowed)
        elif r < 0.8:
            t = EOS
        else:
            t = rng.randrange(vocab + 8)
        parents.append(p)
        tokens.append(t)
    return parents, tokens


@pytest.fixture(scope="module")
def compiler():
    return ConstraintCompiler()


# ------------------------------------------------------------------------------------------------------------------
# tree_masks against a replay of every path


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_tree_rows_equal_a_replay_of_each_path(compiler, tok_name, kind):
    tok = TOKENIZERS[tok_name]
    compiled = compiler.compile(tok, SPECS[kind])
    vocab = compiled.vocab_size + 5  # the model's logits are wider than the tokenizer
    rng = random.Random(f"{tok_name}/{kind}")
    checked_unreachable = checked_ended = 0
    for text in PREFIXES[kind]:
        prefix = encode(tok, text)
        state = compiled.new_state()
        state.accept_tokens(prefix)
        for _ in range(3):
            parents, tokens = random_tree(compiled, prefix, rng.randrange(1, 16), rng)
            masks = state.tree_masks(parents, tokens, vocab)  # [n+1, vocab]
            assert masks.shape == (len(tokens) + 1, vocab) and masks.dtype == torch.bool
            assert torch.equal(masks[0], replay_mask(compiled, prefix, [], vocab))
            reach = reachable_nodes(masks, parents, tokens)
            for i, path in enumerate(paths(parents, tokens)):
                want = replay_mask(compiled, prefix, path, vocab)
                assert torch.equal(masks[i + 1], want), (text, parents, tokens, i)
                assert bool(reach[i]) == bool(want.any())  # reachable rows allow a token; the others none
                checked_unreachable += not reach[i]
                checked_ended += bool(reach[i]) and tokens[i] == EOS
    assert checked_unreachable and checked_ended  # both kinds of special row were met


def test_committed_state_is_unchanged_by_tree_masks(compiler):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_schema"])
    state = compiled.new_state()
    state.accept_tokens(encode(tok, '{"name": "Al'))
    twin = state.fork()
    rng = random.Random(3)
    for _ in range(5):
        parents, tokens = random_tree(compiled, encode(tok, '{"name": "Al'), 12, rng)
        # tensors, as a Draft holds them
        state.tree_masks(torch.tensor(parents), torch.tensor(tokens), compiled.vocab_size)
        assert state.num_committed == twin.num_committed
        assert torch.equal(state.mask(compiled.vocab_size), twin.mask(compiled.vocab_size))
    rest = encode(tok, 'ice", "age": 42, "kind": "x"}') + [EOS]
    state.accept_tokens(rest)
    twin.accept_tokens(rest)
    assert state.is_terminated() and twin.is_terminated()


def test_after_tree_masks_committing_goes_on_as_a_replay_does(compiler):
    # llguidance 1.9.1: a matcher that consumes two tokens, computes masks in between and rolls back gives wrong masks
    # for tokens committed later (found when drafts were grammar-masked: a greedy answer left plain decoding's). The
    # walk now never rolls back; here the case that showed it, then random trees, each followed by a commit
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_schema"])
    # a greedy answer of tiny_qwen(seed=3) under SCHEMA: '{\n  "name":\n\n  "x|Ƙ907", "age": 1\n \n \n \n' ...
    committed = [329, 79, 267, 70, 259, 200, 278, 89, 93, 132, 248, 296, 266, 264, 269, 18, 274, 274, 274, 274]
    assert tok.convert_ids_to_tokens([261, 80, 271, 331, 303]) == [',Ġ"', "o", 'k":Ġ', ',Ġ"kin', 'd":Ġ']
    cases = [(committed, [-1, -1, 1], [261, 331, 303], [261, 80, 271])]
    rng = random.Random(5)
    base = encode(tok, '{"name": "Al')
    for _ in range(12):
        parents, tokens = random_tree(compiled, base, 12, rng)
        path = next((p for p in sorted(paths(parents, tokens), key=len, reverse=True)
                     if replay_mask(compiled, base, p, compiled.vocab_size).any() and EOS not in p), [])
        cases.append((base, parents, tokens, path))
    for start, parents, tokens, path in cases:
        state = compiled.new_state()
        state.accept_tokens(start)
        state.tree_masks(parents, tokens, compiled.vocab_size)
        state.accept_tokens(path)  # a step commits its accepted path at once
        assert torch.equal(state.mask(compiled.vocab_size), replay_mask(compiled, start, path, compiled.vocab_size)), \
            (start, parents, tokens, path)


def test_committed_state_is_unchanged_when_the_walk_fails(compiler, monkeypatch):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_object"])
    state = compiled.new_state()
    state.accept_tokens(encode(tok, '{"a": [1'))
    before = state.mask(compiled.vocab_size)
    calls = []
    real_fill = type(state)._fill

    def failing_fill(self, bits, row, ended, matcher=None):
        calls.append(row)
        if len(calls) == 4:
            raise RuntimeError("injected")
        real_fill(self, bits, row, ended, matcher)

    monkeypatch.setattr(type(state), "_fill", failing_fill)
    chain = encode(tok, ", 2, 3]")
    with pytest.raises(RuntimeError, match="injected"):
        state.tree_masks(list(range(-1, len(chain) - 1)), chain, compiled.vocab_size)
    monkeypatch.undo()
    assert torch.equal(state.mask(compiled.vocab_size), before)


# ------------------------------------------------------------------------------------------------------------------
# Walks: what a constrained greedy decoder writes parses and validates


def check_schema(value) -> None:
    try:
        import jsonschema
    except ImportError:  # by hand
        assert isinstance(value, dict) and {"name", "age", "kind"} <= set(value) <= set(SCHEMA["properties"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 6 and value["kind"] in ("x", "y")
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert all(t in ("a", "bc") for t in value.get("tags", []))
        return
    jsonschema.validate(value, SCHEMA)


def check_text(kind: str, text: str) -> None:
    if kind == "choice":
        assert text in CHOICES, text
        return
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
        return
    value = json.loads(text)
    assert isinstance(value, dict), text
    if kind == "json_schema":
        check_schema(value)


def position_logits(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The fake verifier: logits [vocab] keyed by the position alone; ids past the tokenizer's score highest."""
    g = torch.Generator().manual_seed(seed * 100_003 + position)
    logits = torch.randn(vocab, generator=g)
    logits[-5:] += 100.0  # extra ids of the model: the mask must keep them out
    logits[EOS] -= 1.0  # keep the texts from stopping at once
    return logits


def greedy_walk(compiled, seed: int, vocab: int, limit: int = 400) -> list[int]:
    state = compiled.new_state()
    out: list[int] = []
    while not state.is_terminated():
        assert len(out) < limit, "the walk did not end"
        t = int(apply_mask(position_logits(seed, len(out), vocab), state.mask(vocab)).argmax())
        state.accept_tokens([t])
        out.append(t)
    return out


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_walk_writes_valid_text(compiler, kind):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS[kind])
    for seed in range(6):
        ids = greedy_walk(compiled, seed, compiled.vocab_size + 5)
        assert ids[-1] == EOS and EOS not in ids[:-1]
        check_text(kind, decode(tok, ids))


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_speculative_walk_on_tree_masks_matches_the_plain_walk(compiler, kind):
    """Drafts (an oracle chain, sometimes corrupted, plus random siblings) verified with greedy acceptance on the
    tree's masked rows commit exactly what the plain masked greedy walk commits: the masks make it lossless."""
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS[kind])
    vocab = compiled.vocab_size + 5
    for seed in range(4):
        rng = random.Random(seed)
        want = greedy_walk(compiled, seed, vocab)
        state = compiled.new_state()
        out: list[int] = []
        while not state.is_terminated():
            depth = rng.randrange(0, 6)
            chain = want[len(out):len(out) + depth]
            if chain and rng.random() < 0.3:
                chain[rng.randrange(len(chain))] = rng.randrange(vocab)
            parents = list(range(-1, len(chain) - 1))
            tokens = list(chain)
            for _ in range(rng.randrange(0, 6)):
                parents.append(rng.randrange(-1, len(tokens)))
                tokens.append(rng.randrange(vocab))
            masks = state.tree_masks(parents, tokens, vocab)  # [n+1, vocab]
            depths = [len(p) for p in paths(parents, tokens)]
            row, path = 0, []
            while True:  # greedy acceptance: follow the child whose token is the masked argmax
                position = len(out) + (0 if row == 0 else depths[row - 1])
                y = int(apply_mask(position_logits(seed, position, vocab), masks[row]).argmax())
                child = next((i for i, p in enumerate(parents) if p == row - 1 and tokens[i] == y), None)
                path.append(y)
                if child is None:
                    break
                row = child + 1
            state.accept_tokens(path)  # raises if a committed token breaks the grammar
            out += path
        assert out[:out.index(EOS) + 1] == want
        check_text(kind, decode(tok, want))


# ------------------------------------------------------------------------------------------------------------------
# Vocabulary sizes, end of sequence, atomic commits


def test_vocab_wider_than_the_tokenizer_masks_the_extra_ids(compiler):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_object"])
    v = compiled.vocab_size
    state = compiled.new_state()
    wide = state.mask(v + 37)
    assert wide.shape == (v + 37,) and not wide[v:].any() and torch.equal(wide[:v], state.mask(v))
    masks = state.tree_masks([-1, -1], [encode(tok, "{")[0], v + 3], v + 37)  # [3, v+37]; node 1: an extra id
    assert not masks[:, v:].any() and masks[1].any() and not masks[2].any()
    logits = torch.zeros(2, v + 37)
    masked = apply_mask(logits, state.mask(v + 37))
    assert torch.isinf(masked[:, v:]).all() and masked.softmax(-1)[:, v:].sum() == 0
    assert torch.equal(state.mask(v - 100), state.mask(v)[:v - 100])  # narrower: truncated
    with pytest.raises(ConstraintViolation, match="outside"):
        state.accept_tokens([v + 3])


def test_end_of_sequence_and_special_tokens(compiler):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_object"])
    v = compiled.vocab_size
    state = compiled.new_state()
    assert not state.mask(v)[EOS] and not state.mask(v)[1]  # no EOS before the text is complete; '<pad>' never
    state.accept_tokens(encode(tok, '{"a": 1'))
    assert not state.eos_allowed() and not state.is_complete()
    state.accept_tokens(encode(tok, "}"))
    assert state.eos_allowed() and state.is_complete() and not state.is_terminated()
    assert state.mask(v).nonzero().flatten().tolist() == [EOS]
    state.accept_tokens([EOS])
    assert state.is_terminated() and state.mask(v).nonzero().flatten().tolist() == [EOS]
    with pytest.raises(ConstraintViolation, match="after an end-of-sequence"):
        state.accept_tokens(encode(tok, " "))
    state.accept_tokens([EOS])  # more end-of-sequence tokens stay allowed


def test_accept_tokens_commits_all_or_nothing(compiler):
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["json_schema"])
    state = compiled.new_state()
    state.accept_tokens(encode(tok, '{"name": "A'))
    before, n = state.mask(compiled.vocab_size), state.num_committed
    good, bad = encode(tok, 'l", "age'), encode(tok, '": x')
    with pytest.raises(ConstraintViolation) as err:
        state.accept_tokens(good + bad)
    assert err.value.index >= len(good) and err.value.token == (good + bad)[err.value.index]
    assert state.num_committed == n and torch.equal(state.mask(compiled.vocab_size), before)
    with pytest.raises(ConstraintViolation, match="index 0"):
        state.accept_tokens([EOS])  # the text is not complete


def test_tree_arguments_are_checked(compiler):
    state = compiler.compile(TOKENIZERS["bpe"], SPECS["regex"]).new_state()
    with pytest.raises(ValueError, match="parent"):
        state.tree_masks([-1, 1], [5, 6], 10)
    with pytest.raises(ValueError, match="one parent per token"):
        state.tree_masks([-1], [5, 6], 10)
    with pytest.raises(ValueError, match="token ids are >= 0"):
        state.tree_masks([-1], [-4], 10)
    assert state.tree_masks([], [], 10).shape == (1, 10)


# ------------------------------------------------------------------------------------------------------------------
# Masks as tensors


def test_unpack_bitmask_matches_a_bit_by_bit_reading():
    bits = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    want = torch.tensor([[(int(bits[r, t // 32]) >> (t % 32)) & 1 for t in range(128)] for r in range(3)]).bool()
    assert torch.equal(unpack_bitmask(bits, 128), want)
    assert torch.equal(unpack_bitmask(bits, 100), want[:, :100])
    wider = unpack_bitmask(bits, 150)
    assert torch.equal(wider[:, :128], want) and not wider[:, 128:].any()
    assert torch.equal(unpack_bitmask(bits[0], 128), want[0])


def test_apply_mask():
    logits = torch.randn(3, 6)
    mask = torch.tensor([True, False, True, False, False, True])
    out = apply_mask(logits, mask)  # [vocab] broadcast over the rows
    assert torch.equal(out[:, mask], logits[:, mask]) and torch.isneginf(out[:, ~mask]).all()
    assert not torch.isinf(logits).any()  # the input is untouched
    probs = out.softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and (probs[:, ~mask] == 0).all()
    with pytest.raises(ValueError, match="covers"):
        apply_mask(logits, mask[:5])
    with pytest.raises(TypeError, match="bool"):
        apply_mask(logits, mask.int())
    with pytest.raises(TypeError, match="float"):
        apply_mask(logits.long(), mask)


# ------------------------------------------------------------------------------------------------------------------
# Specs and the compiler


@pytest.mark.parametrize("make, field", [
    (lambda: Constraint("xml"), "kind"),
    (lambda: Constraint("json_schema"), "schema"),
    (lambda: Constraint.json_schema("{not json"), "schema"),
    (lambda: Constraint.json_schema([1, 2]), "schema"),
    (lambda: Constraint.json_schema({"type": "strng"}), "schema"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}), "schema"),
    (lambda: Constraint.json_schema({"x": {1, 2}}), "schema"),
    (lambda: Constraint("regex"), "pattern"),
    (lambda: Constraint.regex("(ab"), "pattern"),
    (lambda: Constraint.regex(""), "pattern"),
    (lambda: Constraint("json_object", pattern="a"), "pattern"),
    (lambda: Constraint("regex", pattern="a", schema={}), "schema"),
    (lambda: Constraint.from_response_format({"type": "yaml"}), "response_format.type"),
    (lambda: Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (lambda: Constraint.from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": 3}}}),
     "response_format.json_schema.schema"),
])
def test_a_bad_spec_names_its_field(make, field):
    with pytest.raises(ConstraintError) as err:
        make()
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_specs_equality_and_response_format():
    a = Constraint.json_schema({"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}})
    b = Constraint.json_schema('{"properties": {"a": {"type": "string"}}, "required": ["a"], "type": "object"}')
    assert a == b and hash(a) == hash(b) and a != Constraint.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": dict(a.schema)}}
    assert Constraint.from_response_format(rf) == a
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.json_object()
    assert Constraint.from_response_format({"type": "text"}) is None and Constraint.from_response_format(None) is None


def test_compiler_caches_per_tokenizer_eos_and_spec():
    tok = TOKENIZERS["bytes"]
    compiler = ConstraintCompiler(max_grammars=2)
    a = compiler.compile(tok, Constraint.json_object())
    assert compiler.compile(tok, Constraint.json_object()) is a and compiler.conversions == 1
    assert compiler.compile(tok, Constraint.json_object(), eos_token_ids=[0, 1]) is not a
    assert compiler.conversions == 2
    compiler.compile(tok, SPECS["regex"])
    compiler.compile(tok, SPECS["json_schema"])  # the third constraint evicts the least recently used
    assert compiler.compile(tok, Constraint.json_object()) is not a and compiler.compiles == 5
    assert compile_constraint(tok, SPECS["regex"]) is compile_constraint(tok, SPECS["regex"])


def test_compiler_errors_name_their_field():
    compiler = ConstraintCompiler()
    with pytest.raises(ConstraintError) as err:
        compiler.compile(TOKENIZERS["bpe"], Constraint.json_object(), eos_token_ids=[10_000])
    assert err.value.field == "eos_token_ids"
    with pytest.raises(ConstraintError) as err:
        compiler.compile(TOKENIZERS["bpe"], Constraint.json_object(), eos_token_ids=[])
    assert err.value.field == "eos_token_ids"
    words = Tokenizer(models.WordLevel({"<eos>": 0, "{": 1, "}": 2}, unk_token="<eos>"))  # no decoder to read bytes
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with pytest.raises(ConstraintError) as err:
        compiler.compile(PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>"), Constraint.json_object())
    assert err.value.field == "tokenizer"


# ------------------------------------------------------------------------------------------------------------------
# The bundled Qwen tokenizer (151,936 ids)


def _qwen_tokenizer():
    from transformers import AutoTokenizer

    from metasd.models.bundled import cache_dir

    folder = cache_dir() / "qwen2.5-coder-1.5b-instruct"
    if not (folder / "tokenizer.json").is_file():
        if os.environ.get("METASD_REQUIRE_REAL") == "1":
            pytest.fail(f"METASD_REQUIRE_REAL=1 and no bundled Qwen tokenizer in {folder}")
        pytest.skip(f"the bundled Qwen model cache is absent ({folder}): `metasd generate` once prepares it")
    return AutoTokenizer.from_pretrained(str(folder))


def test_qwen_tokenizer_tree_rows_equal_replays():
    tok = _qwen_tokenizer()
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    compiled = ConstraintCompiler().compile(tok, Constraint.json_schema(SCHEMA), eos_token_ids=stops)
    vocab = 151_936 + 64  # wider than the tokenizer, as a padded embedding would be
    prefix = tok.encode('{"name": "Al', add_special_tokens=False)
    state = compiled.new_state()
    state.accept_tokens(prefix)
    good = tok.encode('ice", "age": 42, "tags": ["a"], "kind": "y"}', add_special_tokens=False)
    parents = list(range(-1, len(good) - 1)) + [len(good) - 1, 3, 3, -1]
    tokens = good + [stops[0], tok.encode(" 7", add_special_tokens=False)[0], good[4], stops[1]]
    masks = state.tree_masks(parents, tokens, vocab)  # [n+1, vocab]
    reach = reachable_nodes(masks, parents, tokens).tolist()
    assert reach == [True] * len(good) + [True, False, True, False]
    for i, path in enumerate(paths(parents, tokens)):
        assert torch.equal(masks[i + 1], replay_mask(compiled, prefix, path, vocab)), i
    assert not masks[:, tok.convert_tokens_to_ids("<|im_start|>")].any() and not masks[:, 151_936:].any()
    state.accept_tokens(good + [stops[0]])
    assert state.is_terminated() and json.loads(tok.decode(prefix + good)) == {
        "name": "Alice", "age": 42, "tags": ["a"], "kind": "y"}


def test_without_llguidance_specs_and_masks_work_and_compiling_says_what_to_install(monkeypatch):
    from metasd.core.constraints import backend

    monkeypatch.setattr(backend, "llguidance", None)  # what backend.py's import leaves when it is not installed
    spec = Constraint.regex("(ab")  # fields only: the grammar is checked when compiled
    assert apply_mask(torch.zeros(3), torch.tensor([True, False, True]))[1] == float("-inf")
    assert unpack_bitmask(torch.tensor([5], dtype=torch.int32), 3).tolist() == [True, False, True]
    with pytest.raises(ImportError, match=re.escape("pip install 'metasd[structured]'")):
        ConstraintCompiler().compile(TOKENIZERS["bpe"], spec)


def test_a_choice_is_each_of_its_strings_whole_and_nothing_else(compiler):
    """``Constraint.choice`` (vLLM's guided_choice): every choice, escapes included, is complete text; a prefix of one
    is not, and text that is none of them is refused."""
    tok = TOKENIZERS["bpe"]
    compiled = compiler.compile(tok, SPECS["choice"])
    for choice in CHOICES:
        state = compiled.new_state()
        state.accept_tokens(encode(tok, choice))
        assert state.eos_allowed(), choice  # (not is_complete for "no": "not sure" may still follow)
    for prefix in ("n", "not", "not su", 'say "hi', "back\\slash"):
        state = compiled.new_state()
        state.accept_tokens(encode(tok, prefix))
        assert not state.eos_allowed(), prefix
    for other in ("yes", "say hi", "x", "a|c", "back\\\\slash"):
        with pytest.raises(ConstraintViolation):
            compiled.new_state().accept_tokens(encode(tok, other))


@pytest.mark.parametrize("choices, message", [([], "non-empty list"), ("yes", "non-empty list"),
                                              (["yes", ""], "choice 1 must be a non-empty string"),
                                              (["yes", 3], "choice 1 must be a non-empty string")])
def test_bad_choices_are_refused_naming_the_field(choices, message):
    with pytest.raises(ConstraintError, match=message) as e:
        Constraint.choice(choices)
    assert e.value.field == "choices"
