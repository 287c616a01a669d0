"""The SD² steering network and its file format: ``SteeringModule`` (three verifier hidden states -> one bias
per steered drafter layer), the ``Injector`` that adds that bias through forward hooks on an unmodified
transformers model, and ``save_steering`` / ``load_steering``. The math and the guide timing are in
``metasd.drafters.steered``, which drafts with them; ``metasd.training.steering`` trains them.
"""
from __future__ import annotations

import json
import weakref
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from metasd.models.packed_weights import load_weights


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


def remove_handles(handles) -> None:
    """Remove forward-hook handles (an Injector's, when its drafter is garbage-collected)."""
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
        tensors.update({f"steering.{k}": v.detach().to(torch.float32 if k in buffers else dtype).contiguous().cpu()
                        for k, v in module.state_dict().items()})
    for k, v in (drafter_params or {}).items():
        tensors[f"drafter.{k}"] = v.detach().to(dtype).contiguous().cpu()
    if not tensors:
        raise ValueError("nothing to save: no steering module and no fine-tuned drafter parameters")
    save_file(tensors, str(path), metadata={"format": FORMAT})
    config = {"format": FORMAT, "steering": module.spec.model_dump() if module is not None else None,
              "finetuned_drafter_params": sorted(drafter_params or {}), **(extra or {})}
    (path.parent / "config.json").write_text(json.dumps(config, indent=1))
    return path


def load_steering(path: str | Path) -> tuple[SteeringModule | None, dict[str, torch.Tensor], dict]:
    """Read a checkpoint written by ``save_steering``: (module in fp32 or None, drafter params, config)."""
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
    tensors = load_weights(path)  # plain or packed (metasd pack-weights)
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
