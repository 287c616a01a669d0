"""Host time per step: what the Python around the forwards costs (policy, drafting bookkeeping, tree masks,
acceptance, commit, stop checks, the record), measured with models whose forwards cost almost nothing.

Issue "metasd at GPU speed", item 3: a graph-replayed GPU step is a few milliseconds, so the host work around it is
the next bottleneck. Here the verifier and the drafter are one-layer Qwen2 models of width 16 with the bundled
vocabulary (151,936 ids, so that reading logits, argmax and sampling have their real size); every model forward is
timed by hooks and subtracted from the step's wall time. What is left is host time - on this CPU, where the "device"
is the CPU too, it includes the small tensor ops of acceptance, which a GPU would run asynchronously.

    python benchmarks/host_time.py --steps 200 --out benchmarks/results/host_time.json

``--trie DEPTH`` measures what feeding a suffix drafter's trie costs per committed token (``measure_trie``).

``--batch B [B ...]`` measures a scheduler step instead (issue "A batch at GPU speed"): B requests running together
through ``metasd serve``'s scheduler at fixed shapes (the path a GPU captures, run eagerly: the runners' input staging
and padding included), the same stand-ins, greedy; host time = a step's wall time minus its forwards, per step and
per request. Drafters there: none, a 4-token chain, the GPU default's static tree [4, 2, 2, 1], suffix lookups,
the served pool's cascade (configs/pools/serve_adaptive.yaml: suffix lookup, then a dynamic tree) alone ("cascade")
and as that pool runs it ("adaptive": its budget arms, per_load policy and step allocator, priced by a flat forward
and modeled drafting costs: the same decisions every run).

    python benchmarks/host_time.py --batch 1 4 16 --steps 60 --vocab 1024 --out host_time_batch.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

VOCAB = 151936


def stand_in(seed: int, vocab: int = VOCAB):
    """A causal LM that costs almost nothing per forward (one layer, width 16) with the real vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


class ForwardClock:
    """Seconds spent inside model forwards (hooks on each model)."""

    def __init__(self, *models):
        self.seconds, self._start = 0.0, {}
        for m in models:
            m.register_forward_pre_hook(lambda mod, a: self._start.__setitem__(id(mod), time.perf_counter()))
            m.register_forward_hook(lambda mod, a, o: self._add(mod))

    def _add(self, mod):
        self.seconds += time.perf_counter() - self._start.pop(id(mod))


def measure(kind: str, steps: int, temperature: float, vocab: int = VOCAB) -> dict:
    """Median host milliseconds per step (step wall time minus its forwards) of one request of ``steps`` steps."""
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter

    verifier = stand_in(0, vocab)
    drafter_model = stand_in(0, vocab)
    drafter = {"none": lambda: [], "chain": lambda: PretrainedDrafter(drafter_model, k=4),
               "tree": lambda: PretrainedTreeDrafter(drafter_model, nodes=16, depth=4, width=4),
               "ngram": lambda: NGramDrafter(k=8)}[kind]()
    engine = Engine(Verifier(verifier), drafter, check_tokenizers=False)
    clock = ForwardClock(verifier, drafter_model)
    per_step, tokens = [], 0
    prompt = list(range(1, 65))
    run = engine._run(prompt, steps * 8, temperature=temperature, seed=0 if temperature else None)
    last, fwd = time.perf_counter(), clock.seconds
    for committed in run.steps():
        now = time.perf_counter()
        per_step.append(((now - last) - (clock.seconds - fwd)) * 1e3)
        last, fwd = now, clock.seconds
        tokens += len(committed)
        if len(per_step) >= steps:
            break
    per_step = per_step[5:]  # the first steps include the prefill and the drafter's start
    return {"drafter": kind, "temperature": temperature, "vocab": vocab, "steps": len(per_step),
            "host_ms_median": statistics.median(per_step), "host_ms_p90": sorted(per_step)[int(0.9 * len(per_step))],
            "tokens_per_step": tokens / max(len(per_step) + 5, 1)}


BATCH_DRAFTERS = ("none", "chain", "static_tree", "suffix", "cascade", "adaptive")


def flat_cost(tokens: int) -> float:
    """A launch-bound forward's relative cost (a GPU's: nearly flat in its tokens), for the adaptive allocator."""
    return 1.0 + tokens / 1024


def serve_pool(drafter_model, adaptive: bool):
    """configs/pools/serve_adaptive.yaml's pool on a stand-in drafter: the cascade (suffix lookup, then a dynamic
    tree where the match is short) - alone, or as its three budget arms under its per_load policy with the step
    allocator (``AdaptiveSpeculation`` priced by flat_cost and the drafters' modeled costs - not by measured seconds as
    the served pool is, so that every run makes the same decisions and does the same work). Returns (drafters, engine
    kwargs, adaptive)."""
    from metasd.core.batching.adaptive import AdaptiveSpeculation
    from metasd.core.decoding.policy import make_policy
    from metasd.drafters import FusedDrafter, PretrainedTreeDrafter, SuffixDrafter
    from metasd.drafters.budgeted import budget_arms

    cascade = FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"),
                            PretrainedTreeDrafter(drafter_model, mode="dynamic", nodes=32, depth=16, width=4,
                                                  min_path_prob=0.3, name="tree", fixed_shapes=True)],
                           enough=6, name="cascade")
    if not adaptive:
        return [cascade], {}, None
    arms = budget_arms(cascade, (4, 16, 48))
    policy = make_policy("per_load", len(arms), seed=0, inner="ucb", inner_params={"c": 1.0, "normalize": True})
    return arms, {"policy": policy, "reward": "throughput", "feedback": "full", "persistent_policy": True}, \
        AdaptiveSpeculation(flat_cost, max_width=48, price_drafting=True, unit_seconds=None, min_gain=1.2,
                            defer_catch_up=True, probe_stall=3)


def measure_batch(kind: str, steps: int, batch: int, vocab: int = VOCAB) -> dict:
    """Median host milliseconds per scheduler step (its wall time minus its forwards) with ``batch`` requests running
    together at fixed shapes, over ``steps`` steps of the full batch."""
    from metasd.core.batching.scheduler import Scheduler, SchedulerStep
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.drafters import PretrainedDrafter, StaticTreeDrafter, SuffixDrafter

    verifier, drafter_model = stand_in(0, vocab), stand_in(0, vocab)
    engine_kw, adaptive = {}, None
    if kind in ("cascade", "adaptive"):
        drafter, engine_kw, adaptive = serve_pool(drafter_model, kind == "adaptive")
    else:
        drafter = {"none": lambda: [], "chain": lambda: PretrainedDrafter(drafter_model, k=4, fixed_shapes=True),
                   "static_tree": lambda: StaticTreeDrafter(drafter_model, widths=[4, 2, 2, 1], fixed_shapes=True),
                   "suffix": lambda: SuffixDrafter()}[kind]()
    engine = Engine(Verifier(verifier, fixed_shapes=True), drafter, check_tokenizers=False, **engine_kw)
    clock = ForwardClock(verifier, drafter_model)
    per_step, plans, full, work, planning = [], [], [], [], [0.0]  # work: (committed, drafted) per full step
    with Scheduler(engine, max_batch=batch, adaptive=adaptive) as s:
        step = s._step
        if adaptive is not None:  # the step allocator's share of the host time: its step_plan, timed apart
            step_plan = adaptive.step_plan

            def timed_plan(*a, **k):
                t0 = time.perf_counter()
                try:
                    return step_plan(*a, **k)
                finally:
                    planning[0] += time.perf_counter() - t0
            adaptive.step_plan = timed_plan

        def timed_step():
            t0, f0, p0 = time.perf_counter(), clock.seconds, planning[0]
            step()
            per_step.append(((time.perf_counter() - t0) - (clock.seconds - f0)) * 1e3)
            plans.append((planning[0] - p0) * 1e3)

        s._step = timed_step
        enough = threading.Event()

        def on_record(r):
            if isinstance(r, SchedulerStep) and r.batch_size == batch:
                full.append(len(per_step))
                work.append((sum(q.committed for q in r.requests), sum(q.drafted for q in r.requests)))
                if len(full) >= steps + 5:
                    enough.set()

        s.add_listener(on_record)
        with s._lock:  # every request in before the first step; long enough for ``steps`` steps of 16 tokens
            handles = [s.submit([1 + (7 * i + j) % (vocab - 1) for j in range(64)], 16 * (steps + 10))
                       for i in range(batch)]
        deadline = time.monotonic() + 600
        while not enough.wait(0.2) and time.monotonic() < deadline and not all(h.finished for h in handles):
            pass  # a drafter right more often ends its requests sooner: fewer steps, as "steps" says
        for h in handles:  # enough steps of the full batch: the requests end
            h.cancel()
    # the steps of the full batch (each listener call follows its step's record), the first 5 dropped (captures of
    # shapes, the drafters' start)
    ms, plan_ms = [per_step[i - 1] for i in full][5: steps + 5], [plans[i - 1] for i in full][5: steps + 5]
    work = work[5: steps + 5]
    return {"drafter": kind, "batch": batch, "vocab": vocab, "steps": len(ms),
            "host_ms_median": statistics.median(ms), "host_ms_p90": sorted(ms)[int(0.9 * len(ms))],
            "host_ms_per_request": statistics.median(ms) / batch,
            "plan_ms_median": statistics.median(plan_ms),  # the allocator's step_plan (0 without one)
            "committed_per_step": statistics.mean(c for c, _ in work),
            "drafted_per_step": statistics.mean(d for _, d in work)}


def measure_trie(depth: int = 32, tokens: int = 6000, repeats: int = 12, seed: int = 0) -> dict:
    """Microseconds per token fed to a ``SuffixTrie`` of ``depth`` levels (the served pool's suffix lookup: a match of
    16 tokens, then 16 to draft), over ``tokens`` tokens: half text that does not repeat (a vocabulary of 2,000 ids),
    half text that does (50 ids) - the per-token work every committed token costs each suffix drafter."""
    import random

    from metasd.drafters.suffix_trie import SuffixTrie

    rng = random.Random(seed)
    text = [rng.randrange(2000) for _ in range(tokens // 2)] + [rng.randrange(50) for _ in range(tokens - tokens // 2)]
    us = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trie = SuffixTrie(depth)
        trie.extend(text)
        us.append((time.perf_counter() - t0) / len(text) * 1e6)
    return {"depth": depth, "tokens": len(text), "nodes": trie.n_nodes, "repeats": repeats,
            "us_per_token_median": statistics.median(us), "us_per_token_min": min(us), "us_per_token_max": max(us)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--drafters", nargs="+", default=["none", "chain", "tree", "ngram"])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, nargs="+", default=[VOCAB],
                   help="stand-in vocabulary sizes: the real one (151,936) includes the vocabulary-wide tensor work a "
                        "GPU runs asynchronously; a small one leaves the Python bookkeeping alone")
    p.add_argument("--batch", type=int, nargs="+",
                   help="measure scheduler steps of these many requests together instead (module docstring; "
                        f"drafters from {', '.join(BATCH_DRAFTERS)}, greedy)")
    p.add_argument("--trie", type=int, metavar="DEPTH",
                   help="measure feeding a suffix trie of DEPTH levels instead (measure_trie; --steps: its repeats)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.trie:
        rows = [measure_trie(args.trie, repeats=args.steps)]
        r = rows[0]
        print(f"suffix trie, depth {r['depth']}: {r['us_per_token_median']:.2f} us a token median "
              f"[{r['us_per_token_min']:.2f}, {r['us_per_token_max']:.2f}], {r['tokens']} tokens, {r['nodes']} nodes")
    elif args.batch:
        kinds = [k for k in args.drafters if k in BATCH_DRAFTERS] if args.drafters != p.get_default("drafters") \
            else list(BATCH_DRAFTERS)
        rows = [measure_batch(k, args.steps, b, v) for v in args.vocab for b in args.batch for k in kinds]
    else:
        rows = [measure(k, args.steps, t, v) for v in args.vocab for t in args.temperatures for k in args.drafters]
    for r in rows if not args.trie else []:
        what = f"batch {r['batch']:2d}" if "batch" in r else f"T={r['temperature']:.0f}"
        plan = f", allocator {r['plan_ms_median']:.2f} of it" if r.get("plan_ms_median") else ""
        print(f"{r['drafter']:11s} {what} vocab {r['vocab']}: host {r['host_ms_median']:.2f} ms/step median "
              f"(p90 {r['host_ms_p90']:.2f}{plan}), {r['steps']} steps")
    if args.out:
        out = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                          f"{args.threads} threads", "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
