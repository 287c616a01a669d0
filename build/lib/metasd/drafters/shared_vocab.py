"""The tokens two vocabularies share, for exact rejection sampling of a cross-tokenizer draft.

A translated draft (``metasd.drafters.token_bridge``) carries no verifier-token probabilities, so under sampling it
is verified by sample-and-match, which accepts a drafted token only when the verifier samples that very token. Where
a drafter token's text is exactly one verifier token's text, the drafter can instead sample among those shared
tokens only: its processed distribution q restricted to the shared ids and renormalised is then a distribution
over verifier ids, the draft is those verifier ids, and the verifier accepts each with min(1, p(x) / q(x)) - the
rejection rule of any drafter with probabilities (Leviathan et al. 2023), exact because every drafted token was
drawn from the q it is checked against. Tokens outside the intersection are never drafted this way (their q is 0);
the verifier still produces them through the residual. transformers' universal assisted generation does the same
for sampling ("vocabulary intersection"); here a token's text is its own decode, so both tokenizers must decode
token by token to the same text as a whole sequence (checked on a probe text; else ``build`` returns ``None``).
"""
from __future__ import annotations

import torch

from .token_bridge import PROBE_TEXT


def _token_texts(tokenizer) -> list[str]:
    """The decoded text of every id of the tokenizer, one by one."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))])


def _decodes_token_by_token(tokenizer) -> bool:
    """Whether the texts of a sequence's tokens, decoded one at a time, join into the sequence's text."""
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    return "".join(tokenizer.decode([i]) for i in ids) == tokenizer.decode(ids)


class SharedVocab:
    """The drafter ids whose text is the text of one verifier id, as a lookup on the drafter's device.

    ``restrict(q)`` keeps a drafter distribution's mass on the shared ids (renormalised; ``None`` when it has none
    there); ``to_verifier(q)`` writes such a distribution over the verifier's ids (``width`` of them: every shared
    verifier id is below it); ``verifier_ids`` maps drafted drafter ids to verifier ids."""

    def __init__(self, drafter_to_verifier: dict[int, int], drafter_vocab: int, device: torch.device | str):
        if not drafter_to_verifier:
            raise ValueError("SharedVocab: the two vocabularies share no token")
        table = torch.full((drafter_vocab,), -1, dtype=torch.long)
        table[torch.tensor(list(drafter_to_verifier))] = torch.tensor(list(drafter_to_verifier.values()))
        self.table = table.to(device)  # [drafter vocab] verifier id, -1 where the drafter id is not shared
        self.mask = self.table >= 0  # [drafter vocab]
        self.drafter_ids = self.mask.nonzero().flatten()  # [n shared]
        self.verifier_of_shared = self.table[self.drafter_ids]  # [n shared]
        self.width = int(self.verifier_of_shared.max()) + 1
        self.size = len(drafter_to_verifier)
        self._host = dict(drafter_to_verifier)

    @classmethod
    def build(cls, verifier_tokenizer, drafter_tokenizer, drafter_vocab: int, device, keep: frozenset[int] = frozenset()
              ) -> "SharedVocab | None":
        """From the two tokenizers: drafter ids (below ``drafter_vocab``, the drafter's logits) whose decoded text is
        the decoded text of a verifier id; special tokens only where listed in ``keep`` (drafter ids of special
        tokens the verifier has too, mapped by their token string). ``None`` when a tokenizer does not decode token
        by token or nothing is shared."""
        if not (_decodes_token_by_token(verifier_tokenizer) and _decodes_token_by_token(drafter_tokenizer)):
            return None
        v_special, d_special = set(verifier_tokenizer.all_special_ids), set(drafter_tokenizer.all_special_ids)
        by_text: dict[str, int] = {}
        for i, text in enumerate(_token_texts(verifier_tokenizer)):
            if text and "\ufffd" not in text and i not in v_special:
                by_text.setdefault(text, i)
        pairs = {}
        for i, text in enumerate(_token_texts(drafter_tokenizer)[:drafter_vocab]):
            if i in d_special or not text or "\ufffd" in text:
                continue
            if text in by_text:
                pairs[i] = by_text[text]
        v_vocab = verifier_tokenizer.get_vocab()
        for i in keep:
            token = drafter_tokenizer.convert_ids_to_tokens(int(i))
            if i < drafter_vocab and token in v_vocab:
                pairs[int(i)] = v_vocab[token]
        return cls(pairs, drafter_vocab, device) if pairs else None

    def verifier_ids(self, drafted: list[int]) -> list[int]:
        """The verifier ids of drafted shared drafter ids (host ints, no device work)."""
        return [self._host[d] for d in drafted]

    def restrict(self, q: torch.Tensor) -> torch.Tensor | None:
        """q: [drafter vocab] probabilities -> q on the shared ids only, renormalised (None: no mass there; a host
        read)."""
        kept = q * self.mask
        total = kept.sum()
        if float(total) <= 0:
            return None
        return kept / total

    def to_verifier(self, q: torch.Tensor) -> torch.Tensor:
        """q: [drafter vocab], zero off the shared ids -> the same distribution over verifier ids: [width]."""
        out = torch.zeros(self.width, dtype=q.dtype, device=q.device)
        return out.index_add_(0, self.verifier_of_shared, q[self.drafter_ids])
