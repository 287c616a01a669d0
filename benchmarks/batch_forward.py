"""What the scheduler's batched verify forward costs per (rows, tokens a row): at its exact shape, eagerly, against
the fixed-shape runner (``metasd/core/execution/batch_runner.py``: CUDA graphs on a GPU; ``fixed`` runs its padded
buffers eagerly, the CPU check), on random weights of a real shape built on the device (``gpu_overhead.build``).
The profile the allocator prices a step from where forwards are captured (issue "A batch at GPU speed", item 2).
With ``--level draft``: a drafting level of the batch instead - every row's q tokens after its own context as one
drafter forward (``draft_batch.run_group``), ``off`` over each request's own cache (concatenated per forward, eager),
``on`` / ``fixed`` over one ``DraftRows`` (draft_rows.py: captured / its buffers eagerly).

    python benchmarks/batch_forward.py --shape 1.5b --rows 1 4 16 --tokens 1 4 8 16 --graphs off on --out X.json
    python benchmarks/batch_forward.py --level draft --shape 0.5b --rows 1 4 16 --tokens 1 4 --graphs off on
    python benchmarks/batch_forward.py --shape tiny --device cpu --graphs off fixed --out /tmp/bf.json   # dry run

Each setting gets its own ``BatchVerifier`` per row count: the rows are admitted and prefilled (``--context`` random
prompt tokens each, the same prompts for every setting) as the scheduler does, then each token count's forward - every
row a chain of tokens - 1 nodes - is timed ``--repeats`` times after two warm-ups (a capture among them), the device
synchronised around each, the positions it wrote dropped after it (every forward sees the same context). Settings
alternate per row count and token count. Reported: ms median / min / max per (setting, rows, tokens), the captured
over the eager median, and each runner's shapes, captures, capture seconds and memory.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout, as a GPU machine gets it)
import torch

from metasd import Verifier
from metasd.core.execution.batch_verifier import BatchVerifier, SlotVerifier
from metasd.core.execution.draft_batch import Feed, run_group
from metasd.core.execution.draft_rows import DraftRows
from metasd.core.execution.graph_runner import resolve_graphs
from metasd.core.execution.kv_cache import cache_kwargs
from metasd.core.execution.static_cache import new_cache
from metasd.core.execution.tree import Draft

from gpu_overhead import SHAPES, build, log, timed


def verifier_for(model, setting: str) -> Verifier:
    """The verifier of a setting: ``off`` exact shapes eagerly, ``on`` / ``auto`` captured, ``fixed`` the runner's
    buffers eagerly."""
    if setting == "fixed":
        return Verifier(model, graphs="off", fixed_shapes=True)
    return Verifier(model, graphs=setting)


def admitted(verifier: Verifier, prompts: list[list[int]], reserve: int) -> BatchVerifier:
    """A batched verifier with one running row per prompt, each prefilled as the scheduler prefills a joiner."""
    bv = BatchVerifier(verifier, len(prompts))
    for i, prompt in enumerate(prompts):
        bv.cache.reserve(i, reserve)
        prefill = bv.start_prefill(prompt[:-1])
        while not prefill.finished:
            prefill.step(256)
        bv.join(SlotVerifier(verifier, None), prefill)
    return bv


def time_forward(bv: BatchVerifier, pendings: list[int], drafts: list[Draft], repeats: int, device) -> list[float]:
    """Seconds of each of ``repeats`` forwards (after two warm-ups), the written positions dropped after each."""
    def once():
        outs = bv.verify(pendings, drafts)
        bv.cache.commit([None] * len(drafts))  # keep nothing: the next forward sees the same context
        return outs
    for _ in range(2):
        timed(once, device)
    return [timed(once, device)[0] for _ in range(repeats)]


class DraftLevel:
    """A drafting level of ``len(prompts)`` requests on ``model`` under a setting: each request's cache (its own:
    ``off``; a row of one ``DraftRows``: ``on`` / ``auto`` captured, ``fixed`` eagerly) prefilled with its prompt.
    ``verify``/``runner`` as ``BatchVerifier`` offers them to ``time_forward``."""

    def __init__(self, model, setting: str, prompts: list[list[int]]):
        self.model = model
        rows = None if setting == "off" else DraftRows(model, capture=setting != "fixed" and resolve_graphs(
            setting, model.device, "drafter"), name="drafter")
        self.runner = None if rows is None else rows.runner
        self.caches = [new_cache(model) if rows is None else rows.take() for _ in prompts]
        for cache, prompt in zip(self.caches, prompts):
            model(input_ids=torch.tensor([prompt], device=model.device), use_cache=True, **cache_kwargs(model, cache))
        self.context = [cache.get_seq_length() for cache in self.caches]
        self.cache = self  # time_forward commits through bv.cache

    def verify(self, pendings: list[int], drafts: list[Draft]) -> list[torch.Tensor]:
        """One level: row b feeds its pending token and its draft's tokens (a chain: causal) after its context."""
        return run_group([Feed(self.model, None, c, [p, *torch.as_tensor(d.tokens).tolist()]) for c, p, d in
                          zip(self.caches, pendings, drafts)])

    def commit(self, kept) -> None:
        for cache, n in zip(self.caches, self.context):
            cache.set_length(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--level", default="verify", choices=["verify", "draft"],
                   help="the batched verify forward, or a drafting level of the batch (module docstring)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16], help="tokens a row (1: plain decoding)")
    p.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on", "auto", "fixed"])
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="write the figures as JSON here (after every row count)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "shape": args.shape, "level": args.level, "dtype": args.dtype,
               "context": args.context,
               "repeats": args.repeats, "timing": "one verify forward, device synchronised around it; settings "
                                                  "alternated", "rows": [], "runners": {}}
    reserve = args.context + max(args.tokens) + 1
    with torch.inference_mode():
        for i, rows in enumerate(args.rows):
            prompts = [torch.randint(1, vocab, (args.context,), generator=gen).tolist() for _ in range(rows)]
            batches = {s: admitted(verifier_for(model, s), prompts, reserve) if args.level == "verify"
                       else DraftLevel(model, s, prompts) for s in args.graphs}
            for j, tokens in enumerate(args.tokens):
                drafts = [Draft.chain(torch.randint(1, vocab, (tokens - 1,), generator=gen)) for _ in range(rows)]
                pendings = [int(prompt[-1]) for prompt in prompts]
                order = args.graphs[(i + j) % len(args.graphs):] + args.graphs[:(i + j) % len(args.graphs)]
                ms = {s: [1e3 * x for x in time_forward(batches[s], pendings, drafts, args.repeats, device)]
                      for s in order}
                row = {"rows": rows, "tokens": tokens, "order": order,
                       **{s: {"median": statistics.median(v), "min": min(v), "max": max(v)} for s, v in ms.items()}}
                if "off" in ms:
                    for s in ms.keys() - {"off"}:
                        row[f"{s}_over_off"] = round(row[s]["median"] / row["off"]["median"], 3)
                results["rows"].append(row)
                log(f"{rows} rows x {tokens} tokens: " + ", ".join(f"{s} {row[s]['median']:.2f} ms" for s in order))
            results["runners"][rows] = {s: bv.runner.describe() for s, bv in batches.items() if bv.runner is not None}
            del batches
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
