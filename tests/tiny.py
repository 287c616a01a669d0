"""Tiny randomly initialised models and tokenizers built inside the tests (no downloads)."""
from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def tiny_words(vocab: int = VOCAB) -> list[str]:
    """The tokens of ``tiny_tokenizer``, by id."""
    return ["<s>", "</s>", ":", "user", "assistant", "system"] + [f"w{i}" for i in range(6, vocab)]


def tiny_tokenizer(vocab: int = VOCAB, chat: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: tokens '<s>', '</s>', ':', then 'w3'..; words split on whitespace."""
    words = tiny_words(vocab)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="w6")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def _bpe_tokenizer(tokens: list[str], merges: list[tuple[str, str]], pre_tokenizer=None,
                   specials: bool = True) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over ``tokens`` whose decoder joins the pieces as they are; ``specials``: '<s>' and '</s>' come
    first, as its special BOS and EOS tokens."""
    head = ["<s>", "</s>"] if specials else []
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(head + tokens)}, merges))
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Fuse()
    if not specials:
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _chars(vocab: int) -> list[str]:
    return sorted({c for w in tiny_words(vocab) for c in w} | {" "})


def spaced_word_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A drafter tokenizer of another kind than ``tiny_tokenizer``, over the same words: BPE from characters, each word
    one token with the space before it (' w12', merged ' ' + 'w', ' w' + '1', ' w1' + '2'; '<s>' also without the
    space, as a text starts), other ids, a larger vocabulary, no special tokens. A text of ``tiny_tokenizer``'s words
    encodes to one token per word (``spaced_word_map``)."""
    tokens, merges = _chars(vocab), []
    for word in [" " + w for w in tiny_words(vocab)] + ["<s>"]:
        piece = word[0]
        for c in word[1:]:
            if piece + c not in tokens:
                tokens.append(piece + c)
                merges.append((piece, c))
            piece += c
    return _bpe_tokenizer(tokens, merges, pre_tokenizers.Split(Regex(r" ?[^ ]+| +"), behavior="isolated"),
                          specials=False)


def spaced_word_map(drafter_tok, vocab: int = VOCAB) -> dict[int, int]:
    """drafter id -> ``tiny_tokenizer`` id of the same word (' w12' -> 'w12'; '<s>' and ' <s>' -> '<s>')."""
    ids = drafter_tok.get_vocab()
    return {ids["<s>"]: 0, **{ids[" " + w]: i for i, w in enumerate(tiny_words(vocab))}}


def char_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A drafter tokenizer that splits ``tiny_tokenizer``'s words into characters (the space is a token too) and
    merges pairs: 'w' with the digit after it ('w12' -> 'w1', '2'; 'w7' -> 'w7')."""
    chars = _chars(vocab)
    pairs = [("w", d) for d in "0123456789"]
    return _bpe_tokenizer(chars + [a + b for a, b in pairs], pairs)


def letter_tokenizer(letters: str, merges: list[tuple[str, str]] = ()) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over the characters ``letters`` (ids in that order) and then the ``merges`` (one token each),
    no special tokens: a tiny vocabulary that decodes token by token. Two of them over the same letters in another
    order, with other merges, share the letters at other ids (``drafters/shared_vocab.py``)."""
    return _bpe_tokenizer(list(letters) + [a + b for a, b in merges], list(merges), specials=False)


def as_llama(qwen: Qwen2ForCausalLM, vocab: int, token_map: dict[int, int] | None = None) -> LlamaForCausalLM:
    """A Llama with ``qwen``'s layers (attention biases as Qwen2's) over a vocabulary of ``vocab`` ids: id d takes the
    embedding and LM-head row of qwen's id ``token_map[d]``, ids not in the map zero rows. A model of another
    vocabulary that computes what ``qwen`` computes on the mapped ids (``AutoTokenizer`` loads a Llama folder's
    tokenizer as it was saved, where it turns a Qwen2 folder's word-level tokenizer into Qwen2's BPE)."""
    c = qwen.config
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                      rms_norm_eps=c.rms_norm_eps, attention_bias=True, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    state = {k: v for k, v in qwen.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("o_proj.bias"):
                param.zero_()
        for new, old in ((model.model.embed_tokens.weight, qwen.model.embed_tokens.weight),
                         (model.lm_head.weight, qwen.lm_head.weight)):
            new.zero_()
            for d, v in (token_map or {}).items():
                new[d] = old[v]
    model.generation_config.eos_token_id = None
    return model


def tiny_qwen(seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, context: int = 256,
              logit_scale: float = 1.0, eos: int | None = None) -> Qwen2ForCausalLM:
    """A random Qwen2 in fp32. ``logit_scale`` sharpens its next-token distributions."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False, eos_token_id=eos, bos_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = eos
    return model


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, context: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      eos_token_id=None, bos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def plain_greedy(model, prompt: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    """Reference greedy decoding by full recomputation (no KV cache), independent of metasd."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        nxt = int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax())
        ids.append(nxt)
        out.append(nxt)
        if nxt in eos:
            break
    return out
