"""The verifier: the target LLM that scores a whole draft (chain or tree) in one forward pass.

Cache convention: the verifier's KV cache holds every committed token except the last one (the
"pending" token, the bonus of the previous step). A step forwards [pending] + draft nodes, so row 0 of
the output is the distribution after the pending token and row i+1 the distribution after node i.
After acceptance, ``commit`` keeps the pending token and the accepted nodes in the cache; the new bonus
becomes the pending token. Committed tokens are never recomputed. The verifier remembers where the block it
verified starts, and keeps the hidden states drafters read (``hidden``) in step with its cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedModel

from .graph_runner import GraphRunner, resolve_graphs
from .hidden import HiddenStore
from .hooks import contiguous_lm_head_input
from .kv_cache import cache_kwargs, cache_length, keep_positions
from .logprobs import PROMPT_LOGPROBS_CHUNK, TokenLogprob, token_logprobs
from .static_cache import StaticKVCache, new_cache
from .staging import to_device
from .tree import Draft


@dataclass
class VerifierOutput:
    """What one verification forward returns."""

    logits: torch.Tensor  # [n+1, vocab] raw logits: row 0 after the pending token, row i+1 after node i
    hidden: dict[int, torch.Tensor]  # layer -> [n+1, d] residual stream at the same rows
    choices: torch.Tensor | None = None  # [n+1] argmax of ``logits`` on the device (a batch computes all rows' at once)
    choices_read: list[int] | None = None  # ``choices`` on the host, read with the batch's (``read_choices``)


def verify_ids(pending: int, draft: Draft, device: torch.device) -> torch.Tensor:
    """[n+1] int64 on ``device``: the pending token, then the draft's tokens - taken where they were drafted when that
    is ``device`` (a chain drafted there is not read by the host before its acceptance), else staged from the host."""
    return torch.cat([to_device(torch.tensor([pending], dtype=torch.long), device), draft.device_tokens(device)])


class Verifier:
    """Wraps a transformers causal LM with its KV cache: prefill, verify a draft, commit the accepted path.

    ``hidden`` holds, for the layers asked for at ``prefill``, the verifier's hidden states at every cached
    position (None when no layer was asked for): drafters that read verifier states get it as ``ctx.hidden``.

    ``graphs`` ("auto", "on", "off"): verify forwards replayed from CUDA graphs at fixed shapes (``graph_runner.py``);
    auto = where the model is on CUDA. ``fixed_shapes`` runs those shapes and buffers eagerly without capturing (the
    CPU check of the graph path; default: as ``graphs`` resolves). With fixed shapes the KV buffers are kept from one
    request to the next (the graphs read them by address).
    """

    backend = "torch"
    #: ``prefill`` takes the whole prompt and keeps the logits after it, so a request draws its first token with the
    #: prefill (``Request.first_token``); a verifier without it is given all but the last token, left pending
    prefills_prompt = True

    def __init__(self, model: PreTrainedModel, tokenizer=None, name: str = "verifier", *, graphs: str = "auto",
                 fixed_shapes: bool | None = None):
        self.model = contiguous_lm_head_input(model.eval())
        self.tokenizer = tokenizer
        self.name = name
        self.capture = resolve_graphs(graphs, model.device, name)
        self.fixed_shapes = self.capture or bool(fixed_shapes) or graphs == "fixed"
        self.runner: GraphRunner | None = None
        self.cache: StaticKVCache | None = None
        self.hidden: HiddenStore | None = None
        self.hidden_layers: tuple[int, ...] = ()
        self._block_start: int | None = None  # cached positions before the block last verified, until its commit
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

    def describe(self) -> str:
        """Where its forwards run, for a log line."""
        return f"{self.name} on torch ({self.device}, {str(self.dtype).removeprefix('torch.')})"

    @property
    def cached(self) -> int:
        """Number of positions in the KV cache (committed tokens minus the pending one)."""
        return 0 if self.cache is None else cache_length(self.cache)

    def reset(self, reserve: int = 0) -> None:
        """An empty KV cache with room for ``reserve`` positions (with fixed shapes: the same buffers, emptied)."""
        if self.fixed_shapes and self.cache is not None:
            self.cache.set_length(0)
            self.cache.reserve(reserve)
        else:
            self.cache = new_cache(self.model, reserve, self.name)
        self.hidden = None
        self._block_start = None

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, hidden_layers: Sequence[int] = (), reserve: int = 0,
                score: Sequence[int] | None = None, top: int = 0) -> list[TokenLogprob] | None:
        """Start a request: cache ``token_ids`` (the whole prompt: ``prefills_prompt``) and, for ``hidden_layers``,
        their hidden states in ``self.hidden``; the logits after the last one are kept in ``last_logits`` ([1, vocab]),
        the first new token's. token_ids: [T] int64. ``reserve``: the positions the request may reach (its KV buffers
        are allocated that wide now; a forward past them grows them). ``score``: the tokens that follow each position
        (the prompt's tokens 1..T-1): their raw log-probabilities (``top`` alternatives each) are returned, computed
        ``PROMPT_LOGPROBS_CHUNK`` positions per forward."""
        self.reset(max(reserve, len(token_ids)))
        self.last_logits = None
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        self.hidden = HiddenStore(self.hidden_layers) if self.hidden_layers else None
        if len(token_ids) == 0:
            if self.hidden is not None:
                self.hidden.append({layer: torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
                                    for layer in self.hidden_layers})
            return [] if score is not None else None
        scored: list[TokenLogprob] = []
        chunk = len(token_ids) if score is None else PROMPT_LOGPROBS_CHUNK
        for start in range(0, len(token_ids), chunk):
            part = token_ids[start: start + chunk]
            out = self.model(
                input_ids=to_device(part, self.device)[None],
                **cache_kwargs(self.model, self.cache),
                use_cache=True,
                # the last row's logits only (the first new token's), unless asked to score the prompt
                logits_to_keep=1 if score is None else 0,
                output_hidden_states=bool(self.hidden_layers),
            )
            if self.hidden is not None:
                self.hidden.append(self._select_hidden(out))
            if score is not None:
                scored += token_logprobs(out.logits[0], score[start: start + len(part)], top)
        self.last_logits = out.logits[0, -1:]  # [1, vocab]: after the last token
        return scored if score is not None else None

    def _fixed_runner(self) -> GraphRunner:
        """The fixed-shape runner over this cache, for the hidden layers of this request."""
        r = self.runner
        if r is None or r.cache is not self.cache or r.hidden_layers != self.hidden_layers:
            self.runner = r = GraphRunner(self.model, self.cache, capture=self.capture, hidden_layers=self.hidden_layers)
        return r

    @torch.inference_mode()
    def verify(self, pending: int, draft: Draft) -> VerifierOutput:
        """Score [pending] + draft in one forward; a tree uses an ancestor-only 4-D mask.

        The cache grows by n+1 positions until ``commit`` keeps the accepted ones.
        """
        if self.cache is None:
            raise RuntimeError("Verifier.verify called before prefill")
        if self._block_start is not None:
            raise RuntimeError("Verifier.verify called twice without a commit in between")
        past = self._block_start = self.cached
        runner = self._fixed_runner() if self.fixed_shapes else None
        if runner is not None and runner.fits(len(draft) + 1):
            tokens = verify_ids(pending, draft, self.device)  # [n+1]
            depth = torch.tensor(draft.layout.depths)  # [n+1], the root's 0 first
            block = draft.layout.mask  # [n+1, n+1] (read only); a chain's is lower-triangular
            return VerifierOutput(*runner.forward(tokens, depth, block))
        ids = verify_ids(pending, draft, self.device)[None]  # [1, n+1]
        kwargs = {}
        if len(draft) and not draft.is_chain:
            depth = torch.tensor(draft.layout.depths)  # [n+1], the root's 0 first
            tree = draft.layout.mask  # [n+1, n+1] (read only)
            mask = torch.cat([torch.ones(len(tree), past, dtype=torch.bool), tree], dim=1)  # [n+1, past+n+1]
            kwargs["attention_mask"] = to_device(mask, self.device)[None, None]
            kwargs["position_ids"] = to_device(past + depth, self.device)[None]
        out = self.model(
            input_ids=ids,
            **cache_kwargs(self.model, self.cache),
            use_cache=True,
            output_hidden_states=bool(self.hidden_layers),
            **kwargs,
        )
        return VerifierOutput(out.logits[0], self._select_hidden(out))

    @torch.inference_mode()
    def commit(self, path: Sequence[int], out: VerifierOutput | None = None) -> torch.Tensor:
        """Keep the pending token and the accepted nodes ``path`` of the block last verified in the KV cache and,
        given the verify output ``out``, their hidden states in ``hidden``, so both hold exactly the committed
        positions. Returns the kept rows [n_acc + 1] of the verified block."""
        if self._block_start is None:
            raise RuntimeError("Verifier.commit called without a verified block")
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)
        keep_positions(self.cache, self._block_start, rows)
        self._block_start = None
        if self.hidden is not None:
            if out is None:
                raise ValueError("Verifier.commit: the verify output is needed to keep the hidden states in step")
            self.hidden.append(out.hidden, to_device(rows, self.device))
        return rows

    def _select_hidden(self, out) -> dict[int, torch.Tensor]:
        if not self.hidden_layers:
            return {}
        states = out.hidden_states  # tuple of num_layers+1: [0] embeddings, [i] output of layer i-1, [-1] after the final norm
        return {layer: states[layer][0] for layer in self.hidden_layers}
