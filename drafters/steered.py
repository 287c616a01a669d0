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
from contextlib import contextmanager
from typing import Any, Literal

import torch
from pydantic import Field

from metasd.core.decoding.drafter import StepContext, register_drafter
from metasd.core.execution.draft_batch import Steer
from metasd.models.quantize import quantize_model

from .pretrained import PretrainedDrafter, PretrainedParams
from .steering_net import (FORMAT, Injector, SteeringModule, SteeringSpec, decoder_layers,  # noqa: F401
                           default_guide_layers, load_steering, remove_handles, resolve_steered_layers, save_steering)
from .pretrained_tree import PretrainedTreeDrafter, PretrainedTreeParams

class Steering:
    """The SD² part of a steered drafter, composed into a pretrained chain or tree drafter as its ``steering``:
    hooks on the drafter model, one guide per step and the timing rules of the module docstring. The drafter
    brackets a step's forwards with ``step(ctx)`` and gives each forward the biases ``steer`` (catch-up and chain
    tokens) or ``steer_tree`` (one tree level) returns, which the forward - alone or batched with other requests'
    (core/execution/draft_batch.py) - adds through the hooks.

    module: the ``SteeringModule`` (None: a plain drafter that still reads no verifier layers).
    trace: set to a list to record ``(position, token, guide_row)`` for every fed position (guide_row None =
        unsteered), e.g. to check the guide timing described in the module docstring.
    """

    def __init__(self, module: SteeringModule | None, model, checkpoint: str | None = None):
        # the module runs beside the drafter model it steers (its biases are added to that model's activations)
        self.module = module.to(model.device).eval() if module is not None else None
        self.checkpoint = checkpoint
        self.trace: list[tuple[int, int, int | None]] | None = None
        self.injector: Injector | None = None
        self.hidden_layers: tuple[int, ...] = ()
        if self.module is not None:
            self.module.check_drafter(model)
            self.hidden_layers = tuple(sorted(set(self.module.spec.guide_layers)))
            self.injector = Injector(model, self.module.spec)
            weakref.finalize(self, remove_handles, self.injector.handles)
        self.delta: torch.Tensor | None = None  # [n_steered, d_out] of the current step
        self.guide_row: int | None = None
        self.steer_from = 0  # first steered position: the last prompt token

    @contextmanager
    def step(self, ctx: StepContext):
        """One drafting step: the guide of verifier row T-2 (``ctx.hidden.last``) for every forward in it."""
        self.delta, self.guide_row = None, None
        self.steer_from = ctx.prompt_len - 1
        if self.module is not None and ctx.hidden is not None and len(ctx.hidden):
            guide = self.module.guide_input(ctx.hidden).to(self.module.guide.weight.device)  # from the verifier's device
            self.delta = self.module(guide)  # [n_steered, d_out]
            self.guide_row = len(ctx.hidden) - 1
        try:
            yield
        finally:
            self.delta = None

    def steer(self, start: int, ids: list[int] | torch.Tensor) -> Steer | None:
        """The biases of a forward feeding ``ids`` (host ints, or a device tensor [n] of unread draft tokens) at
        positions ``start..``: steered from ``steer_from`` on (None: no position is)."""
        n_plain = len(ids) if self.delta is None else min(max(self.steer_from - start, 0), len(ids))
        if self.trace is not None:
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids  # a host read, for the trace only
            self.trace.extend((start + i, t, None if i < n_plain else self.guide_row) for i, t in enumerate(ids))
        if n_plain == len(ids):
            return None
        mask = (torch.arange(len(ids), device=self.delta.device) >= n_plain)[:, None] if n_plain else None
        return Steer(self.injector, self.delta, mask)

    def steer_tree(self, start: int, tokens: list[int]) -> Steer | None:
        """The biases of one tree level's forward (nodes at cache positions ``start..``): all with the step's guide."""
        if self.trace is not None:
            self.trace.extend((start + i, t, self.guide_row if self.delta is not None else None) for i, t in enumerate(tokens))
        return None if self.delta is None else Steer(self.injector, self.delta)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checkpoint": self.checkpoint}
        if self.module is not None:
            s = self.module.spec
            out.update(guide_layers=s.guide_layers, steered_layers=s.steered_layers, rank=s.rank, injection=s.injection)
        return out

    def close(self) -> None:
        """Remove the hooks from the (possibly shared) model."""
        if self.injector is not None:
            self.injector.remove()


def load_steered(cls, name: str, params: dict[str, Any], build):
    """``from_config`` of both steered types: the drafter model and the steering checkpoint, checked against the
    drafter and the verifier; fine-tuned drafter weights go into a private copy of the model."""
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


class SteeredType:
    """What both steered drafter types add to their pretrained drafter: a ``Steering`` component built from the
    ``steering`` argument (a ``SteeringModule``) and the ``checkpoint``, and ``from_config``. Other arguments
    are the pretrained drafter's."""

    model_field, checkpoint_field = "required", "required"
    cross_tokenizer = False  # steering reads the verifier's states position by position: the same tokens only
    draft_loops = draft_rows = False  # its hooks add the step's biases per forward: drafted eagerly
    from_config = classmethod(load_steered)

    def __init__(self, model, tokenizer=None, steering: SteeringModule | None = None, checkpoint: str | None = None,
                 **params):
        if params.get("track"):  # a tracked forward runs outside a drafting step: it would feed unsteered positions
            raise ValueError(f"{params.get('name') or self.kind}: track is not available for steered drafters")
        super().__init__(model, tokenizer, **params)
        self.steering = Steering(steering, self.model, checkpoint)
        self.hidden_layers = self.steering.hidden_layers


class SteeredParams(PretrainedParams):
    """Pool-config ``params`` of the steered chain drafter: those of ``pretrained`` (the steering module and
    its checkpoint come from the entry's ``checkpoint`` field, not from ``params``), without ``track``."""

    track: Literal[False] = Field(False, description="not available: a tracked forward would run unsteered")


class SteeredTreeParams(PretrainedTreeParams):
    """Pool-config ``params`` of the steered tree drafter: those of ``pretrained_tree``, without ``track``."""

    track: Literal[False] = Field(False, description="not available: a tracked forward would run unsteered")


@register_drafter
class SteeredDrafter(SteeredType, PretrainedDrafter):
    """A pretrained drafter whose MLPs are biased by the verifier's hidden states (SD²,
    docs/algorithms.md#steered-drafters); drafts a chain."""

    kind = "steered"
    Params = SteeredParams


@register_drafter
class SteeredTreeDrafter(SteeredType, PretrainedTreeDrafter):
    """The steered drafter drafting trees (``PretrainedTreeDrafter`` modes: dynamic, RSD-C, RSD-S). One guide
    per step, as for the chain: it steers the catch-up tokens and every tree level's batched forward."""

    kind = "steered_tree"
    Params = SteeredTreeParams
