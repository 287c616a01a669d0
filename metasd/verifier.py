"""The verifier: the target LLM that scores a whole draft (chain or tree) in one forward pass.

Cache convention: the verifier's KV cache holds every committed token except the last one (the
"pending" token, the bonus of the previous step). A step forwards [pending] + draft nodes, so row 0 of
the output is the distribution after the pending token and row i+1 the distribution after node i.
After acceptance, ``commit`` keeps the pending token and the accepted nodes in the cache; the new bonus
becomes the pending token. Committed tokens are never recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .hooks import contiguous_lm_head_input
from .kv_cache import cache_length, keep_positions
from .tree import Draft, ancestor_mask


@dataclass
class VerifierOutput:
    """What one verification forward returns."""

    logits: torch.Tensor  # [n+1, vocab] raw logits: row 0 after the pending token, row i+1 after node i
    hidden: dict[int, torch.Tensor]  # layer -> [n+1, d] residual stream at the same rows


class HiddenStore:
    """Verifier hidden states of requested layers at every cached position (for steering / context).

    Row j holds the hidden state computed from committed token j, i.e. the state that predicts token
    j+1. Appends are cheap (chunks), ``get`` concatenates lazily.
    """

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(sorted(set(layers)))
        self._chunks: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, hidden: dict[int, torch.Tensor], rows: torch.Tensor | None = None) -> None:
        n = None
        for layer in self.layers:
            h = hidden[layer] if rows is None else hidden[layer].index_select(0, rows)
            self._chunks[layer].append(h)
            n = len(h)
        self._length += n or 0

    def get(self, layer: int) -> torch.Tensor:
        """[length, d] states of ``layer`` at every cached position."""
        chunks = self._chunks[layer]
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        return chunks[0]

    def last(self, layer: int) -> torch.Tensor:
        """[d] state at the last cached position (the one that produced the pending token)."""
        return self._chunks[layer][-1][-1]


class Verifier:
    """Wraps a transformers causal LM with its KV cache: prefill, verify a draft, commit the accepted path."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, name: str = "verifier"):
        self.model = contiguous_lm_head_input(model.eval())
        self.tokenizer = tokenizer
        self.name = name
        self.cache: DynamicCache | None = None
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cached(self) -> int:
        """Number of positions in the KV cache (committed tokens minus the pending one)."""
        return 0 if self.cache is None else cache_length(self.cache)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, hidden_layers: Sequence[int] = ()) -> dict[int, torch.Tensor]:
        """Start a request: cache ``token_ids`` (every prompt token but the last, which stays pending).

        token_ids: [T] int64. Returns layer -> [T, d] hidden states when ``hidden_layers`` is given.
        """
        self.reset()
        if len(token_ids) == 0:
            return {layer: torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device) for layer in hidden_layers}
        out = self.model(
            input_ids=token_ids.to(self.device)[None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,  # nothing reads prefill logits: the pending token is scored in the first step
            output_hidden_states=bool(hidden_layers),
        )
        return self._select_hidden(out, hidden_layers)

    @torch.inference_mode()
    def verify(self, pending: int, draft: Draft, hidden_layers: Sequence[int] = ()) -> VerifierOutput:
        """Score [pending] + draft in one forward; a tree uses an ancestor-only 4-D mask.

        The cache grows by n+1 positions until ``commit`` keeps the accepted ones.
        """
        if self.cache is None:
            raise RuntimeError("Verifier.verify called before prefill")
        past = self.cached
        ids = torch.cat([torch.tensor([pending], dtype=torch.long), draft.tokens]).to(self.device)[None]  # [1, n+1]
        kwargs = {}
        if len(draft) and not draft.is_chain:
            depth = torch.cat([torch.zeros(1, dtype=torch.long), draft.depths()])  # [n+1]
            tree = ancestor_mask(draft.parents)  # [n+1, n+1]
            mask = torch.cat([torch.ones(len(tree), past, dtype=torch.bool), tree], dim=1)  # [n+1, past+n+1]
            kwargs["attention_mask"] = mask.to(self.device)[None, None]
            kwargs["position_ids"] = (past + depth).to(self.device)[None]
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            **kwargs,
        )
        return VerifierOutput(out.logits[0], self._select_hidden(out, hidden_layers))

    @torch.inference_mode()
    def commit(self, start: int, path: Sequence[int], out: VerifierOutput | None = None,
               store: HiddenStore | None = None) -> torch.Tensor:
        """Keep the pending token and the accepted nodes ``path`` of the block verified at ``start`` in the KV
        cache and, given the verify output ``out`` and a ``store``, their hidden states in the store, so both
        hold exactly the committed positions. Returns the kept rows [n_acc + 1] of the verified block."""
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)
        keep_positions(self.cache, start, rows)
        if store is not None:
            store.append(out.hidden, rows)
        return rows

    def _select_hidden(self, out, hidden_layers: Sequence[int]) -> dict[int, torch.Tensor]:
        if not hidden_layers:
            return {}
        states = out.hidden_states  # tuple of num_layers+1: [0] embeddings, [i] output of layer i-1, [-1] after the final norm
        return {layer: states[layer][0] for layer in hidden_layers}
