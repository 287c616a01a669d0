"""What SD² steering costs per decoding step, against the step itself (issue 5: under 3%).

Steering adds two things to a step of a steered drafter: one steering-module forward (guide -> per-layer
biases) and, in every drafter forward of the step, the injection hooks (one add per steered layer). This
script decodes Spec-Bench first turns with the steered drafter and measures

- the module forward, timed inside the real decoding (``steering.forward`` wrapped with a timer);
- the drafter forwards per step (``_forward`` calls counted);
- the hooks: the same one-token drafter forward over the same KV cache, with the injection on and off,
  alternated ``--repeats`` times; the difference of the medians is the hook cost per forward;

and reports ``(module time + forwards per step x hook cost) / mean step time``, the step time being the
decoding wall time after the prefill divided by the steps, all in one process.

    python benchmarks/steering_overhead.py --checkpoint checkpoints/steering/qwen0.5b_for_1.5b/steering.safetensors
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
from transformers import DynamicCache

from metasd import Engine, Verifier
from metasd.data import SPEC_BENCH_DEFAULT, load_questions
from metasd.drafters import SteeredDrafter
from metasd.drafters.steered import load_steering
from metasd.core.execution.kv_cache import cache_kwargs, crop_to
from metasd.models import load_model


def hook_cost(drafter: SteeredDrafter, prompt: list[int], delta: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of a one-token drafter forward over a ``len(prompt)`` cache, hooks off and on."""
    model = drafter.model
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt[:-1]]), **cache_kwargs(model, cache), use_cache=True)
        last = torch.tensor([prompt[-1:]])
        times = {"off": [], "on": []}
        for i in range(2 * repeats + 2):
            mode = "on" if i % 2 else "off"
            if mode == "on":
                drafter.steering.injector.set(delta)
            t = time.perf_counter()
            model(input_ids=last, **cache_kwargs(model, cache), use_cache=True)
            dt = time.perf_counter() - t
            drafter.steering.injector.clear()
            crop_to(cache, len(prompt) - 1)
            if i >= 2:  # the first pair warms up
                times[mode].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="steering.safetensors of a trained SD² module")
    p.add_argument("--questions", default=str(SPEC_BENCH_DEFAULT))
    p.add_argument("--per-group", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--verifier", default="bundled:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="bundled:qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=100, help="hook on/off forward pairs")
    p.add_argument("--out", default="benchmarks/results/steering_overhead.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    vm, vt = load_model(args.verifier, dtype=args.dtype)
    dm, dt = load_model(args.drafter, dtype=args.dtype)
    module, drafter_params, _ = load_steering(args.checkpoint)
    if module is None or drafter_params:
        raise SystemExit(f"{args.checkpoint}: expected a steering module over the unchanged drafter")
    drafter = SteeredDrafter(dm, dt, module, k=args.k, name="sd2", checkpoint=args.checkpoint)
    engine = Engine(Verifier(vm, vt, name=args.verifier), drafter)

    module_s, forwards = [], [0]
    inner_forward, inner_step = module.forward, drafter._forward

    def timed_forward(h):
        t = time.perf_counter()
        out = inner_forward(h)
        module_s.append(time.perf_counter() - t)
        return out

    def counted(ids):
        forwards[0] += 1
        return inner_step(ids)

    module.forward, drafter._forward = timed_forward, counted
    questions = load_questions(args.questions, per_group=args.per_group)
    engine.generate(engine.encode([{"role": "user", "content": "Say hi."}]), max_new_tokens=8)  # warm-up
    module_s.clear()
    forwards[0] = 0
    steps = decode_s = 0.0
    prompt = None
    for q in questions:
        ids = engine.encode([{"role": "user", "content": q.turns[0]}])
        r = engine.generate(ids, max_new_tokens=args.max_new_tokens)
        steps += r.stats.steps
        decode_s += r.stats.wall_s - r.stats.prefill_s
        prompt = prompt or ids + r.token_ids
    module.forward, drafter._forward = inner_forward, inner_step

    with torch.inference_mode():
        delta = module(torch.randn(len(module.spec.guide_layers) * module.spec.d_verifier))
    hooks = hook_cost(drafter, prompt, delta, args.repeats)
    step_s = decode_s / steps
    per_step = {
        "module_s": sum(module_s) / steps,
        "forwards": forwards[0] / steps,
        "hook_s_per_forward": hooks["on"] - hooks["off"],
    }
    per_step["steering_s"] = per_step["module_s"] + per_step["forwards"] * max(per_step["hook_s_per_forward"], 0.0)
    result = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "args": vars(args), "prompts": len(questions), "steps": steps, "step_s": step_s,
        "one_token_forward_s": hooks, "per_step": per_step, "overhead_fraction": per_step["steering_s"] / step_s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(questions)} prompts, {int(steps)} steps, mean step {step_s * 1e3:.1f} ms; per step: module "
          f"{per_step['module_s'] * 1e3:.2f} ms, {per_step['forwards']:.2f} drafter forwards x hooks "
          f"{per_step['hook_s_per_forward'] * 1e3:.3f} ms (one-token forward {hooks['off'] * 1e3:.1f} ms off, "
          f"{hooks['on'] * 1e3:.1f} ms on) = {per_step['steering_s'] * 1e3:.2f} ms = "
          f"{result['overhead_fraction']:.2%} of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
