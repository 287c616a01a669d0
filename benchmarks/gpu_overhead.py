"""The engine's own overhead, measured with a drafter whose acceptance is known: metasd's speed over transformers'
plain decoding at a fixed number of tokens per step, on random-weight models of real shapes (no weights to copy).

The replay drafter (``type: replay``) drafts the verifier's own greedy continuation, right for ``accept`` tokens and
wrong for one more, so every greedy step commits ``accept + 1`` tokens and drafting costs nothing: what a step costs
beyond the verifier's forward is the engine's (draft bookkeeping, mask and position building, acceptance, cache
commit, reward and policy). For each shape and tokens/step it reports, per step: total ms, the verifier forward's ms
(timed by hooks that synchronize the device), the engine's share of the step, host reads (device -> host transfers,
counted by a ``TorchFunctionMode``; 0 on a CPU-only run, where nothing is on a device), and the speedup over
transformers' ``generate`` of the same model, dtype and tokens, measured in the same process. ``accept 0`` with no
drafter is plain decoding through metasd's engine (its overhead against transformers' loop).

    python benchmarks/gpu_overhead.py --shapes 1.5b 8b --taus 2 3 4 6 --new-tokens 128 --out $OUT/gpu_overhead.json

CUDA graphs are not built (see BENCHMARKS.md): every run here is eager.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from metasd import Engine, Verifier
from metasd.core.clock import synchronize
from metasd.drafters.replay import ReplayDrafter

#: the shapes of the bundled verifier (Qwen2.5-Coder-1.5B), the bundled drafter (0.5B) and an 8B-class verifier
#: (Qwen2.5-7B), as their config.json files give them; ``tiny`` for a quick check of the script
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}


class HostReads(TorchFunctionMode):
    """Counts reads of device (non-CPU) tensors by the host: item, tolist, cpu / to("cpu"), bool, int, float."""

    NAMES = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            to_cpu = name == "to" and any(str(a).startswith("cpu") for a in list(args[1:]) + list(kwargs.values()))
            if name in self.NAMES or to_cpu:
                self.count += 1
        return func(*args, **kwargs)


def build(shape: str, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6, bos_token_id=0, eos_token_id=None)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


class ForwardTimer:
    """Seconds the verifier spends in its forwards (hooks that synchronize the device around each)."""

    def __init__(self, model, device):
        self.device, self.total, self._t0 = device, 0.0, 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_):
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def _post(self, *_):
        synchronize(self.device)
        self.total += time.perf_counter() - self._t0


def plain_seconds(model, prompt: torch.Tensor, n: int, device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - t0


def measure(shape: str, taus: list[int], n: int, prompt_len: int, repeats: int, device, dtype) -> dict:
    model = build(shape, device, dtype)
    prompt = torch.randint(1, SHAPES[shape]["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    ids = prompt[0].tolist()
    reference = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n + 8,
                               do_sample=False, pad_token_id=0)[0, prompt_len:].tolist()
    verifier = Verifier(model)
    timer = ForwardTimer(model, device)
    rows = []
    for tau in [1] + taus:
        drafter = None
        if tau > 1:
            drafter = ReplayDrafter(model, accept=tau - 1, wrong=1)
            drafter.record(ids, reference)
        engine = Engine(verifier, drafter)
        engine.generate(ids, max_new_tokens=8)  # warm-up
        plain, ours, fwd, reads, steps, overhead = [], [], [], [], [], []
        for _ in range(repeats):
            plain.append(plain_seconds(model, prompt, n, device))
            timer.total = 0.0
            counter = HostReads()
            with counter:
                result = engine.generate(ids, max_new_tokens=n)
            s = result.stats
            ours.append(s.wall_s - s.prefill_s)
            fwd.append(timer.total)
            reads.append(counter.count / s.steps)
            steps.append(s.steps)
            overhead.append(s.overhead_s)
            if tau > 1 and set(s.tokens_per_step[:-1]) != {tau}:
                print(f"  note: tokens/step {sorted(set(s.tokens_per_step))}, not {tau} (a bf16 tie left the recording)",
                      file=sys.stderr)
        step = statistics.median(ours) / statistics.median(steps)
        forward = statistics.median(fwd) / statistics.median(steps) - 0  # the prefill is not in ``ours``
        row = {"tokens_per_step": tau, "ms_per_step": 1e3 * step,
               "verifier_forward_ms_per_step": 1e3 * forward,
               "engine_share": max(step - forward, 0.0) / step if step else 0.0,
               "host_reads_per_step": statistics.median(reads),
               "speedup_over_transformers": statistics.median(plain) / statistics.median(ours),
               "metasd_tok_s": n / statistics.median(ours), "transformers_tok_s": n / statistics.median(plain)}
        rows.append(row)
        print(f"  {shape} tau={tau}: {row['ms_per_step']:.2f} ms/step, forward {row['verifier_forward_ms_per_step']:.2f} ms, "
              f"engine {row['engine_share']:.0%}, reads {row['host_reads_per_step']:.1f}/step, "
              f"{row['speedup_over_transformers']:.2f}x transformers", file=sys.stderr, flush=True)
    return {"shape": shape, "config": SHAPES[shape], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1.5b"], choices=sorted(SHAPES))
    p.add_argument("--taus", nargs="+", type=int, default=[2, 3, 4, 6], help="tokens per step to measure (>= 2)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "dtype": args.dtype, "graphs": False, "shapes": []}
    with torch.inference_mode():
        for shape in args.shapes:
            results["shapes"].append(measure(shape, args.taus, args.new_tokens, args.prompt_tokens, args.repeats,
                                             device, dtype))
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
