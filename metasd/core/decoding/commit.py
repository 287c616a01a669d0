"""How a request's tokens are accepted and committed (``Commits``, a part of ``Request``): a step's draft against the
verifier's rows by an exact rule, or the first token from the prefill's logits; then cut at the request's end as plain
decoding would cut it, and recorded in the grammar, the log-probabilities and the context buffer."""
from __future__ import annotations

from typing import Sequence

import torch

from ..execution.tree import Draft
from ..execution.verifier import VerifierOutput
from ..execution.logprobs import step_logprobs
from .acceptance import accept_greedy, accept_keyed, accept_match, accept_rejection
from .sampling import process_logits


class Commits:
    """The acceptance and commit half of ``Request`` (request.py holds its state: ``processing``, ``sampling``,
    ``noise``, ``generator``, ``eos``, ``stats``, ``buffer`` and ``length``, ``new_ids``, the stop text)."""

    def first_token(self, logits: torch.Tensor, choice: torch.Tensor | None = None,
                    read: list[int] | None = None) -> tuple[list[int], bool]:
        """The first new token from the prefill's logits after the whole prompt (logits: [1, vocab]; a scheduler
        whose prefill keeps them: ``Prefill.last_logits``), drawn as a step with no draft draws its bonus token - the
        same processing, sampling and key - before any step (``stats.prefill_committed``), so that it is sent as
        soon as the prompt is in. ``choice`` ([1] on the device) and ``read`` (on the host): the row's greedy choice,
        read with other requests'. Returns (the committed tokens, whether the request is over)."""
        acc, _, _ = self._accept(VerifierOutput(logits, {}, choice, read), Draft.empty())
        self.stats.prefill_committed = 1
        return self._keep([acc.bonus], logits, acc.path)

    def _accept(self, out: VerifierOutput, draft: Draft):
        """The exact acceptance of ``draft`` against the verifier's rows ``out``: (the ``Acceptance``, the rows' greedy
        choices or None, their processed probabilities or None)."""
        # [n+1, vocab]: the grammar mask and penalties, each row along its own path (then temperature, top-k, top-p)
        logits = out.logits if self.processing is None else self.processing.apply(out.logits, draft)
        if self.sampling.greedy:  # the raw logits' argmax: a batch's (read at once) where no processing changed them
            batch = out.choices is not None and self.processing is None
            target_argmax = out.choices if batch else logits.argmax(-1)  # [n+1] on the device
            return accept_greedy(draft, target_argmax, out.choices_read if batch else None), target_argmax, None
        target_probs = process_logits(logits, self.sampling)  # [n+1, vocab]
        if self.noise is not None:  # seeded: the verifier alone decides every token (row 0: position length)
            return accept_keyed(draft, target_probs, self.noise, self.length), None, target_probs
        rule = accept_match if draft.probs is None else accept_rejection
        return rule(draft, target_probs, self.generator), None, target_probs

    def _keep(self, committed: list[int], logits: torch.Tensor, path: Sequence[int]) -> tuple[list[int], bool]:
        """Commit a step's tokens as plain decoding would (``_commit``: to the request's end at most), then the
        grammar, the log-probabilities (from the raw rows ``logits`` along ``path``) and the context buffer."""
        kept, done = self._commit(committed, self.eos)
        if len(kept) < len(committed):  # tokens past the end (EOS, a stop, max_new_tokens) count for nothing
            self.stats.drop_uncommitted(len(committed) - len(kept))
        committed = kept
        if self.processing is not None:
            self.processing.commit(committed)
            if not done and self.processing.ended(self.eos):  # the grammar is complete and the model has no EOS
                done, self.stats.stop_reason = True, "stop"  # to end it with: plain constrained decoding stops here
        if self.token_logprobs is not None:  # of the tokens kept: the raw rows that scored them
            self.token_logprobs += step_logprobs(logits, path, committed, self.logprobs)
        self.buffer[self.length: self.length + len(committed)] = torch.tensor(committed, dtype=torch.long)
        self.length += len(committed)
        return committed, done

    def _commit(self, committed: list[int], eos: set[int]) -> tuple[list[int], bool]:
        """Append the step's committed tokens one at a time, as plain decoding would commit them: the first that is an
        EOS, completes a stop string or reaches ``max_new_tokens`` ends generation, and no token after it is kept (so
        the text, the tokens and their count are plain decoding's). Returns the tokens kept and whether it ended."""
        for i, t in enumerate(committed):
            self.new_ids.append(t)
            if t in eos:
                reason = "stop" if t in self.stop_ids else "eos"
                self._text.ended_by_token()
            elif self.stop and self._text.hit_stop(self.new_ids, checked_from=self.min_tokens):
                reason = "stop"
            elif len(self.new_ids) >= self.max_new_tokens:
                reason = "length"
            else:
                continue
            self.stats.stop_reason = reason
            return committed[: i + 1], True
        return committed, False
