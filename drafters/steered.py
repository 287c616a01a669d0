"""SD²: a pretrained drafter steered by the verifier's hidden states (docs/algorithms.md#steered-drafters).
The network, its injection hooks and its checkpoint format live in ``metasd.drafters.steering_net``.

The steering module turns three verifier hidden states (low, middle, high layer) into one bias per
steered drafter layer:

    h       = [h_low; h_mid; h_high]                     (guide_norm "standardize": (h - mean) / std per
                                                         dimension, statistics of the training features)
    g       = W_hml h + b                                W_hml: 3 d_v -> d_v, init [I I I], b = 0
    delta   = P(LayerNorm(g))  -> [n_steered, d_out]     P: d_v -> n*d_out (full rank) or d_v -> r -> n*d_out
    "up":      MLP_l(x) = down( SiLU(gate x) * (up x + delta_l) )    d_out = the drafter's d_ff
    "mlp_out": MLP_l(x) = down( SiLU(gate x) * up x ) + delta_l      d_out = the drafter's d_model

P's last linear map is zero-initialised, so an untrained module adds exact zeros: the drafter's logits
and drafts are bit-identical to the plain drafter's. The bias is injected by forward hooks on the
unmodified transformers model (on ``mlp.up_proj`` or on ``mlp``); the hooks are no-ops unless this
drafter is running a forward, so a model shared with other arms of a pool is unaffected.

Which guide each drafter position uses (inference)
--------------------------------------------------
Index convention: committed tokens x_0..x_{T-1} (x_{T-1} = the pending bonus token), verifier rows
0..T-2 in ``ctx.hidden`` (row j is computed from x_j and predicts x_{j+1}); drafter position p holds x_p.

* One guide per step: G_s = guide(row T-2), the verifier state that produced the bonus x_{T-1}
  (``ctx.hidden.last``). ``trace`` records it as ``guide_row = T-2``.
* Every position fed to the drafter during the step uses G_s: the catch-up tokens (every committed
  token from the first position where the drafter's cache disagrees with the committed tokens, at
  least the bonus x_{T-1}) and the draft tokens d_1..d_{k-1} fed at positions T..T+k-2.
* Exception: the prompt prefill, positions 0..prompt_len-2, is unsteered (delta 0). The last prompt
  token (pending at the first step) is steered, like every later bonus token.
* Positions kept in the drafter's KV cache from an earlier step are not recomputed: they keep the
  guide of the step that fed them. After a step s that accepted n < k drafts, positions T..T+n-1
  (the accepted d_1..d_n) keep G_s; the rejected ones are overwritten. After a fully accepted step the
  last draft d_k was never fed, so the next step feeds it (with the new guide) before the bonus.
* Trees (``SteeredTreeDrafter``): every level of the step's tree is fed with G_s too, so all draft
  nodes of a step share one guide; nodes kept in the cache after acceptance keep it, as above.
* The positions whose outputs become draft tokens are T-1 (bonus, guide row = position-1) to T+k-2
  (guide row = position-k): staleness o = 1..k, which training simulates with o ~ U{1..k}.
  Re-fed catch-up positions can see a guide from their own row (a fully accepted step: d_k at T+k-1
  with row T+k-1) or a later row (a drafter that sat idle while other arms drafted); their outputs
  are never used as predictions, only their keys/values, and every guide row is a committed token's.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Sequence

import torch

from metasd.drafter import StepContext, register_drafter
from metasd.quantize import quantize_model
from metasd.tree import Draft

from .pretrained import PretrainedDrafter, PretrainedParams
from .steering_net import (FORMAT, Injector, SteeringModule, SteeringSpec, decoder_layers,  # noqa: F401
                           default_guide_layers, load_steering, remove_handles, resolve_steered_layers, save_steering)
from .pretrained_tree import PretrainedTreeDrafter, PretrainedTreeParams

class _Steering:
    """The SD² part of a steered drafter: hooks on the drafter model, one guide per step, the timing rules
    of the module docstring. Mixed into a pretrained chain or tree drafter (``SteeredDrafter``,
    ``SteeredTreeDrafter``); every drafter forward of a step goes through ``_forward`` (catch-up and chain
    drafts) or ``_feed`` (tree levels)."""

    def _setup_steering(self, steering: SteeringModule | None, checkpoint: str | None) -> None:
        self.steering = steering.eval() if steering is not None else None
        self.checkpoint = checkpoint
        self.trace: list[tuple[int, int, int | None]] | None = None
        self.injector: Injector | None = None
        self.hidden_layers = ()
        if self.steering is not None:
            self.steering.check_drafter(self.model)
            self.hidden_layers = tuple(sorted(set(self.steering.spec.guide_layers)))
            self.injector = Injector(self.model, self.steering.spec)
            weakref.finalize(self, remove_handles, self.injector.handles)
        self._delta: torch.Tensor | None = None
        self._guide_row: int | None = None
        self._steer_from = 0

    @classmethod
    def from_config(cls, name, params, build):
        """Load the drafter model and the steering checkpoint, checked against the drafter and the verifier."""
        if not build.model:
            raise ValueError(f"drafter {name!r} of type {cls.kind!r} needs a model reference (field 'model')")
        if not build.checkpoint:
            raise ValueError(f"drafter {name!r} of type {cls.kind!r} needs a steering checkpoint (field 'checkpoint')")
        module, drafter_params, _ = load_steering(build.checkpoint)
        if drafter_params:  # a fine-tuned drafter: never modify weights other arms may share
            # fine-tuned weights go into a copy of the unquantized model, quantized afterwards if asked
            model, tokenizer = build.load_model(build.model, quantize="none")
            model = copy.deepcopy(model)
            own = dict(model.named_parameters())
            unknown = sorted(set(drafter_params) - set(own))
            if unknown:
                raise ValueError(f"checkpoint {build.checkpoint!r}: drafter parameters {unknown[:3]} not in {build.model!r}")
            with torch.no_grad():
                for k, v in drafter_params.items():
                    own[k].copy_(v.to(own[k].dtype))
            quantize_model(model, build.quantize, name=f"drafter {name!r}")
        else:
            model, tokenizer = build.load_model(build.model)
        if module is not None:
            v = build.verifier
            if v is not None:
                if module.spec.d_verifier != v.hidden_size:
                    raise ValueError(f"checkpoint {build.checkpoint!r} was trained for a verifier of hidden size "
                                     f"{module.spec.d_verifier}; {v.name} has {v.hidden_size}")
                bad = [layer for layer in module.spec.guide_layers if layer > v.num_layers]
                if bad:
                    raise ValueError(f"checkpoint {build.checkpoint!r} reads verifier layers {bad}; {v.name} has "
                                     f"hidden states 0..{v.num_layers}")
            module.check_drafter(model)
        return cls(model, tokenizer, module, name=name, model_ref=build.model, checkpoint=build.checkpoint, **params)

    def end(self) -> None:
        super().end()
        self._delta = None

    def close(self) -> None:
        """Remove the hooks from the (possibly shared) model."""
        if self.injector is not None:
            self.injector.remove()

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        self._delta, self._guide_row = None, None
        self._steer_from = ctx.prompt_len - 1
        if self.steering is not None and ctx.hidden is not None and len(ctx.hidden):
            self._delta = self.steering(self.steering.guide_input(ctx.hidden))  # [n_steered, d_out]
            self._guide_row = len(ctx.hidden) - 1
        try:
            return super().propose(ctx)
        finally:
            self._delta = None

    def _forward(self, ids: list[int]) -> torch.Tensor:
        start = len(self.cached_ids)
        n_plain = 0 if self._delta is None else min(max(self._steer_from - start, 0), len(ids))
        if self._delta is None:
            n_plain = len(ids)
        if self.trace is not None:
            self.trace.extend((start + i, t, None if i < n_plain else self._guide_row) for i, t in enumerate(ids))
        if n_plain == len(ids):
            return super()._forward(ids)
        mask = None
        if n_plain:
            mask = (torch.arange(len(ids), device=self.model.device) >= n_plain)[:, None]
        with self.injector.active(self._delta, mask):
            return super()._forward(ids)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.steering is not None:
            s = self.steering.spec
            out.update(guide_layers=s.guide_layers, steered_layers=s.steered_layers, rank=s.rank, injection=s.injection)
        out["checkpoint"] = self.checkpoint
        return out


class SteeredParams(PretrainedParams):
    """Pool-config ``params`` of the steered chain drafter: those of ``pretrained`` (the steering module and
    its checkpoint come from the entry's ``checkpoint`` field, not from ``params``)."""


class SteeredTreeParams(PretrainedTreeParams):
    """Pool-config ``params`` of the steered tree drafter: those of ``pretrained_tree``."""


@register_drafter
class SteeredDrafter(_Steering, PretrainedDrafter):
    """A pretrained drafter whose MLPs are biased by the verifier's hidden states (SD², docs/algorithms.md#steered-drafters); drafts
    a chain.

    steering: a ``SteeringModule`` (None: a plain drafter that still declares no hidden layers).
    trace: set to a list to record ``(position, token, guide_row)`` for every fed position
        (guide_row None = unsteered), e.g. to check the guide timing described in the module docstring.
    Other arguments as ``PretrainedDrafter``.
    """

    kind = "steered"
    model_field, checkpoint_field = "required", "required"
    Params = SteeredParams

    def __init__(self, model, tokenizer=None, steering: SteeringModule | None = None, k: int = 5,
                 confidence_threshold: float | None = None, adaptive_k: bool = False, k_min: int = 1,
                 k_max: int = 16, head_vocab: int | None = None, name: str | None = None, model_ref: str | None = None,
                 checkpoint: str | None = None):
        super().__init__(model, tokenizer, k=k, confidence_threshold=confidence_threshold, adaptive_k=adaptive_k,
                         k_min=k_min, k_max=k_max, head_vocab=head_vocab, name=name, model_ref=model_ref)
        self._setup_steering(steering, checkpoint)


@register_drafter
class SteeredTreeDrafter(_Steering, PretrainedTreeDrafter):
    """The steered drafter drafting trees (``PretrainedTreeDrafter`` modes: dynamic, RSD-C, RSD-S).

    One guide per step, as for the chain: it steers the catch-up tokens and every tree level's batched
    forward (all nodes of the step's tree). Arguments as ``PretrainedTreeDrafter`` plus ``steering``.
    """

    kind = "steered_tree"
    model_field, checkpoint_field = "required", "required"
    Params = SteeredTreeParams

    def __init__(self, model, tokenizer=None, steering: SteeringModule | None = None, mode: str = "dynamic",
                 nodes: int = 16, depth: int = 6, width: int = 4, frontier: int | None = None,
                 min_path_prob: float = 0.0, branching: Sequence[int] | None = None, head_vocab: int | None = None,
                 name: str | None = None, model_ref: str | None = None, checkpoint: str | None = None):
        super().__init__(model, tokenizer, mode=mode, nodes=nodes, depth=depth, width=width, frontier=frontier,
                         min_path_prob=min_path_prob, branching=branching, head_vocab=head_vocab, name=name,
                         model_ref=model_ref)
        self._setup_steering(steering, checkpoint)

    def _feed(self, tree, feed: list[int]) -> torch.Tensor:
        if self.trace is not None:
            start = tree.base + tree.n_fed
            self.trace.extend((start + i, tree.tokens[n], self._guide_row if self._delta is not None else None)
                              for i, n in enumerate(feed))
        if self._delta is None:
            return super()._feed(tree, feed)
        with self.injector.active(self._delta):
            return super()._feed(tree, feed)
