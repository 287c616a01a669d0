"""TreeFlash: a one-shot block drafter (DFlash backbone) that drafts trees (docs/algorithms.md#treeflash).

Per step:
1. bring the context up to date: project the verifier hidden states of rows not seen yet (the committed
   tokens since the last step, catch-up included) into per-layer context keys/values (cached);
2. one backbone forward over [last committed token, MASK x (B-1)] gives the marginal distribution of
   each depth 1..B-1 over the reduced draft vocabulary;
3. depending on ``mode``:
   * ``chain``: the marginal argmax of every depth (DFlash);
   * ``marginal``: a best-first tree where every node's children are the marginal top-k of the next depth;
   * ``treeflash``: keep the marginal top-m tokens of each depth as candidate previous tokens, run the AR
     approximation once over every (depth, candidate previous token) pair (the root token for depth 1)
     to get conditional top-k transitions, and grow a best-first tree over the path score
     sum log q(x_i | x_{i-1}); a node may have children only if its token is among the marginal top-m of
     its depth.
Best-first search (``build_tree``): a heap of frontier entries; popping one makes a node and pushes its
next sibling and its first child; it stops at ``tree_size`` nodes.

Drafts carry no probabilities (``Draft.probs is None``): greedy verification or sample-and-match, both
exact for any tree.

Architecture options beyond DFlash/TreeFlash (``TreeFlashConfig``; the bundled checkpoint uses all of
them, each found necessary to learn anything within a ~30 min CPU budget): a trainable output norm,
per-layer norms of the context states, the projected last committed row added to every block input, and
an identity-initialised skip from the verifier's final state at the last committed row to the output.
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field
from safetensors.torch import save_file

from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import DrafterParams, Int, StepContext, check_params, register_drafter
from metasd.models.quantize import quantize_model
from metasd.core.execution.draft_batch import BlockFeed, Drafting, HostRead, RowFeed, drive
from metasd.core.execution.staging import to_device
from metasd.core.execution.tree import Draft

from .treeflash_backbone import TreeFlashConfig, TreeFlashModel, VerifierPieces
from .verifier_state import VerifierStateDrafter, check_verifier_fit, load_network_weights, read_checkpoint_config

MODES = ("chain", "marginal", "treeflash")
CHECKPOINT_FORMAT = "metasd-treeflash"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "draft_vocab.safetensors"


# ---------------------------------------------------------------- tree construction
@dataclass
class TransitionTable:
    """Transitions into one depth. Row r is the r-th source (a candidate previous token)."""

    tokens: torch.Tensor  # [R, k] tokens, best first
    logp: torch.Tensor  # [R, k] log q(token | source)
    next_src: torch.Tensor  # [R, k] row of the next depth's table for a node with this token; -1: no children


def read_tables(tables: Sequence[TransitionTable]) -> tuple[list, list, list]:
    """Every table's tokens, log-probs and next rows as nested lists, read by the host in one transfer (one float32
    tensor: reduced token ids and row numbers are far below 2**24, so they stay exact)."""
    flat = torch.cat([torch.cat([t.tokens.float().flatten(), t.logp.float().flatten(), t.next_src.float().flatten()])
                      for t in tables]).tolist()
    toks, lps, nxt, at = [], [], [], 0
    for t in tables:
        rows, cols = t.tokens.shape
        n = rows * cols
        parts = [flat[at + i * n: at + (i + 1) * n] for i in range(3)]
        at += 3 * n
        toks.append([[int(x) for x in parts[0][r * cols:(r + 1) * cols]] for r in range(rows)])
        lps.append([parts[1][r * cols:(r + 1) * cols] for r in range(rows)])
        nxt.append([[int(x) for x in parts[2][r * cols:(r + 1) * cols]] for r in range(rows)])
    return toks, lps, nxt


def build_tree(tables: Sequence[TransitionTable], tree_size: int) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree over path scores sum log q. ``tables[i]`` holds the transitions into depth i+1; the
    root's children come from row 0 of ``tables[0]``. Returns (tokens, parents, path scores) in pop order
    (a topological order: a parent pops before its children, siblings in decreasing score)."""
    if tree_size <= 0 or not tables:
        return [], [], []
    toks, lps, nxt = read_tables(tables)
    n_depth = len(tables)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    counter = 0
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-score, order, depth idx, src row, rank, parent)
    if toks[0] and toks[0][0] and math.isfinite(lps[0][0][0]):
        heap.append((-lps[0][0][0], counter, 0, 0, 0, -1))
    while heap and len(tokens) < tree_size:
        neg, _, d, r, c, parent = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(int(toks[d][r][c]))
        parents.append(parent)
        scores.append(score)
        row_lp = lps[d][r]
        if c + 1 < len(row_lp) and math.isfinite(row_lp[c + 1]):  # next sibling
            counter += 1
            heapq.heappush(heap, (-(score - row_lp[c] + row_lp[c + 1]), counter, d, r, c + 1, parent))
        child_src = nxt[d][r][c]
        if d + 1 < n_depth and child_src >= 0 and toks[d + 1][child_src]:  # first child
            child_lp = lps[d + 1][child_src][0]
            if math.isfinite(child_lp):
                counter += 1
                heapq.heappush(heap, (-(score + child_lp), counter, d + 1, child_src, 0, node))
    return tokens, parents, scores


def marginal_tables(logp: torch.Tensor, k: int) -> list[TransitionTable]:
    """[D, N] marginal log-probs -> tables where every node's children are the next depth's top-k."""
    k = min(k, logp.shape[-1])
    top = logp.topk(k, dim=-1)
    D = logp.shape[0]
    out = []
    for d in range(D):
        nxt = torch.full((1, k), 0 if d + 1 < D else -1, dtype=torch.long, device=logp.device)
        out.append(TransitionTable(top.indices[d:d + 1], top.values[d:d + 1], nxt))
    return out


def treeflash_tables(cand: torch.Tensor, cond_logp: Sequence[torch.Tensor], k: int) -> list[TransitionTable]:
    """cand [D, m]: marginal top-m tokens per depth (candidate previous tokens); cond_logp[i]: [R_i, N]
    conditional log-probs into depth i+1 (R_0 = 1: the root; R_i = m: previous token cand[i-1, r]).
    A transition token gets children only if it is among cand of its own depth (the top-m rule)."""
    D = len(cond_logp)
    out = []
    for d in range(D):
        kk = min(k, cond_logp[d].shape[-1])
        top = cond_logp[d].topk(kk, dim=-1)
        if d + 1 < D:
            eq = top.indices[:, :, None] == cand[d][None, None, :]  # [R, k, m]
            nxt = torch.where(eq.any(-1), eq.float().argmax(-1), torch.full_like(top.indices, -1))
        else:
            nxt = torch.full_like(top.indices, -1)
        out.append(TransitionTable(top.indices, top.values, nxt))
    return out


# ---------------------------------------------------------------- one draft from block states
class BlockRows:
    """The per-row networks a TreeFlash draft runs around its block forward, as callables over rows (each a
    ``RowFeed``'s module, so that a scheduler runs those of all its requests drafting with one model in one call):
    ``context`` (before it) new verifier rows and their positions -> their projection and context keys and values;
    ``logits`` [n, d] backbone rows -> [n, N] draft-vocabulary logits; ``ar`` [n, 2 d] (a marginal state beside the
    embedding of the previous token) -> [n, N] log-probs of the AR-corrected state."""

    def __init__(self, model: TreeFlashModel, pieces: VerifierPieces):
        self.model, self.pieces = model, pieces
        self.logits = lambda h: model.logits(pieces, h)
        self.ar = lambda rows: model.logits(pieces, model.ar_hidden(*rows.chunk(2, -1), pieces)).float().log_softmax(-1)
        self.context = self._context  # one bound method: a row feed's module is grouped by its identity

    def _context(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifier states of new context rows [n, len(context_layers) * d_v] at ``positions`` [n] -> (their
        projection [n, w], their keys and values [n, layers, 2, n_kv, head_dim])."""
        proj = self.model.project_context(hidden)
        kv = self.model.context_kv(proj, positions)  # per layer (k, v) [1, n_kv, n, hd]
        return proj, torch.stack([torch.stack([k[0], v[0]]) for k, v in kv]).permute(3, 0, 1, 2, 4)


@torch.no_grad()
def draft_from_block(model: TreeFlashModel, pieces: VerifierPieces, h: torch.Tensor, root: int, mode: str,
                     depth: int, m: int, k: int, tree_size: int) -> tuple[list[int], list[int]]:
    """h [B, d] backbone output of one block; returns (reduced-vocab tokens, parents) of the draft.

    depth: deepest depth to draft (<= B-1)."""
    return drive(draft_from_block_steps(BlockRows(model, pieces), h, root, mode, depth, m, k, tree_size))


def draft_from_block_steps(nets: BlockRows, h: torch.Tensor, root: int, mode: str, depth: int, m: int, k: int,
                           tree_size: int) -> Drafting:
    """``draft_from_block`` as a drafting loop: its logits over the block's rows and its AR pass over the candidates
    are yielded (``RowFeed`` s of ``nets``)."""
    if depth <= 0:
        return [], []
    hd = h[1:depth + 1]  # [D, d]: row i predicts depth i+1
    logits = (yield RowFeed(nets.logits, hd)).float()  # [D, N]
    if mode == "chain":
        toks = yield HostRead(logits.argmax(-1))  # a batch's read at once
        return toks, list(range(-1, len(toks) - 1))
    logp = logits.log_softmax(-1)
    if mode == "marginal":
        return build_tree(marginal_tables(logp, k), tree_size)[:2]
    # treeflash: candidates, then one batched AR pass over (depth, previous token) pairs
    pieces = nets.pieces
    m = min(m, logp.shape[-1])
    cand = logp[: depth - 1].topk(m, dim=-1).indices if depth > 1 else logp.new_zeros(0, m, dtype=torch.long)
    dt = h.dtype
    root_emb = pieces.embed(to_device([root], h.device, torch.long), dt)  # [1, d]
    prev = [root_emb]
    rows = [hd[0:1]]
    if depth > 1:
        full_cand = pieces.to_full(cand)
        prev.append(pieces.embed(full_cand.reshape(-1), dt))  # [(D-1) m, d]
        rows.append(hd[1:, None, :].expand(-1, m, -1).reshape(-1, hd.shape[-1]))
    cond = yield RowFeed(nets.ar, torch.cat([torch.cat(rows), torch.cat(prev)], -1))  # [1 + (D-1) m, N]
    cond_logp = [cond[0:1]] + list(cond[1:].reshape(depth - 1, m, -1)) if depth > 1 else [cond[0:1]]
    return build_tree(treeflash_tables(cand, cond_logp, k), tree_size)[:2]


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | Path, model: TreeFlashModel, vocab: DraftVocab, meta: dict | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the weights (``dtype``), the draft vocabulary and config.json (``meta`` merged in: e.g.
    ``defaults`` for drafting, ``verifier``, ``training``) into the directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}, str(path / WEIGHTS_FILE),
              metadata={"format": CHECKPOINT_FORMAT})
    vocab.save(path / VOCAB_FILE)
    config = {"format": CHECKPOINT_FORMAT, "version": 1, "model": model.cfg.to_dict(), "weights": WEIGHTS_FILE,
              "weights_dtype": str(dtype).removeprefix("torch."), "draft_vocab": VOCAB_FILE,
              "draft_vocab_size": len(vocab), **(meta or {})}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return path


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[TreeFlashModel, DraftVocab, dict]:
    """A TreeFlash checkpoint directory -> (model, draft vocabulary, config.json contents)."""
    path = Path(path)
    meta = read_checkpoint_config(path, CONFIG_FILE, CHECKPOINT_FORMAT, "TreeFlash")
    model = TreeFlashModel(TreeFlashConfig.from_dict(meta["model"]))
    load_network_weights(model, path / meta.get("weights", WEIGHTS_FILE))  # plain or packed (metasd pack-weights)
    vocab = DraftVocab.load(path / meta.get("draft_vocab", VOCAB_FILE))
    if dtype is not None:
        model.to(dtype)
    return model.eval().requires_grad_(False), vocab, meta


# ---------------------------------------------------------------- the drafter
class TreeFlashParams(DrafterParams):
    """Pool-config ``params`` of the TreeFlash drafter; keys left out take the checkpoint's defaults."""

    mode: Literal["chain", "marginal", "treeflash"] = "treeflash"
    block_size: Int | None = Field(None, ge=2, description="B, drafts reach depth B-1 (at most the trained B, checked on load)")
    m: Int = Field(8, ge=1, description="candidate previous tokens per depth")
    k: Int = Field(8, ge=1, description="transitions kept per source")
    tree_size: Int = Field(32, ge=1, description="draft nodes per step")
    context_window: Int | None = Field(None, ge=0, description="context positions a block sees (0: all)")


@register_drafter
class TreeFlashDrafter(VerifierStateDrafter):
    """One-shot block drafter with the TreeFlash tree construction (see module docstring).

    model: a trained ``TreeFlashModel``; verifier_model: the verifier (transformers causal LM) whose
    embeddings, final norm and LM head the drafter uses, frozen; vocab: the reduced draft vocabulary.
    mode: "chain" | "marginal" | "treeflash"; block_size: B (<= the trained block size; drafts reach
    depth B-1); m: candidate previous tokens per depth; k: transitions kept per source; tree_size: nodes.
    """

    kind = "treeflash"
    load_checkpoint = staticmethod(load_checkpoint)
    Params = TreeFlashParams

    def __init__(self, model: TreeFlashModel, verifier_model, vocab: DraftVocab, mode: str = "treeflash",
                 block_size: int | None = None, m: int = 8, k: int = 8, tree_size: int = 32,
                 context_window: int | None = None, name: str | None = None, checkpoint: str | None = None):
        super().__init__(name)
        check_params(TreeFlashParams, dict(mode=mode, block_size=block_size, m=m, k=k, tree_size=tree_size,
                                           context_window=context_window), self.name)
        cfg = model.cfg
        block_size = cfg.block_size if block_size is None else block_size
        if block_size > cfg.block_size:  # needs the checkpoint
            raise ValueError(f"{self.name}: block_size must be in [2, {cfg.block_size}] (trained with {cfg.block_size}), got {block_size}")
        n_layers = check_verifier_fit(f"{self.name}: checkpoint {checkpoint or '(in memory)'}", cfg, verifier_model, vocab)
        bad = [layer for layer in cfg.context_layers if not 0 <= layer <= n_layers]
        if bad:
            raise ValueError(f"{self.name}: context layers {bad} outside the verifier's hidden states 0..{n_layers}")
        self.mode, self.block_size, self.m, self.k, self.tree_size = mode, block_size, int(m), int(k), int(tree_size)
        self.context_window = cfg.context_window if context_window is None else int(context_window)
        dtype = verifier_model.dtype
        self.device = verifier_model.device  # the network runs beside the verifier whose states it reads
        self.model = model.to(self.device, dtype).eval().requires_grad_(False)
        self.vocab = vocab
        self.pieces = VerifierPieces.from_model(verifier_model, vocab.token_ids)
        self.block_rows = BlockRows(self.model, self.pieces)  # shared by the forks: their row feeds group together
        self.hidden_layers = tuple(cfg.context_layers)
        self.checkpoint = checkpoint
        self._ctx_kv: list[list[torch.Tensor]] | None = None  # per layer [k, v] caches [1, n_kv, n, hd]
        self._ctx_rows = 0
        self._ctx_last: torch.Tensor | None = None  # [1, w] projection of the last committed row
        self._own_rows = 0  # rows the verifier added for this drafter's own last step (not catch-up)
        self._last_catch_up = 0

    def quantize(self, mode: str) -> None:
        """Weight-only quantization of the drafter's own layers (not the verifier's head slice)."""
        quantize_model(self.model, mode, name=f"drafter {self.name!r}")

    # ---------------------------------------------------------- per request
    def begin(self, ctx: StepContext) -> None:
        self._ctx_kv, self._ctx_rows, self._ctx_last, self._own_rows = None, 0, None, 0

    def end(self) -> None:
        self._ctx_kv, self._ctx_rows, self._ctx_last, self._own_rows = None, 0, None, 0

    def observe(self, feedback) -> None:
        self._own_rows = len(feedback.committed)  # the pending token and the accepted nodes get states

    def _sync_context_steps(self, ctx: StepContext) -> Drafting:
        """Project the verifier states of rows not seen yet; returns how many rows were added. A drafting loop: the
        projection of the new rows is yielded (a ``RowFeed`` with their positions), so that a scheduler projects those
        of all its requests in one call."""
        n = len(ctx.tokens) - 1  # rows 0..T-2 are committed tokens with verifier states
        if ctx.hidden is None:
            raise RuntimeError(f"{self.name}: the engine gave no verifier hidden states (layers {self.hidden_layers})")
        if len(ctx.hidden) < n:
            raise RuntimeError(f"{self.name}: {len(ctx.hidden)} verifier states for {n} committed positions")
        if self._ctx_kv is None or self._ctx_rows > n:
            self._ctx_kv, self._ctx_rows, self._ctx_last = None, 0, None
        new = n - self._ctx_rows
        if new > 0:
            hidden = torch.cat([ctx.hidden.get(layer)[self._ctx_rows:n] for layer in self.hidden_layers], dim=-1)
            positions = torch.arange(self._ctx_rows, n, device=hidden.device)
            proj, packed = yield RowFeed(self.block_rows.context, hidden, positions)  # [new, w], [new, L, 2, n_kv, hd]
            self._ctx_last = proj[-1:]
            kv = [(layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None])  # [1, n_kv, new, hd] each
                  for layer in packed.permute(1, 2, 0, 3, 4)]
            if self._ctx_kv is None:
                self._ctx_kv = [[k.contiguous(), v.contiguous()] for k, v in kv]
            else:
                for cache, (k, v) in zip(self._ctx_kv, kv):
                    cache[0] = torch.cat([cache[0], k], dim=2)
                    cache[1] = torch.cat([cache[1], v], dim=2)
            if self.context_window and self._ctx_kv[0][0].shape[2] > 4 * self.context_window:
                for cache in self._ctx_kv:  # keep memory bounded: only the last C rows are ever read
                    cache[0] = cache[0][:, :, -self.context_window:].contiguous()
                    cache[1] = cache[1][:, :, -self.context_window:].contiguous()
            self._ctx_rows = n
        return max(new, 0)

    def _context(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._ctx_kv is None:  # no committed row has a verifier state yet (one-token prompt)
            empty = torch.zeros(1, self.model.cfg.num_kv_heads, 0, self.model.cfg.head_dim, dtype=self.model.dtype,
                                device=self.device)
            return [(empty, empty) for _ in self.model.layers]
        C = self.context_window
        return [(k[:, :, -C:], v[:, :, -C:]) if C else (k, v) for k, v in self._ctx_kv]

    @torch.inference_mode()
    def block_states(self, ctx: StepContext) -> torch.Tensor:
        """[B, d] backbone output for the block after ``ctx.tokens``."""
        return drive(self._block_states(ctx))

    def _block_states(self, ctx: StepContext) -> Drafting:
        """``block_states`` as a drafting loop: the backbone's block forward is yielded (a ``BlockFeed``), so that a
        scheduler runs the blocks of all its requests drafting with this model in one forward; the context's
        catch-up before it (``_sync_context_steps``) is yielded too."""
        self._last_catch_up = max((yield from self._sync_context_steps(ctx)) - self._own_rows, 0)
        self._own_rows = 0
        T = len(ctx.tokens)
        root = int(ctx.tokens[-1])
        emb = self.pieces.embed(to_device([root], self.device, torch.long), self.model.dtype)
        block = self.model.block_inputs(emb, self.block_size)
        positions = torch.arange(T - 1, T - 1 + self.block_size, device=self.device)[None]
        skip = None
        L = self.model.cfg.output_skip_layer
        if L is not None and T >= 2:
            skip = ctx.hidden.get(L)[T - 2:T - 1]
        return (yield BlockFeed(self.model, block, positions, self._context(), self._ctx_last, skip))[0]

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    @torch.inference_mode()  # on a generator: each stretch between its feeds runs in inference mode
    def drafting(self, ctx: StepContext) -> Drafting:
        """``propose`` as a drafting loop (its block forward yielded; ``_block_states``)."""
        depth = min(self.block_size - 1, ctx.max_depth)
        if depth <= 0:
            yield from self._sync_context_steps(ctx)
            self._own_rows = 0
            return Draft.empty()
        h = yield from self._block_states(ctx)
        toks, parents = yield from draft_from_block_steps(self.block_rows, h, int(ctx.tokens[-1]), self.mode, depth,
                                                          self.m, self.k, self.tree_size)
        full = self.vocab.to_full(torch.tensor(toks, dtype=torch.long))
        return Draft(full, torch.tensor(parents, dtype=torch.long), catch_up=self._last_catch_up)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": self.mode, "block_size": self.block_size, "m": self.m, "k": self.k,
                "tree_size": self.tree_size, "context_window": self.context_window, "draft_vocab": len(self.vocab),
                "checkpoint": self.checkpoint}
