"""The network of the hidden-state drafter (docs/algorithms.md#hidden-state-drafter; "Make Every Draft Count", arXiv 2602.21224).

Two trainable parts, both at the verifier's width d, on top of frozen verifier pieces (input embeddings e,
LM head restricted to a reduced draft vocabulary):

* the state recurrence, token-free: one pre-norm decoder layer (own small module: GQA attention with RoPE at
  absolute positions, SwiGLU MLP) with a KV cache over the sequence of input states. Input at position t:
  ``in_proj(RMSNorm(h_t))`` where h_t is the verifier's state ``hidden_states[state_layer]`` (default: the
  last layer *after* the final norm, the state the verifier's head reads) for committed rows, or the
  drafter's own prediction beyond them. Output at position t: ``s_{t+1} = RMSNorm_out(layer(.))``, the
  predicted verifier state of position t+1 *before* it knows token x_{t+1};
* token injection: ``u, g = UG([RMSNorm(e(x_{t+1})); RMSNorm(s_{t+1})])``, ``s~ = s_{t+1} + D(SiLU(g) * u)``
  with D zero-initialised; ``q(x_{t+2}) = softmax(head(s~))`` over the draft vocabulary. No final norm
  before the head: s and s~ live in the space of the post-norm verifier states.

Unrolled training (``unrolled_states``) reproduces drafting exactly: for K extra steps every position t is
also the k-th predicted input of the chain whose last real row is t-k (attention to real keys <= t-k and
to that chain's predicted keys), so the training graph equals what the drafter computes at depth k+1.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from metasd.models.draft_vocab import DraftVocab
from metasd.models.packed_weights import pack_int4

from .treeflash_backbone import SwiGLU, apply_rope, init_linears, rope_cos_sin
from .verifier_state import load_network_weights, read_checkpoint_config

CHECKPOINT_FORMAT = "metasd-hidden-state"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "draft_vocab.safetensors"

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [n_kv, L, head_dim] (keys rotated)


@dataclass
class HiddenStateConfig:
    """Architecture of a hidden-state drafter (saved as ``config.json["model"]`` in a checkpoint)."""

    verifier_hidden_size: int
    verifier_vocab_size: int
    state_layer: int  # verifier hidden_states index read (num_hidden_layers = after the final norm)
    num_heads: int = 12
    num_kv_heads: int = 2
    head_dim: int | None = None  # default verifier_hidden_size // num_heads
    intermediate_size: int = 4096
    inject_intermediate_size: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.verifier_hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def to_dict(self) -> dict:
        return asdict(self)


class StateAttention(nn.Module):
    """Causal GQA attention over [past keys; new keys] with an explicit boolean mask (True: visible)."""

    def __init__(self, cfg: HiddenStateConfig):
        super().__init__()
        d, hd = cfg.verifier_hidden_size, cfg.head_dim
        self.cfg, self.n_heads, self.n_kv = cfg, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: KV | None, mask: torch.Tensor) -> tuple[torch.Tensor, KV]:
        """x [n, d] at ``positions`` [n]; past keys/values [n_kv, L, hd] or None; mask [n, L+n].
        Returns the output [n, d] and this call's (k, v) [n_kv, n, hd]."""
        hd = self.cfg.head_dim
        cos, sin = rope_cos_sin(positions, hd, self.cfg.rope_theta, x.dtype)  # [n, hd]
        q = apply_rope(self.q_proj(x).unflatten(-1, (self.n_heads, hd)).transpose(0, 1), cos, sin)  # [H, n, hd]
        k = apply_rope(self.k_proj(x).unflatten(-1, (self.n_kv, hd)).transpose(0, 1), cos, sin)  # [n_kv, n, hd]
        v = self.v_proj(x).unflatten(-1, (self.n_kv, hd)).transpose(0, 1)
        keys, vals = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        rep = self.n_heads // self.n_kv
        if rep > 1:
            keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=mask[None, None])[0]
        return self.o_proj(out.transpose(0, 1).flatten(-2)), (k, v)


class StateLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + SwiGLU(norm(.))."""

    def __init__(self, cfg: HiddenStateConfig):
        super().__init__()
        d = cfg.verifier_hidden_size
        self.input_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.attn = StateAttention(cfg)
        self.post_attn_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def forward(self, x, positions, past, mask):
        a, kv = self.attn(self.input_norm(x), positions, past, mask)
        x = x + a
        return x + self.mlp(self.post_attn_norm(x)), kv


class TokenInjection(nn.Module):
    """s~ = s + D(SiLU(g) * u), [u, g] = UG([RMSNorm(e); RMSNorm(s)]); D zero-initialised (s~ = s untrained)."""

    def __init__(self, cfg: HiddenStateConfig):
        super().__init__()
        d, inner = cfg.verifier_hidden_size, cfg.inject_intermediate_size
        self.emb_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.state_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.ug = nn.Linear(2 * d, 2 * inner)
        self.down = nn.Linear(inner, d, bias=False)

    def forward(self, s: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """s [..., d] token-free states, emb [..., d] embeddings of the token at the same position -> [..., d]."""
        u, g = self.ug(torch.cat([self.emb_norm(emb.to(s.dtype)), self.state_norm(s)], -1)).chunk(2, -1)
        return s + self.down(F.silu(g) * u)


class HiddenStateNet(nn.Module):
    """Trainable parameters of the hidden-state drafter (frozen verifier pieces excluded)."""

    def __init__(self, cfg: HiddenStateConfig):
        super().__init__()
        d = cfg.verifier_hidden_size
        self.cfg = cfg
        self.in_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.in_proj = nn.Linear(d, d, bias=False)
        self.layer = StateLayer(cfg)
        self.out_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.inject = TokenInjection(cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        init_linears(self, std)
        nn.init.zeros_(self.inject.down.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.out_norm.weight.dtype  # a parameter quantization leaves alone

    def step(self, h: torch.Tensor, positions: torch.Tensor, past: KV | None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """One recurrence forward. h [n, d] input states at ``positions`` [n] (contiguous after the L past
        positions when ``mask`` is None: causal). Returns predicted states [n, d] (row i: position
        positions[i]+1) and this call's (k, v) [n_kv, n, hd] to append to the cache."""
        n = h.shape[0]
        if mask is None:
            L = 0 if past is None else past[0].shape[1]
            mask = torch.ones(n, L + n, dtype=torch.bool, device=h.device).tril(L)
        x = self.in_proj(self.in_norm(h.to(self.dtype)))
        y, kv = self.layer(x, positions, past, mask)
        return self.out_norm(y), kv

    def unrolled_states(self, h: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """Training view of drafting. h [n, d] real states of one sequence. Returns out[k] [n, d] for
        k = 0..unroll: out[k][t] = the state of position t+1 predicted at depth k+1 from real rows 0..t-k
        (rows t < k are meaningless). out[0] is teacher-forced; the input of step k at position p is
        out[k-1][p-1]."""
        n = h.shape[0]
        pos = torch.arange(n, device=h.device)
        outs: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        x_in = h
        for k in range(unroll + 1):
            # query (k, t) sees block 0 at positions <= t-k and block b (1..k) at position t-k+b
            blocks = [pos[None, :] <= (pos[:, None] - k)]
            blocks += [pos[None, :] == (pos[:, None] - k + b) for b in range(1, k + 1)]
            mask = torch.cat(blocks, 1)
            past = None if k == 0 else (torch.cat(keys, 1), torch.cat(vals, 1))
            s, (kk, vv) = self.step(x_in, pos, past, mask)
            outs.append(s)
            keys.append(kk)
            vals.append(vv)
            x_in = torch.cat([s[:1] * 0, s[:-1]], 0)  # input of position p = prediction made at p-1
        return outs

    def head_logits(self, s_tilde: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor | None) -> torch.Tensor:
        """[..., d] injected states -> [..., N] draft-vocabulary logits (no final norm, see module docstring)."""
        return F.linear(s_tilde.to(head_weight.dtype), head_weight, head_bias)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | Path, net: HiddenStateNet, vocab: DraftVocab, meta: dict | None = None,
                    dtype: torch.dtype | str = torch.float32, group_size: int = 32) -> Path:
    """Write model.safetensors, draft_vocab.safetensors and config.json (``meta`` merged in: e.g.
    ``defaults`` for drafting, ``verifier``, ``training``). ``dtype``: a float dtype for every tensor, or
    "int4": every large weight matrix stored as 4-bit groups of ``group_size`` (``metasd.models.packed_weights``:
    about a quarter of bf16's bytes; loading dequantizes them), the rest in bf16."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: v.detach().cpu() for name, v in net.state_dict().items()}  # written from the host, whatever the device
    if dtype == "int4":
        tensors = pack_int4({k: v.float() for k, v in state.items()}, group_size, rest_dtype=torch.bfloat16,
                            min_numel=0)  # every weight matrix, however small
    else:
        tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": CHECKPOINT_FORMAT})
    vocab.save(path / VOCAB_FILE)
    config = {"format": CHECKPOINT_FORMAT, "version": 1, **(meta or {}), "model": net.cfg.to_dict(),
              "weights": WEIGHTS_FILE, "weights_dtype": dtype if dtype == "int4" else str(dtype).removeprefix("torch."),
              **({"int4_group_size": group_size} if dtype == "int4" else {}), "draft_vocab": VOCAB_FILE,
              "draft_vocab_size": len(vocab)}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return path


def load_checkpoint(path: str | Path) -> tuple[HiddenStateNet, DraftVocab, dict]:
    """A checkpoint directory -> (fp32 network in eval mode, draft vocabulary, config.json contents)."""
    path = Path(path)
    meta = read_checkpoint_config(path, CONFIG_FILE, CHECKPOINT_FORMAT, "hidden-state drafter")
    net = HiddenStateNet(HiddenStateConfig(**meta["model"]))
    load_network_weights(net, path / meta.get("weights", WEIGHTS_FILE))
    vocab = DraftVocab.load(path / meta.get("draft_vocab", VOCAB_FILE))
    return net.eval().requires_grad_(False), vocab, meta
