"""Cross-tokenizer drafting (docs/algorithms.md#cross-tokenizer-drafting): the token bridge (incremental decoding, the
drafter's incremental view of the committed text, translation of drafts with the partial-token rule), and drafters of
another tokenizer in the engine on tiny models - greedy identity, sampling exactness, pool entries with
``tokenizer: own`` and the errors for what cannot be translated."""
import random

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, PreTrainedTokenizerFast

from metasd.config import ConfigError, ModelCache, load_pool, parse_pool_config
from metasd.core.engine import Engine
from metasd.core.decoding.tokens import TokenizerMismatchError
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedDrafter
from metasd.drafters.token_bridge import PROBE_TEXT, IncrementalDecoder, TokenBridge, TokenBridgeError
from metasd.models import ModelLoadError
from metasd.core.execution.kv_cache import cache_kwargs
from sampling_check import sampled_pairs_pvalue
from tiny import (VOCAB, _bpe_tokenizer, _chars, as_llama, char_tokenizer, plain_greedy, spaced_word_map,
                  spaced_word_tokenizer, tiny_qwen, tiny_tokenizer)

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
SHARP = 20.0  # verifier logit scale, as in tests/test_conformance.py

CORPUS = [
    PROBE_TEXT,
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away!\n",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, \u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3001\u4e2d\u6587\u53e5\u5b50\u3002 "
    "\U0001F642\U0001F680 ok\n",
    "    indented   spaces\t\ttabs\n\n\nthree newlines 12345 67.89 -1e10\n",
]


def _trained(kind: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A small BPE tokenizer trained on CORPUS: "byte" (byte-level, GPT-2/Qwen style: any text, characters split over
    several tokens) or "metaspace" (SentencePiece style: '\u2581' for spaces, a '\u2581' put before the text's
    first word, characters as the alphabet)."""
    if kind == "byte":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|end|>"], show_progress=False)
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<bos>", "<eos>"],
                                      show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>" if kind == "byte" else "<eos>")


@pytest.fixture(scope="module")
def byte_tok():
    return _trained("byte", 400)


@pytest.fixture(scope="module")
def meta_tok():
    return _trained("metaspace", 300)


def _bridge(v, d, **kw) -> TokenBridge:
    return TokenBridge(v, d, drafter="arm", verifier_model="big-v", drafter_model="small-d", **kw)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i:i + n])
        i += n
    return out


# ------------------------------------------------------------------------------------------------ the bridge alone
@pytest.mark.parametrize("kind", ["byte", "metaspace"])
def test_incremental_decoder_gives_the_whole_decode(kind, byte_tok, meta_tok):
    tok = byte_tok if kind == "byte" else meta_tok
    rng = random.Random(0)
    for text in CORPUS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        dec = IncrementalDecoder(tok)
        for chunk in _chunks(ids, rng):
            dec.feed(chunk)
            assert tok.decode(dec.ids[: len(dec.ids) - dec.held]) == dec.text  # held: ids that end inside a character
            assert dec.held == 0 or tok.decode(dec.ids).endswith("\ufffd")
        assert dec.text == tok.decode(ids) and dec.held == 0


def test_incremental_decoder_holds_ids_that_end_inside_a_character(byte_tok):
    ids = byte_tok("\U0001F642!", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2  # the emoji is split over byte tokens
    dec = IncrementalDecoder(byte_tok)
    dec.feed(ids[:1])
    assert dec.text == "" and dec.held == 1
    dec.feed(ids[1:])
    assert dec.text == "\U0001F642!" and dec.held == 0


@pytest.mark.parametrize("verifier_kind, drafter_kind", [("byte", "metaspace"), ("metaspace", "byte"), ("byte", "byte")])
def test_view_is_kept_incrementally_and_spells_the_committed_text(verifier_kind, drafter_kind, byte_tok, meta_tok):
    """The drafter's view of the committed text, kept up to date a few ids at a time by re-encoding a tail window, is
    the drafter's encoding of the whole text, and each step re-encodes a window, not the text."""
    toks = {"byte": byte_tok, "metaspace": meta_tok}
    v, d = toks[verifier_kind], toks[drafter_kind]
    bridge = _bridge(v, d, window=4)
    rng = random.Random(1)
    text = "".join(CORPUS)
    ids = v(text, add_special_tokens=False)["input_ids"]
    committed, windows = [], []
    for chunk in _chunks(ids, rng):
        committed += chunk
        view = bridge.view(committed)
        windows.append(bridge.reencoded)
        if view is None:  # the committed ids end inside a character
            continue
        assert d.decode(view) == bridge.text == v.decode(committed)
        assert view == d(bridge.text, add_special_tokens=False)["input_ids"]
    assert view is not None and bridge.text == text
    assert max(windows[10:]) < 40 < len(view)  # a tail window per step, never the whole text


def test_view_puts_the_drafters_bos_first(byte_tok):
    gemma_like = _trained("metaspace", 300)
    from tokenizers.processors import TemplateProcessing
    gemma_like.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    bridge = _bridge(byte_tok, gemma_like)
    assert bridge.prefix == [1]
    committed = byte_tok("Hello there, world", add_special_tokens=False)["input_ids"]
    assert bridge.view(committed[:2])[:1] == [1]
    view = bridge.view(committed)
    assert view[0] == 1 and gemma_like.decode(view[1:]) == "Hello there, world"


def test_draft_text_and_translation_drop_the_partial_token(byte_tok, meta_tok):
    bridge = _bridge(byte_tok, meta_tok)
    committed = byte_tok("The quick", add_special_tokens=False)["input_ids"]
    view = bridge.view(committed)
    drafted = meta_tok(" brown fox", add_special_tokens=False)["input_ids"]
    # a Metaspace tokenizer drops the space before the first word of a decode: the view's ids give it back
    text, complete = bridge.draft_text(view, drafted)
    assert (text, complete) == (" brown fox", False)
    full = byte_tok("The quick brown fox", add_special_tokens=False)["input_ids"]
    out = bridge.to_verifier(committed, text)
    # every verifier id of the text but the last, which may still grow (' fox' -> ' foxes')
    assert out == full[len(committed):-1] and byte_tok.decode(committed + out) + " fox" == "The quick brown fox"
    assert bridge.to_verifier(committed, text, complete=True) == full[len(committed):]
    stop = meta_tok.convert_tokens_to_ids("<eos>")
    bridge.stop_ids = frozenset([stop])
    assert bridge.draft_text(view, drafted + [stop] + drafted) == (" brown fox", True)


def test_translation_continues_a_word_the_verifier_left_unfinished(byte_tok, meta_tok):
    bridge = _bridge(byte_tok, meta_tok)
    committed = byte_tok("The qu", add_special_tokens=False)["input_ids"]
    out = bridge.to_verifier(committed, "ick brown fox")
    assert out and "The quick brown".startswith(byte_tok.decode(committed + out)[:15])
    assert byte_tok.decode(committed + out) == "The quick brown"  # ' fox' dropped: it may grow


def test_translation_cuts_ids_that_do_not_spell_the_drafted_text():
    v = tiny_tokenizer()  # word-level: a word it lacks becomes its unknown word 'w6'
    bridge = _bridge(v, char_tokenizer())
    committed = v("<s> w7 w12", add_special_tokens=False)["input_ids"]
    assert bridge.to_verifier(committed, " w33 w40 w99 w12", complete=True) == [33, 40]
    assert bridge.to_verifier(committed, " w33 w41", complete=False) == [33]  # 'w41' dropped: it may still grow
    assert bridge.to_verifier(committed, " w33 w4", complete=False) == [33]  # 'w4' cut ('w6'), 'w33' is complete


def test_a_special_token_both_tokenizers_have_ends_the_draft_in_the_verifiers_id():
    """A drafter's special token the verifier also has as a special token (a shared chat format's end of turn) is
    kept, in the verifier's id, and ends the draft; one the verifier lacks ends it before."""
    v, d = tiny_tokenizer(), char_tokenizer()
    eos = d.convert_tokens_to_ids("</s>")
    bridge = _bridge(v, d, stop_ids=[eos, d.convert_tokens_to_ids("<s>")])
    assert bridge.shared_stops == bridge.stop_ids  # '<s>' and '</s>' are special tokens of both
    committed = v("<s> w7 w12", add_special_tokens=False)["input_ids"]
    view = bridge.view(committed)
    drafted = d(" w33 w40 ", add_special_tokens=False)["input_ids"] + [eos] + d(" w9", add_special_tokens=False)["input_ids"]
    text, complete = bridge.draft_text(view, drafted)
    assert (text, complete) == (" w33 w40 </s>", True)
    assert bridge.to_verifier(committed, text, complete) == [33, 40, 1]
    bridge.shared_stops = frozenset()  # a special token the verifier does not have: the draft ends before it
    assert bridge.draft_text(view, drafted) == (" w33 w40 ", True)


# ------------------------------------------------------------------------------------------------ bad input
def test_a_drafter_tokenizer_that_cannot_round_trip_is_refused():
    no_six = _bpe_tokenizer([c for c in _chars(VOCAB) if c != "6"], [])  # BPE without '6' drops it
    with pytest.raises(TokenBridgeError, match=r"drafter 'arm' \(model 'small-d', tokenizer: own\) for verifier "
                                               r"'big-v': the drafter's tokenizer cannot round-trip the verifier's text"):
        _bridge(tiny_tokenizer(), no_six)


def test_a_model_without_tokenizer_is_refused():
    with pytest.raises(TokenBridgeError, match="drafter 'arm' .*'small-d'.*'big-v'.*the drafter model has no tokenizer"):
        _bridge(tiny_tokenizer(), None)
    with pytest.raises(TokenBridgeError, match="the verifier has no tokenizer"):
        _bridge(None, char_tokenizer())
    with pytest.raises(TokenBridgeError, match="no tokenizer"):
        PretrainedDrafter(tiny_qwen(seed=1), None, verifier_tokenizer=tiny_tokenizer(), name="arm")


def test_a_verifier_tokenizer_that_encodes_nothing_is_refused():
    class Mute:  # what AutoTokenizer makes of the tiny word-level tokenizer saved beside a Qwen2 model
        def __call__(self, text, add_special_tokens=True, **kw):
            return {"input_ids": []}

        def decode(self, ids, **kw):
            return ""

    with pytest.raises(TokenBridgeError, match="the verifier's tokenizer encodes the probe text .* to nothing"):
        _bridge(Mute(), char_tokenizer())


def test_a_verifier_tokenizer_that_changes_its_own_text_is_refused():
    growing = tiny_tokenizer()
    growing.decode = lambda ids, **kw: tiny_tokenizer().decode(ids, **kw) + " w7"  # decode(encode(t)) != t
    with pytest.raises(TokenBridgeError, match="the verifier's tokenizer does not give its own text back after an "
                                               "encode and a decode"):
        _bridge(growing, char_tokenizer())


def test_a_drafter_tokenizer_without_offsets_is_refused():
    class Slow:  # a slow tokenizer: no character offsets
        def __init__(self):
            self.inner = char_tokenizer()

        def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
            if return_offsets_mapping:
                raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
            return self.inner(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, **kw):
            return self.inner.decode(ids, **kw)

    with pytest.raises(TokenBridgeError, match=r"the drafter's tokenizer \(Slow\) gives no character offsets .*needs a "
                                               r"fast tokenizer"):
        _bridge(tiny_tokenizer(), Slow())


# ------------------------------------------------------------------------------------------------ in the engine
def _spaced_drafter(scale: float, seed: int = 0):
    """A drafter over ``spaced_word_tokenizer``'s ids computing what the verifier's weights compute (at logit scale
    ``scale``): its drafts are often the verifier's, so acceptance is exercised."""
    tok = spaced_word_tokenizer()
    return as_llama(tiny_qwen(seed=seed, layers=4, logit_scale=scale), len(tok), spaced_word_map(tok)), tok


@pytest.fixture(scope="module")
def verifier():
    return Verifier(tiny_qwen(seed=0, layers=4, logit_scale=SHARP), tiny_tokenizer())


DRAFTERS = {
    "spaced words, same weights": lambda: (*_spaced_drafter(SHARP), 4),
    "spaced words, softer": lambda: (*_spaced_drafter(SHARP / 3), 3),
    "characters, random": lambda: (as_llama(tiny_qwen(seed=5), len(char_tokenizer())), char_tokenizer(), 12),
}


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_greedy_output_is_the_verifiers(verifier, which):
    model, tok, k = DRAFTERS[which]()
    drafter = PretrainedDrafter(model, tok, k=k, verifier_tokenizer=verifier.tokenizer, name="x")
    engine = Engine(verifier, drafter)
    for n in (1, 9, 30):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(verifier.model, PROMPT, n), f"{which}: differs at max_new_tokens={n}"
    counts = result.stats.drafter_counts["x"]
    assert counts["drafter_tokens"] > 0
    if which.startswith("spaced"):
        assert result.stats.accepted > 0
        assert counts["reencoded"] / counts["steps"] <= drafter.bridge.window + k + 2  # a tail window per step
    if which == "spaced words, same weights":  # every word drafted is the verifier's, the last one kept as well
        assert result.stats.accepted == result.stats.drafted
        taus = result.stats.tokens_per_step[:-1]  # k words and the bonus a step (the last one: cut by the budget)
        assert sum(taus) / len(taus) > k + 0.2, result.stats.tokens_per_step


def test_concurrent_requests_draft_in_shared_forwards_and_decode_as_alone(verifier):
    # the scheduler's batched drafting with a drafter of another tokenizer: each request's catch-up over its own view
    # and its chain levels share one drafter forward per round, and every request's steps are those it takes alone
    from drafting_helpers import MAX_NEW, PROMPTS, schedule_together

    model, tok = _spaced_drafter(SHARP / 3)
    # in float64: this drafter computes what the verifier's weights compute, and in float32 one of its near-ties rounds
    # differently in a padded batch than alone (drafts differ, output not: checked); float64 draws the same drafts
    model = model.double()
    drafter = PretrainedDrafter(model, tok, k=3, verifier_tokenizer=verifier.tokenizer, name="x")
    engine = Engine(verifier, drafter)
    alone = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    rows = []
    model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    results, steps = schedule_together(engine, PROMPTS, MAX_NEW, lambda: len(rows))
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert [r.stats.tokens_per_step for r in results] == [a.stats.tokens_per_step for a in alone]
    assert sum(a.stats.accepted for a in alone) > 10
    full = [n for b, n in steps if b == 4]
    assert full and max(full) <= 3 and max(rows) == 4, steps  # the catch-up and two levels: 3 forwards for all four


def test_view_and_cache_follow_the_committed_text(verifier):
    """After every step (drafts partly accepted) the drafter's view spells the committed text - one drafter word per
    verifier word with this tokenizer - and its cache holds exactly its cached ids, which share the view's prefix up
    to the drafted tokens."""
    model, tok = _spaced_drafter(SHARP / 3)
    drafter = PretrainedDrafter(model, tok, k=4, verifier_tokenizer=verifier.tokenizer)
    words = spaced_word_map(tok)
    run = Engine(verifier, drafter)._run(PROMPT, 40)
    rejected = 0
    for committed in run.steps():
        tokens = PROMPT + run.new_ids
        view = drafter.bridge.view(tokens)
        assert tok.decode(view) == verifier.tokenizer.decode(tokens)
        assert [words[i] for i in view] == tokens
        assert drafter.cache.get_seq_length() == len(drafter.cached_ids)
        shared = next((i for i, (a, b) in enumerate(zip(drafter.cached_ids, view)) if a != b), len(view))
        assert shared >= len(view) - len(committed) - 1
        rejected += len(committed) < drafter.k
    assert rejected  # partial acceptance happened, so re-alignment was exercised


@pytest.mark.parametrize("which", ["spaced words, softer", "characters, random"])
def test_sampling_follows_the_verifiers_distribution(verifier, which):
    model, tok, k = DRAFTERS[which]()
    engine = Engine(verifier, PretrainedDrafter(model, tok, k=k, verifier_tokenizer=verifier.tokenizer, name="x"))
    pvalue, accepted, drafted = sampled_pairs_pvalue(engine, [0, 7, 12, 9, 33, 7, 12], 400)
    assert pvalue > 1e-3, f"{which}: sampled pairs do not follow the verifier (p = {pvalue:.2g})"
    if which.startswith("spaced"):
        assert drafted > 0 and accepted > 0


def _shared_vocab_pair(seed: int = 3):
    """A verifier over ``spaced_word_tokenizer`` and a drafter over ``char_tokenizer``: both decode token by token
    and share every character, at other ids; the drafter computes the verifier's weights on those characters."""
    vtok, dtok = spaced_word_tokenizer(), char_tokenizer()
    verifier = Verifier(tiny_qwen(seed=seed, vocab=len(vtok), layers=2, logit_scale=SHARP), vtok)
    v_ids = vtok.get_vocab()
    token_map = {d: v_ids[c] for c, d in dtok.get_vocab().items() if c in v_ids}
    drafter = as_llama(tiny_qwen(seed=seed, vocab=len(vtok), layers=2, logit_scale=SHARP / 3), len(dtok), token_map)
    return verifier, PretrainedDrafter(drafter, dtok, k=4, verifier_tokenizer=vtok, name="chars")


def test_sampling_over_the_shared_vocabulary_follows_the_verifiers_distribution(monkeypatch):
    """Where the vocabularies share tokens, a sampled draft is drawn among them only and carries q over the verifier's
    ids: verified by the ratio rule, the sampled pairs follow the verifier, and drafts are accepted. A q that is not
    the one the tokens were drawn from (the restriction left unnormalised) fails the same check."""
    from metasd.drafters.shared_vocab import SharedVocab

    verifier, drafter = _shared_vocab_pair()
    engine = Engine(verifier, drafter)
    prompt = [6, 12, 9, 7, 12]
    pvalue, accepted, drafted = sampled_pairs_pvalue(engine, prompt, 400)
    assert drafter.shared is not None and drafter.shared.size >= 20  # the characters, digits and the space
    assert pvalue > 1e-3, f"sampled pairs do not follow the verifier (p = {pvalue:.2g})"
    assert drafted > 0 and accepted > 0
    step = engine.generate(prompt, max_new_tokens=3, temperature=1.0, seed=0)
    assert step.stats.drafted > 0

    monkeypatch.setattr(SharedVocab, "restrict", lambda self, q: 0.1 * q * self.mask)  # a wrong q
    pvalue, _, _ = sampled_pairs_pvalue(engine, prompt, 800)  # (the pair's 2nd token is the drafted one)
    assert pvalue < 1e-3, f"an unnormalised q went unnoticed (p = {pvalue:.2g})"


def test_shared_vocab_maps_drafter_ids_to_verifier_ids_of_the_same_text():
    """Hand-checked on the pair above: each shared drafter id maps to the verifier id of its own text, q keeps its mass
    on shared ids (renormalised) and lands on the verifier's ids; tokenizers that do not decode token by token
    (``tiny_tokenizer`` joins words with spaces) share nothing."""
    from metasd.drafters.shared_vocab import SharedVocab

    vtok, dtok = spaced_word_tokenizer(), char_tokenizer()
    shared = SharedVocab.build(vtok, dtok, len(dtok), "cpu")
    for d in shared.drafter_ids.tolist():
        assert vtok.decode([int(shared.table[d])]) == dtok.decode([d])
    w = dtok.get_vocab()["w"]
    unshared = next(i for i in range(len(dtok)) if not bool(shared.mask[i]))  # a merged 'w1'-style token
    q = torch.zeros(len(dtok))
    q[w], q[unshared] = 0.25, 0.75
    restricted = shared.restrict(q)
    assert float(restricted[w]) == 1.0 and float(restricted.sum()) == 1.0
    over_verifier = shared.to_verifier(restricted)
    assert float(over_verifier[vtok.get_vocab()["w"]]) == 1.0 and float(over_verifier.sum()) == 1.0
    assert SharedVocab.build(tiny_tokenizer(), dtok, len(dtok), "cpu") is None


def test_sliding_window_drafter_crops_past_its_window(verifier, monkeypatch):
    """A Gemma-3-style drafter (sliding-window layers, here a window of 3) keeps its cache in step however far back a
    re-alignment crops: its sliding layers keep every position (the window is the mask's), so a crop deeper than the
    window leaves exactly the keys and values of the tokens kept."""
    import metasd.drafters.pretrained as pretrained

    removed = []
    crop_to = pretrained.crop_to

    def counted(cache, length):
        removed.append(cache.get_seq_length() - length)
        crop_to(cache, length)

    monkeypatch.setattr(pretrained, "crop_to", counted)
    tok = spaced_word_tokenizer()
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    model = Gemma3ForCausalLM(cfg).eval()
    drafter = PretrainedDrafter(model, tok, k=5, verifier_tokenizer=verifier.tokenizer, name="g")
    engine = Engine(verifier, drafter)
    for temperature in (0.0, 1.0):
        run = engine._run(PROMPT, 30, temperature=temperature, seed=0)
        for _ in run.steps():
            ids = drafter.cached_ids
            assert drafter.cache.get_seq_length() == len(ids)
            with torch.no_grad():  # the cache holds the keys and values of exactly cached_ids
                step = model(torch.tensor([[5]]), **cache_kwargs(model, drafter.cache), use_cache=True).logits[0, -1]
                drafter.cache.crop(-1)
                fresh = model(torch.tensor([ids + [5]])).logits[0, -1]
            assert torch.allclose(step, fresh, atol=1e-4)
    assert max(removed) > 3, "no crop reached past the window of 3: the test did not exercise the deep crop"
    assert engine.generate(PROMPT, max_new_tokens=30).token_ids == plain_greedy(verifier.model, PROMPT, 30)


# ------------------------------------------------------------------------------------------------ pool entries
@pytest.fixture(scope="module")
def pool_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok")
    tiny_qwen(seed=0, layers=4, logit_scale=SHARP).save_pretrained(root / "verifier")
    model, tok = _spaced_drafter(SHARP / 3)
    model.save_pretrained(root / "other")
    tok.save_pretrained(root / "other")  # a Llama folder: AutoTokenizer gives this tokenizer back as it is
    model.save_pretrained(root / "no_tokenizer")
    return root


def _models(root) -> ModelCache:
    """The verifier with its word-level tokenizer (AutoTokenizer would reload it beside a Qwen2 model as Qwen2's BPE)."""
    from metasd.models import load_model

    cache = ModelCache("cpu")
    model, _ = load_model(str(root / "verifier"), dtype="fp32", device="cpu")
    cache.put(str(root / "verifier"), "fp32", (model, tiny_tokenizer()))
    return cache


def _pool(root, **entry) -> dict:
    return {"verifier": {"model": str(root / "verifier"), "dtype": "fp32", "device": "cpu"},
            "drafters": [{"name": "other", "type": "pretrained", "model": str(root / "other"), "params": {"k": 3}, **entry}]}


def _write(root, pool, name="pool.yaml"):
    (root / name).write_text(yaml.safe_dump(pool))
    return root / name


def test_tokenizer_own_entry_builds_and_decodes_exactly(pool_root):
    engine = load_pool(_write(pool_root, _pool(pool_root, tokenizer="own")), models=_models(pool_root))
    drafter = engine.drafter("other")
    assert drafter.bridge is not None and drafter.describe()["tokenizer"] == "own"
    result = engine.generate(PROMPT, max_new_tokens=20)
    assert result.token_ids == plain_greedy(engine.verifier.model, PROMPT, 20)
    assert result.stats.accepted > 0


def test_a_different_tokenizer_is_refused_by_default_with_both_names(pool_root):
    with pytest.raises(TokenizerMismatchError) as err:
        load_pool(_write(pool_root, _pool(pool_root)), models=_models(pool_root))
    msg = str(err.value)
    assert f"verifier {str(pool_root / 'verifier')!r} and drafter 'other (model {pool_root / 'other'})'" in msg
    assert "`tokenizer: own` in its pool entry" in msg
    assert parse_pool_config(_pool(pool_root)).drafters[0].tokenizer == "shared"


def test_tokenizer_own_is_refused_for_types_that_cannot_translate(pool_root):
    for kind, extra in (("ngram", {}), ("pretrained_tree", {"model": str(pool_root / "other")})):
        pool = _pool(pool_root, tokenizer="own", type=kind, params={}, **extra)
        if kind == "ngram":
            del pool["drafters"][0]["model"]
        with pytest.raises(ValueError, match=rf"drafters.0.tokenizer: drafter type '{kind}' cannot draft with a "
                                              rf"tokenizer of its own; types that can: pretrained"):
            parse_pool_config(pool)
    with pytest.raises(ValueError, match="drafters.0.tokenizer"):
        parse_pool_config(_pool(pool_root, tokenizer="mine"))


def test_tokenizer_own_with_a_model_without_tokenizer_names_the_drafter_and_both_models(pool_root):
    pool = _pool(pool_root, tokenizer="own", model=str(pool_root / "no_tokenizer"))
    with pytest.raises(ModelLoadError) as err:
        load_pool(_write(pool_root, pool), models=_models(pool_root))
    msg = str(err.value)
    assert f"drafter 'other' (model {str(pool_root / 'no_tokenizer')!r}, tokenizer: own) for verifier " \
           f"{str(pool_root / 'verifier')!r}: cannot load the tokenizer" in msg


def test_tokenizer_own_with_a_tokenizer_that_cannot_round_trip_is_a_config_error(pool_root, tmp_path):
    model, _ = _spaced_drafter(SHARP / 3)
    no_six = _bpe_tokenizer([c for c in _chars(VOCAB) if c != "6"], [])
    model.save_pretrained(tmp_path / "bad")
    no_six.save_pretrained(tmp_path / "bad")
    with pytest.raises(ConfigError, match=r"drafters.0 \('other'\): drafter 'other' .*tokenizer: own\) for verifier .*"
                                          r"cannot round-trip the verifier's text"):
        load_pool(_write(pool_root, _pool(pool_root, tokenizer="own", model=str(tmp_path / "bad"))),
                  models=_models(pool_root))
