"""A replay drafter for measuring the engine itself: it drafts the verifier's own greedy continuation, right for the
first ``accept`` tokens of every draft and wrong after, so a greedy request runs at exactly ``accept + 1`` tokens per
step whatever the text. With no drafting cost of its own, the time a step takes beyond the verifier's forward is the
engine's overhead (``benchmarks/gpu_overhead.py``).

The continuation is recorded by plain greedy decoding when a request begins (transformers' ``generate`` on the
verifier's weights with a cache of its own), or given with ``record``. Under bf16 a verify over several tokens may
break a near-tie differently from one-token decoding; when the committed text leaves the recording, the rest is
recorded again from there - inside that step, with ``rerecord`` (the default), and the cost model never counts a
recording. A benchmark sets ``rerecord=False`` and records enough up front: leaving the recording then raises
``ReplayMiss``, so no recording ever runs inside a timed step.
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from metasd.core.pricing.cost import unmetered
from metasd.core.decoding.drafter import Bool, Drafter, DrafterParams, Int, StepContext, check_params, register_drafter
from metasd.core.execution.tree import Draft


class ReplayParams(DrafterParams):
    """Pool-config ``params`` of the replay drafter."""

    accept: Int = Field(3, ge=0, description="draft tokens per step that are the verifier's own (tokens/step = accept + 1)")
    wrong: Int = Field(1, ge=0, description="wrong tokens drafted after them (verified and rejected)")
    rerecord: Bool = Field(True, description="record again inside the step when the committed text leaves the "
                                             "recording; false: raise ReplayMiss instead (benchmarks)")


class ReplayMiss(RuntimeError):
    """The committed text left the recording, or ran past its end, with ``rerecord=False``."""


@register_drafter
class ReplayDrafter(Drafter):
    """Drafts ``accept`` tokens of the verifier's greedy continuation, then ``wrong`` tokens that differ from it: a
    draft whose acceptance is known in advance, for overhead benchmarks (greedy requests; under sampling its drafts
    are verified exactly like any other, at whatever acceptance the samples give)."""

    verifier_weights = True  # runs / reads the verifier's torch model
    kind = "replay"
    model_field, checkpoint_field = "never", "never"
    Params = ReplayParams

    def __init__(self, verifier_model=None, accept: int = 3, wrong: int = 1, rerecord: bool = True,
                 name: str | None = None):
        super().__init__(name)
        check_params(ReplayParams, dict(accept=accept, wrong=wrong, rerecord=rerecord), self.name)
        self.verifier_model, self.accept, self.wrong, self.rerecord = verifier_model, accept, wrong, rerecord
        self.reference: list[int] = []  # the recorded continuation: every token after the prompt

    @classmethod
    def from_config(cls, name, params, build):
        build.refuse_quantize(name, cls.kind)
        return cls(build.verifier.model, name=name, **params)

    def record(self, prompt_ids: list[int], continuation: list[int]) -> None:
        """Use ``continuation`` (the verifier's greedy tokens after ``prompt_ids``) instead of recording one."""
        self.reference = list(prompt_ids) + list(continuation)

    @torch.inference_mode()
    def _record(self, tokens: list[int], n: int) -> None:
        """The verifier's greedy continuation of ``tokens`` for ``n`` tokens (plain decoding, its own cache)."""
        if self.verifier_model is None:
            raise ValueError(f"{self.name}: no verifier model to record a continuation with; call record() first")
        model = self.verifier_model
        ids = torch.tensor([tokens], device=model.device)
        with unmetered():  # a re-recording runs inside a step (propose): not the step's work, so not its cost
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        self.reference = out[0].tolist()

    def begin(self, ctx: StepContext) -> None:
        tokens = ctx.tokens.tolist()
        if self.reference[: len(tokens)] != tokens:
            if not self.rerecord:
                raise ReplayMiss(f"{self.name}: the prompt is not the recording's (rerecord is off)")
            self._record(tokens, int(ctx.request.get("max_new_tokens", 64)) + self.accept + self.wrong)

    def propose(self, ctx: StepContext) -> Draft:
        depth = min(self.accept + self.wrong, ctx.max_depth)
        T = len(ctx.tokens)
        if depth <= 0:
            return Draft.empty()
        if len(self.reference) < T + depth or self.reference[:T] != ctx.tokens.tolist():
            # off the recording (a bf16 tie broken the other way), or past its end: record from here
            if not self.rerecord:
                raise ReplayMiss(self._miss(ctx.tokens.tolist(), depth, ctx.step))
            self._record(ctx.tokens.tolist(), depth + 64)
        right = self.reference[T: T + min(self.accept, depth)]
        nxt = self.reference[T + len(right)] if len(self.reference) > T + len(right) else 0
        wrong = [(nxt + 1 + i) % self._vocab() for i in range(depth - len(right))]  # never the verifier's token
        return Draft.chain(right + wrong)

    def _miss(self, tokens: list[int], depth: int, step: int) -> str:
        T = len(tokens)
        at = next((i for i, (a, b) in enumerate(zip(self.reference, tokens)) if a != b), None)
        if at is not None:
            return (f"{self.name}: step {step}: the committed text left the recording at position {at} "
                    f"(committed {tokens[at]}, recorded {self.reference[at]}): a verify broke a near-tie differently")
        return f"{self.name}: step {step}: the recording ends at {len(self.reference)} tokens, the step needs {T + depth}"

    def _vocab(self) -> int:
        return int(self.verifier_model.config.vocab_size) if self.verifier_model is not None else 2 ** 31 - 1

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "accept": self.accept, "wrong": self.wrong, "rerecord": self.rerecord}
