"""SD²: a pretrained drafter steered by the verifier's hidden states (docs/algorithms.md#steered-drafters).

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
import json
import weakref
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from metasd.drafter import StepContext, register_drafter
from metasd.quantize import quantize_model
from metasd.tree import Draft

from .pretrained import PretrainedDrafter, PretrainedParams
from .pretrained_tree import PretrainedTreeDrafter, PretrainedTreeParams

FORMAT = "metasd-steering/1"


class SteeringSpec(BaseModel):
    """Shape of a steering module (stored in the checkpoint's config.json under ``steering``)."""

    model_config = ConfigDict(extra="forbid")

    d_verifier: int = Field(gt=0, description="verifier hidden size")
    guide_layers: list[int] = Field(min_length=1, description="verifier hidden_states indices (low, mid, high)")
    n_drafter_layers: int = Field(gt=0)
    steered_layers: list[int] = Field(min_length=1, description="0-based drafter decoder layers that get a bias")
    d_out: int = Field(gt=0, description="d_ff for injection 'up', d_model for 'mlp_out'")
    injection: Literal["up", "mlp_out"] = "up"
    rank: int | None = Field(default=None, gt=0, description="None: full-rank projection")
    guide_norm: Literal["none", "standardize"] = Field(
        default="none", description="standardize: per-dimension (h - mean) / std of the concatenated verifier states "
                                    "before W_hml (fixed statistics of the training data, stored with the module); "
                                    "keeps the verifier's few massive-activation dimensions from dominating the guide")

    @model_validator(mode="after")
    def _check(self) -> "SteeringSpec":
        bad = [i for i in self.steered_layers if not 0 <= i < self.n_drafter_layers]
        if bad:
            raise ValueError(f"steered_layers {bad} out of range 0..{self.n_drafter_layers - 1}")
        if len(set(self.steered_layers)) != len(self.steered_layers):
            raise ValueError(f"steered_layers repeat a layer: {self.steered_layers}")
        if any(layer < 0 for layer in self.guide_layers):
            raise ValueError(f"guide_layers must be >= 0, got {self.guide_layers}")
        return self


def default_guide_layers(n_verifier_layers: int) -> list[int]:
    """SD²/EAGLE-3 choice: outputs of layers 2, N/2 and N-3 (0-based) = hidden_states 3, N//2+1, N-2."""
    n = n_verifier_layers
    return [min(3, n), min(n // 2 + 1, n), max(n - 2, 0)]


def resolve_steered_layers(layers: str | int | Sequence[int], n_layers: int) -> list[int]:
    """"all" -> every layer; an int N -> the last N layers; a list -> those (0-based) layers."""
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"steered layers must be 'all', a count of last layers, or a list; got {layers!r}")
        return list(range(n_layers))
    if isinstance(layers, int):
        if not 1 <= layers <= n_layers:
            raise ValueError(f"cannot steer the last {layers} layers of a {n_layers}-layer drafter")
        return list(range(n_layers - layers, n_layers))
    out = [int(i) + n_layers if int(i) < 0 else int(i) for i in layers]
    if not out or any(not 0 <= i < n_layers for i in out):
        raise ValueError(f"steered layers {list(layers)} out of range for a {n_layers}-layer drafter")
    return out


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.base_model.layers``)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at .base_model.layers; steering needs a "
                         "Llama/Qwen-style model")
    return layers


def _mlp_dims(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.intermediate_size)


class SteeringModule(nn.Module):
    """Guide -> per-layer biases. Input [..., len(guide_layers) * d_v]; output [..., n_steered, d_out]."""

    def __init__(self, spec: SteeringSpec):
        super().__init__()
        self.spec = spec
        d, n_in = spec.d_verifier, len(spec.guide_layers)
        if spec.guide_norm == "standardize":  # identity until set_input_stats
            self.register_buffer("in_mean", torch.zeros(n_in * d))
            self.register_buffer("in_std", torch.ones(n_in * d))
        self.guide = nn.Linear(n_in * d, d)
        self.norm = nn.LayerNorm(d)
        n_out = len(spec.steered_layers) * spec.d_out
        if spec.rank is None:
            self.down = None
            self.proj = nn.Linear(d, n_out, bias=False)
        else:
            self.down = nn.Linear(d, spec.rank, bias=False)
            self.proj = nn.Linear(spec.rank, n_out, bias=False)
        self.dropout = 0.0  # training only: dropout on the normalised guide (not part of the saved module)
        self.reset_identity()

    @torch.no_grad()
    def set_input_stats(self, mean: torch.Tensor, std: torch.Tensor, min_std: float = 1e-3) -> None:
        """Fix the standardisation of the guide input (``guide_norm: standardize``): mean, std [n_in * d_v]."""
        if self.spec.guide_norm != "standardize":
            raise ValueError(f"guide_norm is {self.spec.guide_norm!r}; input statistics need 'standardize'")
        if mean.shape != self.in_mean.shape or std.shape != self.in_std.shape:
            raise ValueError(f"input statistics must have shape {tuple(self.in_mean.shape)}, got "
                             f"{tuple(mean.shape)} and {tuple(std.shape)}")
        self.in_mean.copy_(mean)
        self.in_std.copy_(std.clamp_min(min_std))

    @torch.no_grad()
    def reset_identity(self) -> None:
        """W_hml = [I I I], b = 0, last projection 0: the module adds nothing."""
        d = self.spec.d_verifier
        self.guide.weight.copy_(torch.eye(d).repeat(1, len(self.spec.guide_layers)))
        self.guide.bias.zero_()
        self.proj.weight.zero_()

    @classmethod
    def for_models(cls, drafter: nn.Module, d_verifier: int, n_verifier_layers: int | None = None,
                   guide_layers: Sequence[int] | None = None, layers: str | int | Sequence[int] = "all",
                   rank: int | None = None, injection: str = "up", guide_norm: str = "none",
                   seed: int | None = 0) -> "SteeringModule":
        """A fresh (no-op) module for a drafter model and a verifier of hidden size ``d_verifier``."""
        if guide_layers is None:
            if n_verifier_layers is None:
                raise ValueError("give guide_layers or the verifier's number of layers")
            guide_layers = default_guide_layers(n_verifier_layers)
        n_layers, d_model, d_ff = _mlp_dims(drafter)
        spec = SteeringSpec(d_verifier=d_verifier, guide_layers=list(guide_layers), n_drafter_layers=n_layers,
                            steered_layers=resolve_steered_layers(layers, n_layers),
                            d_out=d_ff if injection == "up" else d_model, injection=injection, rank=rank,
                            guide_norm=guide_norm)
        if seed is not None:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                return cls(spec)
        return cls(spec)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.to(self.guide.weight.dtype)
        if self.spec.guide_norm == "standardize":
            x = (x - self.in_mean) / self.in_std
        g = self.norm(self.guide(x))
        if self.training and self.dropout > 0:
            g = nn.functional.dropout(g, self.dropout)
        if self.down is not None:
            g = self.down(g)
        out = self.proj(g)
        return out.view(*h.shape[:-1], len(self.spec.steered_layers), self.spec.d_out)

    def guide_input(self, hidden: dict[int, torch.Tensor] | Any, row: int | None = None) -> torch.Tensor:
        """Concatenate the guide layers' states: from a HiddenStore (its last row) or a layer -> tensor dict."""
        if isinstance(hidden, dict):
            return torch.cat([hidden[layer] for layer in self.spec.guide_layers], dim=-1)
        if row is None:
            return torch.cat([hidden.last(layer) for layer in self.spec.guide_layers], dim=-1)
        return torch.cat([hidden.get(layer)[row] for layer in self.spec.guide_layers], dim=-1)

    def check_drafter(self, model: nn.Module) -> None:
        n_layers, d_model, d_ff = _mlp_dims(model)
        want = d_ff if self.spec.injection == "up" else d_model
        if n_layers != self.spec.n_drafter_layers or want != self.spec.d_out:
            raise ValueError(f"steering module was built for a drafter with {self.spec.n_drafter_layers} layers and "
                             f"d_out {self.spec.d_out} ({self.spec.injection}); this drafter has {n_layers} layers, "
                             f"d_out {want}")


class Injector:
    """Forward hooks adding ``delta[..., i, :]`` to the output of each steered layer's up_proj (or MLP).

    ``set(delta, mask)``: delta [n_steered, d_out] (one guide for every fed position) or
    [B, S, n_steered, d_out] (per position, training); mask [S, 1] or None scales the per-position
    contribution (0 = unsteered). ``clear()`` makes the hooks no-ops again.
    """

    def __init__(self, model: nn.Module, spec: SteeringSpec):
        layers = decoder_layers(model)
        self.delta: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.handles = []
        for i, layer_idx in enumerate(spec.steered_layers):
            mlp = layers[layer_idx].mlp
            target = mlp if spec.injection == "mlp_out" else getattr(mlp, "up_proj", None)
            if target is None:
                raise ValueError(f"drafter layer {layer_idx}: its MLP has no up_proj (SwiGLU expected)")
            self.handles.append(target.register_forward_hook(partial(_inject, weakref.ref(self), i)))
        self._finalizer = None

    def set(self, delta: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self.delta, self.mask = delta, mask

    def clear(self) -> None:
        self.delta = self.mask = None

    @contextmanager
    def active(self, delta: torch.Tensor, mask: torch.Tensor | None = None):
        """``set(delta, mask)`` for the forwards inside the block, ``clear()`` on leaving it (also on errors)."""
        self.set(delta, mask)
        try:
            yield self
        finally:
            self.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _inject(ref, i: int, module, args, output):
    inj = ref()
    if inj is None or inj.delta is None:
        return None
    d = inj.delta[..., i, :].to(output.dtype)
    if inj.mask is not None:
        d = inj.mask.to(output.dtype) * d
    return output + d


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


def save_steering(path: str | Path, module: SteeringModule | None, drafter_params: dict[str, torch.Tensor] | None = None,
                  extra: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``steering.safetensors`` (+ ``config.json`` beside it). ``path``: the .safetensors file or a folder."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / "steering.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    if module is not None:
        buffers = {name for name, _ in module.named_buffers()}  # statistics stay fp32
        tensors.update({f"steering.{k}": v.detach().to(torch.float32 if k in buffers else dtype).contiguous()
                        for k, v in module.state_dict().items()})
    for k, v in (drafter_params or {}).items():
        tensors[f"drafter.{k}"] = v.detach().to(dtype).contiguous()
    if not tensors:
        raise ValueError("nothing to save: no steering module and no fine-tuned drafter parameters")
    save_file(tensors, str(path), metadata={"format": FORMAT})
    config = {"format": FORMAT, "steering": module.spec.model_dump() if module is not None else None,
              "finetuned_drafter_params": sorted(drafter_params or {}), **(extra or {})}
    (path.parent / "config.json").write_text(json.dumps(config, indent=1))
    return path


def load_steering(path: str | Path) -> tuple[SteeringModule | None, dict[str, torch.Tensor], dict]:
    """Read a checkpoint written by ``save_steering``: (module in fp32 or None, drafter params, config)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "steering.safetensors"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    cpath = path.parent / "config.json"
    if not cpath.is_file():
        raise ValueError(f"checkpoint {str(path)!r}: no config.json beside it")
    config = json.loads(cpath.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(cpath)!r}: format {config.get('format')!r}, expected {FORMAT!r}")
    tensors = load_file(str(path))
    module = None
    if config.get("steering") is not None:
        try:
            spec = SteeringSpec.model_validate(config["steering"])
        except ValidationError as e:
            raise ValueError(f"checkpoint {str(cpath)!r}: invalid steering spec: {e}") from None
        module = SteeringModule(spec)
        state = {k[len("steering."):]: v.float() for k, v in tensors.items() if k.startswith("steering.")}
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint {str(path)!r}: steering tensors do not match its spec "
                             f"(missing {missing}, unexpected {unexpected})")
    drafter = {k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")}
    return module, drafter, config


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
            weakref.finalize(self, _remove_handles, self.injector.handles)
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
