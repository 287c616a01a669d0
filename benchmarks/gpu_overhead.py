"""The engine's own overhead, measured with a drafter whose acceptance is known: metasd's speed over transformers'
plain decoding at a fixed number of tokens per step, on random-weight models of real shapes (no weights to copy).

The replay drafter (``type: replay``) drafts the verifier's own greedy continuation, right for ``accept`` tokens and
wrong for one more, so every greedy step commits ``accept + 1`` tokens and drafting costs nothing: what a step costs
beyond the verifier's forward is the engine's (draft bookkeeping, mask and position building, acceptance, cache
commit, reward and policy). ``tokens/step 1`` is plain decoding through metasd's engine (no drafter).

How it is measured (each a rule that an earlier version broke):

- The continuation is recorded once, up front, by transformers' greedy ``generate`` (max new tokens + the deepest
  draft), and the drafter never records inside a step (``rerecord=False``): a step that leaves the recording, or
  commits another tokens/step than its target, fails its row loudly (``"failed"``) instead of being re-recorded and
  timed as if it were the engine's work.
- Both methods are timed the same way: the whole call (prefill included), the device synchronised before and
  after, ``repeats`` times with the order of the two methods alternated per repeat; medians and ranges are reported.
  ``ms_per_step`` is metasd's decoding time per step (its call less its own synchronised prefill time).
- The verifier forward's share (hooks that synchronise around every forward) and the host-device synchronisations
  (host reads counted by a ``TorchFunctionMode``; on CUDA every synchronising call counted by
  ``torch.cuda.set_sync_debug_mode``, and the clock's syncs) are each counted in a pass of their own, never timed.
- Item 3's host overhead (``host_overhead``): 1 - the device's busy time (kernels and copies, torch.profiler's CUDA
  activity, in a profiled pass of its own) / the call's timed wall time, per whole call (prefill included; the
  issue's per-step median is not separated out); CUDA only.
- Models are built in their dtype directly on the device (meta-device init, ``to_empty``, then initialised there),
  so the 8B shape needs no host copy. The weights are random but greedy decoding is decisive: an untied head whose
  row for token ``perm[t]`` is token t's embedding (scaled), and residual branches kept small, so each position's
  top logit stands far above the second (the top-2 margins of the recording are reported). A random head is not
  enough: a tie is a near-equality of two logits, and scaling the head scales the margin and the rounding alike.
- ``--trees D:N ...`` adds rows for the default drafter's kind (a dynamic ``pretrained_tree``, width 4) on a
  random 0.5B-shaped drafter that shares the verifier's ``perm`` (so it drafts the verifier's text), depth D, at most
  N nodes (``D:N:int4`` quantizes the drafter as the default pool does); ``static:W,W,...`` a static tree (every node
  at level d gets its top ``W_d`` tokens: drafted on the device, read once a step) on the same drafter.
- ``--chains K ...`` adds rows of the pretrained chain drafter on the same random drafter, ``K`` tokens a step: the
  real drafting cost of a chain (K drafter forwards a step, on the device, read once with the verifier's choices) at
  about K + 1 tokens a step (the issue's "0.5B chain drafter" rows). The 8B shape's drafter is the 0.5B shape with
  the 8B's vocabulary (152,064 ids, as Qwen2.5-7B and its 0.5B sibling's checkpoints pair up by shared ids).

    python benchmarks/gpu_overhead.py --shapes 1.5b 8b --taus 2 4 6 --new-tokens 128 --trees 4:8 6:16 8:32 \
        --out $OUT/gpu_overhead.json

``--graphs off on`` runs each tokens/step row with the verifier's verify forwards eager and replayed from CUDA graphs
(``metasd/core/execution/graph_runner.py``); ``--drafter-graphs off on`` runs each chain and static-tree row with its
drafting loop eager and as one CUDA graph a step (``metasd/core/execution/draft_loop.py``; the catch-up forward and
the dynamic trees stay eager); ``--static`` times transformers'
static-cache ``generate`` (which transformers compiles on CUDA: the strongest plain baseline) beside every row, its
first call (the compilation) reported apart as ``static_compile_s``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout, as a GPU machine gets it)
import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from metasd import Engine, Verifier
from metasd.core.execution import clock
from metasd.core.execution.clock import synchronize
from metasd.core.execution.kv_cache import cache_kwargs, crop_to
from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter
from metasd.drafters.replay import ReplayDrafter, ReplayMiss
from metasd.core.execution.draft_loop import tree_shape
from metasd.models.quantize import quantize_model

#: the shapes of the bundled verifier (Qwen2.5-Coder-1.5B), the bundled drafter (0.5B) and an 8B-class verifier
#: (Qwen2.5-7B), as their config.json files give them; ``tiny`` for a quick check of the script. Every head is
#: untied here (``build`` gives it its own weights).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "8b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
#: the drafter shape of each verifier shape for ``--trees`` and ``--chains`` (built with the verifier's vocabulary:
#: ``drafter_config``)
DRAFTER_SHAPE = {"tiny": "tiny", "0.5b": "0.5b", "1.5b": "0.5b", "8b": "0.5b"}


def drafter_config(shape: str) -> tuple[str, dict]:
    """The drafter shape for verifier ``shape`` and its config, with the verifier's vocabulary."""
    small = DRAFTER_SHAPE[shape]
    return small, {**SHAPES[small], "vocab_size": SHAPES[shape]["vocab_size"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- models

def build(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, perm_seed: int = 1,
          config: dict | None = None, init: str = "decisive") -> Qwen2ForCausalLM:
    """A random-weight Qwen2 of ``shape`` in ``dtype`` on ``device``, built there (no host copy) with decisive greedy
    decoding (see the module docstring). Models with the same ``perm_seed`` and vocabulary continue a text alike.
    ``init="hf"``: what this benchmark used before (transformers' N(0, 0.02) everywhere, head tied to the
    embeddings), kept to show its near-ties (benchmarks/gpu_stall.py)."""
    cfg = Qwen2Config(**(config or SHAPES[shape]), tie_word_embeddings=init == "hf", max_position_embeddings=4096,
                      rope_theta=1e6, bos_token_id=0, eos_token_id=None)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device).eval()
    _fresh_buffers(model, device)
    if init == "hf":
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():  # the tied head is the embedding
                p.fill_(1.0) if name.endswith("norm.weight") else p.zero_() if name.endswith(".bias") else \
                    p.normal_(0.0, 0.02, generator=g)
    else:
        _init_decisive(model, seed, perm_seed)
    model.generation_config.eos_token_id = None
    return model


def _fresh_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """``to_empty`` leaves the non-persistent buffers (the rotary inverse frequencies) uninitialised: rebuild them."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(model.config)  # computed on the host in float32, as transformers does
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))


@torch.no_grad()
def _init_decisive(model: Qwen2ForCausalLM, seed: int, perm_seed: int, std: float = 0.02) -> None:
    """Embeddings N(0, 1); projections N(0, std), the residual branches' outputs (o_proj, down_proj) N(0, std /
    sqrt(2 layers)) so the residual stream stays near the token's embedding; norms 1, biases 0; the head's row
    ``perm[t]`` = embedding(t) / sqrt(d): after the final norm the top logit is ~0.8 sqrt(d), every other ~N(0, 1)."""
    device = model.device
    g = torch.Generator(device=device).manual_seed(seed)
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif name == "model.embed_tokens.weight":
            p.normal_(0.0, 1.0, generator=g)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.normal_(0.0, std / math.sqrt(2 * layers), generator=g)
        else:
            p.normal_(0.0, std, generator=g)
    embed = model.model.embed_tokens.weight
    perm = torch.randperm(embed.shape[0], generator=torch.Generator(device=device).manual_seed(perm_seed),
                          device=device)
    model.lm_head.weight.index_copy_(0, perm, embed / math.sqrt(embed.shape[1]))


def record(model, prompt: torch.Tensor, n: int) -> tuple[list[int], dict]:
    """transformers' greedy continuation of ``prompt`` ([1, T] on the model's device) for ``n`` tokens, and the
    distribution of its top-2 logit margins (one per token; ``ties``: margins of at most one rounding step of the
    top logit in the model's dtype, where a differently computed forward may pick the other token)."""
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    scores = torch.cat([s.float() for s in out.scores])  # [n, vocab]
    top = scores.topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).cpu()
    ulp = (top[:, 0].abs().to(model.dtype).float() * torch.finfo(model.dtype).eps).cpu()  # one rounding step
    q = torch.quantile(margin, torch.tensor([0.0, 0.01, 0.1, 0.5]))
    return out.sequences[0, prompt.shape[1]:].tolist(), {
        "tokens": n, "min": float(q[0]), "p1": float(q[1]), "p10": float(q[2]), "median": float(q[3]),
        "top_logit_median": float(top[:, 0].median()), "ties": int((margin <= ulp).sum())}


def forward_ms_by_rows(model, prompt: torch.Tensor, rows_list: list[int], device, repeats: int = 5) -> dict:
    """Median ms of one verifier forward of r rows after the prompt's cache, for each r (synchronised), and the
    ``CostModel`` dense row cost they imply: a forward costs ``a + b * rows`` ms, the model prices it
    ``weight_bytes + row_cost * macs * rows``, so ``row_cost = (b / a) * weight_bytes / macs`` (the bytes of a
    weight: its dtype's size). What ``CUDA_ROW_COST`` in ``metasd/core/pricing/cost.py`` is to be calibrated from."""
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt[:, :-1], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    base = prompt.shape[1] - 1
    vocab = model.config.vocab_size
    out = {}
    for r in rows_list:
        ids = torch.randint(1, vocab, (1, r), generator=torch.Generator().manual_seed(r)).to(device)
        ts = []
        for _ in range(repeats + 1):
            seconds, _ = timed(lambda: model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True), device)
            ts.append(seconds)
            crop_to(cache, base)
        out[r] = 1e3 * statistics.median(ts[1:])
    fit = {}
    if len(out) >= 2:
        xs, ys = list(out), list(out.values())
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        fit = {"ms_fixed": a, "ms_per_row": b,
               "implied_dense_row_cost": (b / a) * model.dtype.itemsize if a > 0 else None}
    return {"ms": out, "fit": fit}


# ---------------------------------------------------------------------------------------------- timing, counting

class ForwardTimer:
    """Seconds the verifier spends in its forwards, while ``enabled`` (hooks that synchronise around each: only in a
    pass of their own, never while a method is timed)."""

    def __init__(self, model, device):
        self.device, self.total, self._t0, self.enabled = device, 0.0, 0.0, False
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_):
        if self.enabled:
            synchronize(self.device)
            self._t0 = time.perf_counter()

    def _post(self, *_):
        if self.enabled:
            synchronize(self.device)
            self.total += time.perf_counter() - self._t0


class HostReads(TorchFunctionMode):
    """Counts reads of device (non-CPU) tensors by the host - item, tolist, cpu / to("cpu"), bool, int, float - and
    blocking copies to the device: ``torch.tensor(..., device=dev)`` and ``.to(dev)`` / ``.copy_`` of a host tensor
    without ``non_blocking``. 0 on a CPU-only run, where nothing is on a device."""

    NAMES = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = self.uploads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.device.type != "cpu":
            to_cpu = name == "to" and any(str(a).startswith("cpu") for a in list(args[1:]) + list(kwargs.values()))
            if name in self.NAMES or to_cpu:
                self.reads += 1
        elif name == "tensor" and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            self.uploads += 1
        elif isinstance(first, torch.Tensor) and name == "to" and not kwargs.get("non_blocking", False):
            target = [a for a in list(args[1:]) + [kwargs.get("device")] if isinstance(a, (str, torch.device))]
            if target and torch.device(target[0]).type != "cpu":
                self.uploads += 1
        return func(*args, **kwargs)


@contextmanager
def count_syncs(device: torch.device):
    """Counts, while open: host reads and blocking uploads (``HostReads``), the clock's device syncs
    (``metasd.core.execution.clock.synchronize``), and on CUDA every call torch reports as synchronising
    (``set_sync_debug_mode("warn")``)."""
    counts = {"host_reads": 0, "blocking_uploads": 0, "clock_syncs": 0, "cuda_sync_warnings": None}
    original = clock.synchronize

    def counted(dev):
        counts["clock_syncs"] += 1
        original(dev)

    clock.synchronize = counted
    mode = HostReads()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with mode:
                    yield counts
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        if device.type == "cuda":
            counts["cuda_sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        clock.synchronize = original
        counts["host_reads"], counts["blocking_uploads"] = mode.reads, mode.uploads


def timed(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---------------------------------------------------------------------------------------------- one row

def static_generate(model, prompt, n):
    """transformers' strongest plain decoding: ``generate`` over a static KV cache, whose decode step transformers
    compiles on CUDA (``torch.compile``, CUDA graphs; not on a CPU). The cache length is the same for every call of a
    shape (one prompt length, ``n`` fixed), so it compiles once."""
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, cache_implementation="static")


def gpu_busy_ms(fn, device) -> float | None:
    """The device's own time (kernels, copies) while ``fn()`` runs, from torch.profiler's CUDA activity, in ms; None
    off CUDA. A pass of its own: profiling slows the host, so the wall time it is set against is the timed passes'.
    Kernels inside a replayed CUDA graph are traced one by one, as launched ones are."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
               for e in prof.key_averages()) / 1e3


def measure_row(engine, model, prompt, ids, reference, n, repeats, device, timer, target_tau=None,
                warm_plain: bool = True, static: bool = False) -> dict:
    """Time metasd (``engine``) against transformers' ``generate`` of ``model`` for ``n`` new tokens (and, with
    ``static``, its static-cache compiled ``generate``: the strongest plain baseline); check each gives ``reference``,
    and, with ``target_tau``, that every step but the last committed that many tokens. The methods' order rotates
    per repeat."""
    want = reference[:n]
    row: dict = {}

    def ours():
        return engine.generate(ids, max_new_tokens=n)

    def plain():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)

    def check(result) -> str | None:
        if result.token_ids != want:
            at = next(i for i, (a, b) in enumerate(zip(result.token_ids, want)) if a != b)
            return f"metasd's tokens differ from the recording at new token {at}"
        taus = result.stats.tokens_per_step
        if target_tau is not None and (set(taus[:-1]) - {target_tau} or taus[-1] > target_tau):
            bad = next(i for i, t in enumerate(taus) if t != target_tau)
            return f"step {bad} committed {taus[bad]} tokens, not {target_tau} (tokens/step {taus})"
        return None

    try:
        seconds, _ = timed(ours, device)  # warm-up (allocator, kernels' first calls, graph captures)
        row["metasd_warmup_s"] = seconds
        if warm_plain:
            plain()
        methods = [("ours", ours), ("plain", plain)]
        if static:
            seconds, _ = timed(lambda: static_generate(model, prompt, n), device)  # compiles here (CUDA)
            row["static_compile_s"] = seconds
            row["static_compiled"] = hasattr(model, "_compiled_call")
            methods.append(("static", lambda: static_generate(model, prompt, n)))
        metasd_s, plain_s, static_s, decode_s, steps = [], [], [], [], []
        for r in range(repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]  # rotated: each method leads in turn
            for name, fn in order:
                seconds, out = timed(fn, device)
                if name in ("plain", "static"):
                    if out[0, prompt.shape[1]:].tolist() != want:
                        raise AssertionError(f"transformers' {name} tokens differ from the recording (a "
                                             f"nondeterministic kernel?)")
                    (plain_s if name == "plain" else static_s).append(seconds)
                    continue
                problem = check(out)
                if problem:
                    raise AssertionError(problem)
                metasd_s.append(seconds)
                decode_s.append(seconds - out.stats.prefill_s)
                steps.append(out.stats.steps)
        timer.total, timer.enabled = 0.0, True  # the verifier's forwards, in a pass of their own
        try:
            result = ours()
        finally:
            timer.enabled = False
        forward = timer.total / result.stats.steps
        with count_syncs(device) as counts:  # the host-device synchronisations, in a pass of their own
            result = ours()
    except (ReplayMiss, AssertionError) as e:
        row["failed"] = str(e)
        log(f"  ROW FAILED: {e}")
        return row
    except Exception as e:  # noqa: BLE001 - a row that breaks fails alone; the others still run
        row["failed"] = f"{type(e).__name__}: {e}"
        log(f"  ROW FAILED: {row['failed']}")
        return row
    s = result.stats.steps
    runner = getattr(engine.verifier, "runner", None)
    replayed = runner is not None and runner.capture
    per_step = [d / k for d, k in zip(decode_s, steps)]
    step = statistics.median(per_step)
    ratios = [p / m for p, m in zip(plain_s, metasd_s)]  # per repeat: the pair timed side by side
    row.update({
        "steps": s, "tokens_per_step_measured": n / s,
        "ms_per_step": 1e3 * step, "ms_per_step_range": [1e3 * min(per_step), 1e3 * max(per_step)],
        # a replayed graph runs no module hooks: the timer sees no verify forward, so neither figure is known there
        "verifier_forward_ms_per_step": None if replayed else 1e3 * forward,
        "engine_share": None if replayed else (max(step - forward, 0.0) / step if step else 0.0),
        "speedup_over_transformers": statistics.median(plain_s) / statistics.median(metasd_s),
        "speedup_range": [min(ratios), max(ratios)],
        "metasd_s": _spread(metasd_s), "transformers_s": _spread(plain_s),
        "metasd_tok_s": n / statistics.median(metasd_s), "transformers_tok_s": n / statistics.median(plain_s),
        **{f"{k}_per_step": (v / s if v is not None else None) for k, v in counts.items()},
    })
    if static_s:
        paired = [st / m for st, m in zip(static_s, metasd_s)]
        row.update({"speedup_over_static": statistics.median(paired), "speedup_over_static_range": [min(paired),
                    max(paired)], "static_s": _spread(static_s), "static_tok_s": n / statistics.median(static_s)})
    row["graphs"] = runner.describe() if runner is not None else None
    try:  # item 3's host overhead, per whole call (prefill included): 1 - the device's busy time / the call's wall time
        busy = gpu_busy_ms(ours, device)
        row["gpu_busy_ms_per_call"] = busy
        row["host_overhead"] = None if busy is None else max(0.0, 1.0 - busy / (1e3 * statistics.median(metasd_s)))
    except Exception as e:  # noqa: BLE001 - the profiler failing leaves the row's timings standing
        row["host_overhead"], row["host_overhead_error"] = None, f"{type(e).__name__}: {e}"
    return row


def _fmt(row: dict) -> str:
    if "failed" in row:
        return f"FAILED: {row['failed']}"
    syncs = row["cuda_sync_warnings_per_step"]
    return (f"{row['ms_per_step']:.2f} ms/step [{row['ms_per_step_range'][0]:.2f}-{row['ms_per_step_range'][1]:.2f}], "
            + (f"forward {row['verifier_forward_ms_per_step']:.2f} ms, engine {row['engine_share']:.0%}, "
               if row["engine_share"] is not None else "forward and engine share - (replayed graphs: no hooks), ")
            + f"reads {row['host_reads_per_step']:.1f} uploads {row['blocking_uploads_per_step']:.1f} "
            f"clock {row['clock_syncs_per_step']:.1f}" + (f" cuda syncs {syncs:.1f}" if syncs is not None else "")
            + f"/step, {row['speedup_over_transformers']:.2f}x transformers "
              f"[{row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f}]"
            + (f", {row['speedup_over_static']:.2f}x static-cache generate [{row['speedup_over_static_range'][0]:.2f}-"
               f"{row['speedup_over_static_range'][1]:.2f}]" if "speedup_over_static" in row else "")
            + (f", graphs {row['graphs']['captured']} captured in {row['graphs']['capture_s']:.1f} s "
               f"({row['graphs'].get('capture_mib', 0):.0f} MiB)" if row.get("graphs") else "")
            + (f", host overhead {row['host_overhead']:.0%} of the call" if row.get("host_overhead") is not None
               else ""))


# ---------------------------------------------------------------------------------------------- one shape

def parse_tree(spec: str) -> dict:
    if spec.startswith("static:"):  # static:W,W,...: the static tree drafter's widths per level
        try:
            widths = [int(w) for w in spec[len("static:"):].split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"static tree shapes are static:W,W,..., got {spec!r}") from None
        return {"depth": len(widths), "nodes": len(tree_shape(widths)[0]), "quantize": None, "static": widths}
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "int4"):
        raise argparse.ArgumentTypeError(f"tree shapes are DEPTH:NODES or DEPTH:NODES:int4, got {spec!r}")
    return {"depth": int(parts[0]), "nodes": int(parts[1]), "quantize": parts[2] if len(parts) == 3 else None}


def tree_drafter(model, tree: dict, drafter_graphs: str = "off"):
    """The drafter of a ``parse_tree`` shape on ``model``: a static tree of its widths (its drafting loop under
    ``drafter_graphs``), else the default drafter's kind (a dynamic ``pretrained_tree``, width 4, drafted eagerly)
    of its depth and nodes."""
    if "static" in tree:
        return StaticTreeDrafter(model, widths=tree["static"], name="tree", graphs=drafter_graphs)
    return PretrainedTreeDrafter(model, mode="dynamic", nodes=tree["nodes"], depth=tree["depth"], width=4,
                                 min_path_prob=0.3, name="tree")


def measure(shape: str, taus: list[int], n: int, prompt_len: int, repeats: int, device, dtype,
            trees: list[dict] = (), forward_rows: list[int] = (), tau_rows: bool = True, save=None,
            graphs: list[str] = ("off",), static: bool = False, chains: list[int] = (),
            drafter_graphs: list[str] = ("off",)) -> dict:
    """One shape's rows: tokens/step 1 and ``taus`` with the replay drafter (unless ``tau_rows`` is off), each under
    every ``graphs`` setting of the verifier, then ``chains`` and ``trees`` (under the last setting; a chain and a
    static tree once per ``drafter_graphs`` setting of their drafting loop); ``static``:
    transformers' static-cache ``generate`` timed beside each row; ``save(partial)`` after every row (a run cut short
    keeps what it measured)."""
    t_build = time.perf_counter()
    model = build(shape, device, dtype)
    synchronize(device)
    build_s = time.perf_counter() - t_build
    vocab = SHAPES[shape]["vocab_size"]
    prompt = torch.randint(1, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    ids = prompt[0].tolist()
    deepest = max([*taus, *(t["depth"] + 1 for t in trees), *(k + 1 for k in chains), 1])  # a step's deepest draft
    reference, margins = record(model, prompt, n + deepest + 1)
    log(f"{shape}: built in {build_s:.1f} s; top-2 margins of the recording: min {margins['min']:.3g}, "
        f"p10 {margins['p10']:.3g}, median {margins['median']:.3g} (top logit ~{margins['top_logit_median']:.3g}), "
        f"ties {margins['ties']}/{margins['tokens']}")
    by_rows = forward_ms_by_rows(model, prompt, forward_rows, device) if forward_rows else None
    if by_rows:
        log(f"  {shape} forward ms by rows: " + ", ".join(f"{r}: {ms:.2f}" for r, ms in by_rows["ms"].items())
            + (f"; implied dense row cost {by_rows['fit']['implied_dense_row_cost']:.3g}"
               if by_rows["fit"].get("implied_dense_row_cost") is not None else ""))
    verifiers = {g: Verifier(model, graphs=g) for g in graphs}  # fixed: the graph runner's buffers, eagerly
    verifier = verifiers[graphs[-1]]  # the chains' and trees' rows
    timer = ForwardTimer(model, device)
    rows = []
    result = {"shape": shape, "config": SHAPES[shape], "build_s": build_s, "margins": margins,
              "forward_ms_by_rows": by_rows, "rows": rows}
    save = save or (lambda partial: None)
    save(result)
    for tau in ([1] + [t for t in taus if t > 1]) if tau_rows else []:
        for g, v in verifiers.items():
            drafter = None
            if tau > 1:
                drafter = ReplayDrafter(model, accept=tau - 1, wrong=1, rerecord=False)
                drafter.record(ids, reference)
            row = {"drafter": "replay" if drafter else "none", "tokens_per_step": tau, "graphs_setting": g,
                   **measure_row(Engine(v, drafter), model, prompt, ids, reference, n, repeats, device, timer,
                                 target_tau=tau, warm_plain=not rows, static=static)}
            rows.append(row)
            save(result)
            log(f"  {shape} tokens/step {tau} graphs {g}: {_fmt(row)}")
    drafter_shape, drafter_cfg = drafter_config(shape)
    if trees or chains:
        # the same perm_seed and vocabulary: it continues the text alike
        small = build(drafter_shape, device, dtype, seed=2, config=drafter_cfg)
        for k, dg in [(k, dg) for k in chains for dg in drafter_graphs]:
            row = {"drafter": f"pretrained {drafter_shape}", "k": k, "graphs_setting": graphs[-1],
                   "drafter_graphs": dg}
            drafter = None
            try:
                drafter = PretrainedDrafter(small, k=k, name="chain", graphs=dg)
                row.update(measure_row(Engine(verifier, drafter), model, prompt, ids, reference, n, repeats, device,
                                       timer, warm_plain=not rows, static=static))
            except Exception as e:  # noqa: BLE001 - building this row's drafter broke: the row fails alone
                row["failed"] = f"{type(e).__name__}: {e}"
            row["draft_loops"] = drafter.loops.describe() if drafter is not None and drafter.loops else None
            rows.append(row)
            save(result)
            log(f"  {shape} chain k {k} drafter graphs {dg}: " + (f"{row['tokens_per_step_measured']:.2f} tokens/step, "
                                                                 if "failed" not in row else "") + _fmt(row))
        for tree, dg in [(t, dg) for t in trees for dg in (drafter_graphs if "static" in t else ["off"])]:
            row = {"drafter": f"{'static_tree' if 'static' in tree else 'pretrained_tree'} {drafter_shape}", **tree,
                   "graphs_setting": graphs[-1], "drafter_graphs": dg}
            drafter = None
            try:
                draft_model = small
                if tree["quantize"]:
                    draft_model = quantize_model(copy.deepcopy(small), tree["quantize"], name="drafter")
                drafter = tree_drafter(draft_model, tree, dg)
                row.update(measure_row(Engine(verifier, drafter), model, prompt, ids, reference, n, repeats, device,
                                       timer, warm_plain=not rows))
            except Exception as e:  # noqa: BLE001 - building this row's drafter broke: the row fails alone
                row["failed"] = f"{type(e).__name__}: {e}"
            row["draft_loops"] = drafter.loops.describe() if getattr(drafter, "loops", None) else None
            rows.append(row)
            save(result)
            log(f"  {shape} {'static ' if 'static' in tree else ''}tree depth {tree['depth']} nodes {tree['nodes']}"
                f"{' ' + tree['quantize'] if tree['quantize'] else ''} drafter graphs {dg}: "
                + (f"{row['tokens_per_step_measured']:.2f} tokens/step, " if "failed" not in row else "") + _fmt(row))
        del small
    del verifier, verifiers, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1.5b"], choices=sorted(SHAPES))
    p.add_argument("--taus", nargs="+", type=int, default=[2, 4, 6], help="tokens per step to measure (>= 2; 1 always)")
    p.add_argument("--trees", nargs="*", type=parse_tree, default=[], metavar="DEPTH:NODES[:int4] | static:W,W,..",
                   help="tree shapes of the default drafter's kind on the shape's drafter (1.5b: 0.5b), or of the "
                        "static tree drafter (its widths per level)")
    p.add_argument("--forward-rows", nargs="*", type=int, default=[], metavar="ROWS",
                   help="also time one verifier forward of each number of rows (to calibrate CUDA_ROW_COST)")
    p.add_argument("--chains", nargs="*", type=int, default=[], metavar="K",
                   help="chain drafter rows on the shape's drafter, K tokens a step")
    p.add_argument("--trees-only", action="store_true",
                   help="no tokens/step rows (the replay drafter's): trees and chains alone")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--graphs", nargs="+", default=["off"], choices=["auto", "on", "off", "fixed"],
                   help="the verifier's graphs settings: each tokens/step row runs under each (the trees under the "
                        "last); fixed = the graph runner's shapes and buffers run eagerly (its CPU path)")
    p.add_argument("--drafter-graphs", nargs="+", default=["off"], choices=["auto", "on", "off", "fixed"],
                   help="the chain's and the static trees' drafting loop (core/execution/draft_loop.py): each such row "
                        "runs under each; on = one CUDA graph a step, fixed = its buffers run eagerly (its CPU path)")
    p.add_argument("--static", action="store_true",
                   help="also time transformers' static-cache generate (compiled on CUDA) beside every row")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.repeats < 3:
        log(f"note: {args.repeats} repeats: medians and ranges want at least 3")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype, "graphs": args.graphs,
               "drafter_graphs": args.drafter_graphs,
               "timing": "whole call, prefill included, device synchronised before and after; methods alternated",
               "repeats": args.repeats, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
               "shapes": []}
    t0 = time.perf_counter()

    def save(partial: dict) -> None:  # after every row: a run cut short leaves what it measured
        if args.out:
            Path(args.out).write_text(json.dumps({**results, "shapes": done + [partial]}, indent=1))

    done: list[dict] = []
    with torch.inference_mode():
        for shape in args.shapes:
            done.append(measure(shape, args.taus, args.new_tokens, args.prompt_tokens, args.repeats, device, dtype,
                                args.trees, args.forward_rows, tau_rows=not args.trees_only, save=save,
                                graphs=args.graphs, static=args.static, chains=args.chains,
                                drafter_graphs=args.drafter_graphs))
    results["shapes"] = done
    results["wall_s"] = time.perf_counter() - t0
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    failed = [(s["shape"], r.get("tokens_per_step", r.get("depth"))) for s in results["shapes"] for r in s["rows"]
              if "failed" in r]
    if failed:
        log(f"FAILED rows (shape, tokens/step or tree depth): {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
