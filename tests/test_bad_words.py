"""vLLM's ``bad_words`` (metasd/core/decoding/bad_words.py): the token sequences a word bans, and the mask each draft
row gets from its own path. Output identity with plain decoding under the same ban (chains, trees, lookups, the
scheduler, sampling) is checked with the other processing in tests/test_penalties.py."""
import pytest
import torch

from metasd.core.decoding.bad_words import MAX_BAD_WORDS, BadWords, bad_word_sequences
from metasd.core.engine import Engine
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from tiny import spaced_word_tokenizer, tiny_qwen, tiny_tokenizer


def test_a_word_bans_its_tokens_as_written_and_after_a_space():
    """vLLM's rule: each word encoded as written (leading spaces dropped) and after one space, the spaced form kept
    where its first token differs and it has as many tokens; repeats dropped."""
    tok = tiny_tokenizer()  # word-level: a space changes nothing
    assert bad_word_sequences(["w12", " w9 w33", "w12"], tok) == [(12,), (9, 33)]
    bpe = spaced_word_tokenizer()  # ' w12' is one token; 'w12' without its space is spelled in pieces
    plain, spaced = bpe.encode("w12", add_special_tokens=False), bpe.encode(" w12", add_special_tokens=False)
    assert len(spaced) == 1 and len(plain) > 1  # different lengths: only the form as written is banned
    assert bad_word_sequences(["w12"], bpe) == [tuple(plain)]
    both = bpe.encode(" w", add_special_tokens=False), bpe.encode("w", add_special_tokens=False)
    assert len(both[0]) == len(both[1]) == 1 and both[0] != both[1]
    assert bad_word_sequences(["w"], bpe) == [tuple(both[1]), tuple(both[0])]  # the same length: both banned


@pytest.mark.parametrize("words, message", [("w12", "bad_words must be a list of strings, got str"),
                                            ([""], r"bad_words\[0\] must be a non-empty string"),
                                            (["w3", 5], r"bad_words\[1\] must be a non-empty string, got 5"),
                                            (["w3"] * (MAX_BAD_WORDS + 1), "at most 128 words")])
def test_bad_values_are_refused_naming_the_field(words, message):
    engine = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ValueError, match=message):
        engine.generate([0, 5], 3, bad_words=words)
    with pytest.raises(ValueError, match="bad_words: .* has no tokenizer"):
        Engine(Verifier(tiny_qwen(seed=0)), None).generate([0, 5], 3, bad_words=["w3"])


def test_rows_are_masked_along_their_own_path():
    """A one-token word is masked in every row; a longer one only where the generated tokens before the row - the
    committed ones, then the node's ancestors - end with its prefix. The prompt does not count."""
    bad = BadWords([(4,), (2, 3), (1, 2, 0)])
    logits = torch.zeros(5, 5)  # [n+1, vocab]: the root and four nodes
    draft = Draft(tokens=torch.tensor([2, 1, 2, 2]), parents=torch.tensor([-1, -1, 1, 0]))  # 2; 1 -> 2; and 2 -> 2
    out = bad.apply(logits, draft.paths())
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, 0, inf]  # nothing generated yet
    assert out[1].tolist() == [0, 0, 0, inf, inf]  # after 2: 3 would complete (2, 3)
    assert out[2].tolist() == [0, 0, 0, 0, inf]  # after 1
    assert out[3].tolist() == [inf, 0, 0, inf, inf]  # after 1, 2: both (2, 3) and (1, 2, 0)
    assert out[4].tolist() == [0, 0, 0, inf, inf]  # after 2, 2
    bad.commit([7, 1])  # the committed text ends with 1: its rows follow it
    assert bad.apply(logits, Draft(tokens=torch.tensor([2]), parents=torch.tensor([-1])).paths())[1, 0] == inf
    assert logits.abs().sum() == 0  # the verifier's logits are not touched (log-probabilities read them raw)


def test_a_ban_that_leaves_nothing_to_generate_fails_naming_the_field():
    """Allowed tokens that are all banned: the request fails naming bad_words (a softmax over nothing is NaN)."""
    from metasd.core.constraints import ConstraintError
    engine = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer()), None, check_tokenizers=False)
    with pytest.raises(ConstraintError, match="bad_words"):
        engine.generate([0, 5], 3, allowed_token_ids=[12], bad_words=["w12"])
