"""Incremental detokenisation (metasd.core.decoding.detokenize): the deltas add up to the whole decode, on a word-level
tokenizer and on a byte-level BPE one where characters span tokens."""
import random

import pytest

from metasd.core.decoding.detokenize import IncrementalDetokenizer, find_stop
from tiny import tiny_tokenizer


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        yield ids[i:i + n]
        i += n


@pytest.mark.parametrize("make", [tiny_tokenizer, _byte_level_tokenizer])
def test_deltas_add_up_to_the_whole_decode(make):
    tok = make()
    rng = random.Random(0)
    texts = ["héllo wörld — ünïcode ✓ 日本語 text", "plain ascii words here", "emoji 😀 and more 🎉!"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(5):
            detok = IncrementalDetokenizer(tok)
            deltas = [detok.add(c) for c in _chunks(ids, rng)]
            out = "".join(deltas) + detok.flush()
            assert out == tok.decode(ids, skip_special_tokens=True)
            assert all("\ufffd" not in d for d in deltas)  # never an incomplete character mid-stream


def test_an_incomplete_character_waits_for_the_next_token():
    tok = _byte_level_tokenizer()
    ids = tok.encode("é", add_special_tokens=False)
    assert len(ids) == 2  # two bytes, two tokens
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == "é"


def test_find_stop_searches_only_what_new_text_can_complete():
    assert find_stop("abc STOP def", ["STOP"]) == 4
    assert find_stop("abc STOP def", ["STOP"], start=9) is None  # fully inside text already checked
    assert find_stop("abc ST", ["STOP"], start=4) is None
    assert find_stop("abc STOP", ["STOP"], start=6) == 4  # completed by the new text
    assert find_stop("x END y STOP", ["STOP", "END"], start=0) == 2
    assert find_stop("anything", []) is None
