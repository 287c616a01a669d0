"""Tiny randomly initialised models and tokenizers built inside the tests (no downloads)."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def tiny_tokenizer(vocab: int = VOCAB, chat: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: tokens '<s>', '</s>', ':', then 'w3'..; words split on whitespace."""
    words = ["<s>", "</s>", ":", "user", "assistant", "system"] + [f"w{i}" for i in range(6, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="w6")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


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
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        out.append(nxt)
        if nxt in eos:
            break
    return out
