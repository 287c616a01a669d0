"""The TreeFlash drafter network (docs/algorithms.md#treeflash), written for metasd.

Two trainable parts on top of frozen verifier pieces (input embeddings, final norm, LM head restricted to
a reduced draft vocabulary):

* a DFlash-style block backbone: input = verifier embeddings of [last committed token, MASK x (B-1)]
  projected to an internal width ``hidden_size``; context = verifier hidden states of several layers,
  concatenated, projected (fc + RMSNorm) and turned into extra keys/values in every layer; block queries
  attend to the last ``context_window`` context positions and bidirectionally inside the block. The
  output, projected back to the verifier width, goes through the verifier's final norm and LM head.
  Block position j (1..B-1) predicts the token j places after the last committed token (a marginal,
  conditioned on the prefix only).
* the TreeFlash AR approximation: ``u, g = UG([RMSNorm(e(x_{i-1})); N(h_i)])``,
  ``h~_i = h_i + D(SiLU(g) * u)`` with ``D`` zero-initialised, so position i's distribution can depend on
  the token drafted before it.

Positions: context row j (the verifier state computed from committed token j) has position j; the block
of an anchor (last committed token) at position a occupies positions a..a+B-1 (RoPE, relative).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from metasd.core.pricing.cost import counted_linear
from metasd.models.quantize import dense_weight

NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


@dataclass
class TreeFlashConfig:
    """Architecture of a TreeFlash drafter (saved as ``config.json["model"]`` in a checkpoint)."""

    verifier_hidden_size: int
    verifier_vocab_size: int
    context_layers: list[int]  # verifier hidden_states indices (0 = embeddings, i = output of layer i)
    hidden_size: int = 768  # internal width of the drafter layers
    num_layers: int = 2
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int | None = None  # default hidden_size // num_heads
    intermediate_size: int = 2048
    ar_intermediate_size: int = 768  # I of the AR-approximation MLP (UG: 2H -> 2I with H the verifier width)
    block_size: int = 8  # B: the last committed token + B-1 masks; drafts reach depth B-1
    context_window: int = 128  # C: block queries see the last C context positions (0: all)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # N in q = softmax(lm_head(N(h))): "verifier" = the verifier's final norm (frozen); "own" = a trainable
    # RMSNorm of the drafter initialised to ones (softer initial logits; trains much faster, see the training docs)
    output_norm: str = "verifier"
    # per-layer RMSNorm of the verifier states before fc (their scales differ and massive activations dominate)
    context_layer_norm: bool = False
    # add a projection of the last committed context row (the state that produced the pending token) to the
    # input of every block position, so each block starts from anchor-specific information
    last_state: bool = False
    # Medusa-style skip: h_j += S(s), s = the verifier state of this layer at the last committed row, S initialised
    # to the identity, so the untrained drafter already predicts through the verifier's own last state
    # (must be one of context_layers; None: off)
    output_skip_layer: int | None = None

    def __post_init__(self):
        self.context_layers = [int(x) for x in self.context_layers]
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.context_layers:
            raise ValueError("context_layers must name at least one verifier layer")
        if self.output_skip_layer is not None and self.output_skip_layer not in self.context_layers:
            raise ValueError(f"output_skip_layer {self.output_skip_layer} must be one of context_layers {self.context_layers}")
        if self.output_norm not in ("verifier", "own"):
            raise ValueError(f"output_norm must be 'verifier' or 'own', got {self.output_norm!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TreeFlashConfig":
        return cls(**d)


# ---------------------------------------------------------------- frozen verifier pieces
def final_norm_of(model: nn.Module) -> nn.Module:
    """The final norm of a transformers causal LM, found through ``base_model`` (family-agnostic)."""
    base = getattr(model, "base_model", None) or model
    for holder in (base, getattr(base, "language_model", None), model):
        if holder is None:
            continue
        for name in NORM_NAMES:
            mod = getattr(holder, name, None)
            if isinstance(mod, nn.Module):
                return mod
    raise ValueError(f"cannot find the final norm of {type(model).__name__}: looked for {list(NORM_NAMES)} on "
                     f"model.base_model ({type(base).__name__}); TreeFlash needs the verifier's final norm")


@dataclass
class VerifierPieces:
    """Frozen verifier parts a TreeFlash drafter reads: embeddings, final norm, reduced LM head."""

    embed_weight: torch.Tensor  # [V, d]
    norm: nn.Module
    head_weight: torch.Tensor  # [N, d] rows of the draft vocabulary
    head_bias: torch.Tensor | None = None  # [N]
    token_ids: torch.Tensor | None = None  # [N] full ids of the draft vocabulary (reduced index -> full id)

    @classmethod
    def from_model(cls, model: nn.Module, token_ids: torch.Tensor, copy_norm: bool = False,
                   dtype: torch.dtype | None = None) -> "VerifierPieces":
        """``token_ids``: full-vocabulary ids of the draft vocabulary (``DraftVocab.token_ids``)."""
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        if emb is None or head is None:
            raise ValueError(f"{type(model).__name__} exposes no input/output embeddings; TreeFlash needs both")
        norm = final_norm_of(model)
        if copy_norm:
            norm = copy.deepcopy(norm).requires_grad_(False)
            if dtype is not None:
                norm.to(dtype)
        head_weight = dense_weight(head)  # the verifier's head as it computes (dequantized if quantized)
        ids = token_ids.to(head_weight.device)
        w = head_weight.detach().index_select(0, ids)
        b = getattr(head, "bias", None)
        b = None if b is None else b.detach().index_select(0, ids)
        ew = emb.weight.detach()
        if dtype is not None:
            w = w.to(dtype)
            b = None if b is None else b.to(dtype)
        return cls(ew, norm, w.contiguous(), b, token_ids.to(ew.device))

    @property
    def hidden_size(self) -> int:
        return int(self.embed_weight.shape[1])

    def to_full(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced if self.token_ids is None else self.token_ids[reduced]

    def embed(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        e = F.embedding(ids.to(self.embed_weight.device), self.embed_weight)
        return e if dtype is None else e.to(dtype)

    def logits(self, h: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """[..., d] drafter output (before the final norm) -> [..., N] logits over the draft vocabulary
        (``norm``: the final norm to use; default the verifier's)."""
        x = (self.norm if norm is None else norm)(h)
        w = self.head_weight
        return counted_linear(x.to(w.dtype), w, self.head_bias)


# ---------------------------------------------------------------- rotary embeddings
def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [...] -> cos, sin [..., head_dim] (half-split layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, hd] with cos/sin broadcastable to it."""
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------- layers
class ContextAttention(nn.Module):
    """Block queries over [context K/V; block K/V]. Per-head RMSNorm on q and k (stabilises training)."""

    def __init__(self, cfg: TreeFlashConfig):
        super().__init__()
        self.cfg = cfg
        w, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(w, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(w, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(w, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, w, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., n, w] -> k, v [..., n_kv, n, hd] (k rotated)."""
        hd = self.cfg.head_dim
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv, hd))).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, (self.n_kv, hd)).transpose(-3, -2)
        return apply_rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor | None) -> torch.Tensor:
        """x [A, B, w] block states; ctx_k/ctx_v [A or 1, n_kv, n, hd]; ctx_mask [A, n] bool (True: visible) or None."""
        A, B, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, hd))).transpose(1, 2)  # [A, H, B, hd]
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        bk, bv = self.kv(x, cos, sin)  # [A, n_kv, B, hd]
        k = torch.cat([ctx_k.expand(A, -1, -1, -1), bk], dim=2)
        v = torch.cat([ctx_v.expand(A, -1, -1, -1), bv], dim=2)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = None
        if ctx_mask is not None:
            mask = torch.cat([ctx_mask, ctx_mask.new_ones(A, B)], dim=1)[:, None, None, :]  # [A, 1, 1, n+B]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [A, H, B, hd]
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class SwiGLU(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context K/V."""

    def __init__(self, cfg: TreeFlashConfig):
        super().__init__()
        self.input_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = ContextAttention(cfg)
        self.post_attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask):
        x = x + self.attn(self.input_norm(x), cos, sin, ctx_k, ctx_v, ctx_mask)
        return x + self.mlp(self.post_attn_norm(x))


class ARApproximation(nn.Module):
    """TreeFlash's previous-token correction: h~ = h + D(SiLU(g) * u), [u, g] = UG([RMSNorm(e); N(h)])."""

    def __init__(self, width: int, inner: int, eps: float):
        super().__init__()
        self.emb_norm = nn.RMSNorm(width, eps=eps)
        self.ug = nn.Linear(2 * width, 2 * inner)
        self.down = nn.Linear(inner, width, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, h: torch.Tensor, normed_h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        u, g = self.ug(torch.cat([self.emb_norm(prev_emb), normed_h], dim=-1)).chunk(2, dim=-1)
        return h + self.down(F.silu(g) * u)


class TreeFlashModel(nn.Module):
    """Trainable TreeFlash parameters: block backbone and AR approximation (frozen verifier parts excluded)."""

    def __init__(self, cfg: TreeFlashConfig):
        super().__init__()
        self.cfg = cfg
        dv, w = cfg.verifier_hidden_size, cfg.hidden_size
        self.mask_embedding = nn.Parameter(torch.zeros(dv))
        self.in_proj = nn.Linear(dv, w, bias=False)
        self.ctx_layer_norms = (nn.ModuleList([nn.RMSNorm(dv, eps=cfg.rms_norm_eps) for _ in cfg.context_layers])
                                if cfg.context_layer_norm else None)
        self.fc = nn.Linear(len(cfg.context_layers) * dv, w, bias=False)
        self.ctx_norm = nn.RMSNorm(w, eps=cfg.rms_norm_eps)
        self.last_proj = nn.Linear(w, w, bias=False) if cfg.last_state else None
        self.layers = nn.ModuleList([BlockLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(w, eps=cfg.rms_norm_eps)
        self.out_proj = nn.Linear(w, dv, bias=False)
        self.out_norm = nn.RMSNorm(dv, eps=cfg.rms_norm_eps) if cfg.output_norm == "own" else None
        self.skip = nn.Linear(dv, dv, bias=False) if cfg.output_skip_layer is not None else None
        self.ar = ARApproximation(dv, cfg.ar_intermediate_size, cfg.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        init_linears(self, std)
        nn.init.normal_(self.mask_embedding, std=std)
        nn.init.zeros_(self.ar.down.weight)  # an untrained AR correction changes nothing
        if self.skip is not None:
            nn.init.eye_(self.skip.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.mask_embedding.dtype  # a parameter that quantizing the linear layers leaves as it is

    def backbone_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("ar.")]

    def ar_parameters(self):
        return list(self.ar.parameters())

    # ---------------------------------------------------------- context
    def project_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., n, len(context_layers) * d] concatenated verifier states -> [..., n, w]."""
        hidden = hidden.to(self.dtype)
        if self.ctx_layer_norms is not None:
            parts = hidden.split(self.cfg.verifier_hidden_size, dim=-1)
            hidden = torch.cat([norm(x) for norm, x in zip(self.ctx_layer_norms, parts)], dim=-1)
        return self.ctx_norm(self.fc(hidden))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[n, w] projected context at ``positions`` [n] -> per layer (k, v) [1, n_kv, n, hd]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)
        return [tuple(t.unsqueeze(0) for t in layer.attn.kv(ctx, cos, sin)) for layer in self.layers]

    # ---------------------------------------------------------- block
    def block_inputs(self, first_emb: torch.Tensor, block_size: int) -> torch.Tensor:
        """[A, d] embeddings of the last committed tokens -> [A, B, d] block inputs (then MASK embeddings)."""
        A = first_emb.shape[0]
        masks = self.mask_embedding.to(first_emb.dtype).expand(A, block_size - 1, -1)
        return torch.cat([first_emb[:, None, :], masks], dim=1)

    def forward(self, block_emb: torch.Tensor, positions: torch.Tensor, ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                ctx_mask: torch.Tensor | None = None, last_ctx: torch.Tensor | None = None,
                skip_state: torch.Tensor | None = None) -> torch.Tensor:
        """Block forward. block_emb [A, B, d]; positions [A, B]; ctx_kv per layer ([A|1, n_kv, n, hd] x2);
        ctx_mask [A, n] or None (all visible); last_ctx [A, w] projected context row before each block (zeros
        when there is none; used when ``cfg.last_state``); skip_state [A, d] verifier state of layer
        ``cfg.output_skip_layer`` at that row (zeros when none). Returns h [A, B, d] in the verifier width (before N)."""
        x = self.in_proj(block_emb.to(self.dtype))
        if self.last_proj is not None and last_ctx is not None:
            x = x + self.last_proj(last_ctx.to(x.dtype))[:, None, :]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, ctx_mask)
        h = self.out_proj(self.norm(x))
        if self.skip is not None and skip_state is not None:
            h = h + self.skip(skip_state.to(h.dtype))[:, None, :]
        return h

    def output_norm(self, pieces: VerifierPieces) -> nn.Module:
        """N: the drafter's own final norm, or the verifier's."""
        return self.out_norm if self.out_norm is not None else pieces.norm

    def logits(self, pieces: VerifierPieces, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., N] draft-vocabulary logits lm_head(N(h))."""
        return pieces.logits(h, self.output_norm(pieces))

    def ar_hidden(self, h: torch.Tensor, prev_emb: torch.Tensor, pieces: VerifierPieces) -> torch.Tensor:
        """h [..., d] marginal state, prev_emb [..., d] embedding of the previous token -> corrected h~ [..., d]."""
        return self.ar(h, self.output_norm(pieces)(h).to(h.dtype), prev_emb.to(h.dtype))


@torch.no_grad()
def init_linears(module: nn.Module, std: float = 0.02) -> None:
    """Every ``nn.Linear`` inside ``module``: weight ~ N(0, std^2), bias 0 (the drafter networks' init)."""
    for mod in module.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
