"""Prefix caching on a multi-turn chat: time to first token of each turn with the scheduler's prefix cache on and off.

A chat of ``--turns`` turns over a long first message (``--history-tokens`` tokens of metasd's own source text, then a
question); each later turn is the history, the model's last answer (greedy, ``--answer-tokens``) and the next
question, as a chat client sends it. Per repeat, both settings run the whole chat on a fresh scheduler over the same
engine, in an order rotated per repeat; the answers of the two settings must be the same text (checked and reported).
The figure per turn is the median over repeats of the paired ratio TTFT(on) / TTFT(off), with its range; TTFT is the
scheduler's own (submit to first committed token, in-process: no HTTP).

    python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache.json          # the embedded serving pool
    python benchmarks/prefix_cache.py --pool my_pool.yaml --repeats 3 --threads 2

The scheduler is the one ``metasd serve`` makes for the pool (``SchedulerSettings``: the pool's adaptive speculation
included, its forward profile measured once before the first chat), with one request at a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

QUESTIONS = ["What does this module do? Answer in two sentences.",
             "Which function would you change to add a new option, and why?",
             "Write a one-line docstring for the first class.",
             "Name one thing a test of this module should check."]


def history_text(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of metasd's own source (the scheduler module, repeated if short), cut at a line."""
    import metasd.core.batching.scheduler as source

    text = Path(source.__file__).read_text()
    while len(tokenizer.encode(text)) < tokens:
        text += "\n" + text
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids).rsplit("\n", 1)[0]


def run_chat(scheduler, history: str, turns: int, answer_tokens: int) -> list[dict]:
    """One chat on a fresh scheduler (shut down at the end): per turn its TTFT (s), prompt tokens, cached tokens and
    answer."""
    from metasd.core.batching.scheduler import RequestFinished

    finished: dict[str, RequestFinished] = {}
    messages = [{"role": "user", "content": f"Here is a Python module:\n\n{history}\n\n{QUESTIONS[0]}"}]
    rows = []
    with scheduler:
        scheduler.add_listener(lambda r: finished.__setitem__(r.id, r) if isinstance(r, RequestFinished) else None)
        for turn in range(turns):
            handle = scheduler.submit(messages, answer_tokens, chat=True)
            result = handle.result(timeout=3600)
            while handle.id not in finished:  # the listener runs on the scheduler thread, after the last event
                time.sleep(0.001)
            rows.append({"turn": turn + 1, "ttft_s": finished[handle.id].ttft_s, "prompt_tokens": len(result.prompt_ids),
                         "cached_tokens": result.stats.cached_prompt_tokens, "text": result.text})
            messages = messages + [{"role": "assistant", "content": result.text},
                                   {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    return rows


def summarize(runs: list[dict], turns: int) -> list[dict]:
    """Per turn: TTFT on and off (median and range over repeats) and the paired ratio on/off."""
    out = []
    for t in range(turns):
        on = [r["on"][t]["ttft_s"] for r in runs]
        off = [r["off"][t]["ttft_s"] for r in runs]
        ratios = [a / b for a, b in zip(on, off)]
        out.append({"turn": t + 1, "ttft_on_s": statistics.median(on), "ttft_off_s": statistics.median(off),
                    "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                    "cached_tokens": [r["on"][t]["cached_tokens"] for r in runs],
                    "prompt_tokens": runs[0]["on"][t]["prompt_tokens"],
                    "same_text": all(r["on"][t]["text"] == r["off"][t]["text"] for r in runs)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool config YAML (default: the embedded serving pool)")
    p.add_argument("--history-tokens", type=int, default=1000)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", help="write the runs and the summary here (JSON), after every repeat")
    args = p.parse_args(argv)

    from metasd.serve.cli import PoolEngine, SchedulerSettings

    recipe = PoolEngine.from_file(args.pool, args.threads)
    config = recipe.parse()
    engine = recipe()
    settings = SchedulerSettings(max_batch=1, adaptive=config.serving.model_dump() if config.serving.adaptive else None)
    if settings.adaptive:  # profile the verifier once, not per scheduler (as `metasd serve --cost-profile` reuses one)
        from metasd.core.pricing.forward_profile import profile_forward

        opts = settings.adaptive["profile"]
        counts = {"token_counts": opts["token_counts"]} if opts.get("token_counts") else {}
        profile = profile_forward(engine.verifier.model, **counts, max_seconds=opts["max_seconds"])
        settings = dataclasses.replace(settings, cost_profile=profile.to_dict())
    history = history_text(engine.tokenizer, args.history_tokens)
    report = {"command": " ".join(["python benchmarks/prefix_cache.py", *(argv or sys.argv[1:])]),
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "pool": recipe.source,
              "turns": args.turns, "answer_tokens": args.answer_tokens, "history_tokens": args.history_tokens,
              "runs": [], "complete": False}
    for repeat in range(args.repeats):
        order = [True, False] if repeat % 2 == 0 else [False, True]
        run = {}
        for setting in order:
            scheduler = dataclasses.replace(settings, prefix_caching=setting).make(engine)
            run["on" if setting else "off"] = run_chat(scheduler, history, args.turns, args.answer_tokens)
        report["runs"].append(run)
        report["summary"] = summarize(report["runs"], args.turns)
        report["complete"] = repeat == args.repeats - 1
        for row in report["summary"]:
            print(f"repeat {repeat + 1} turn {row['turn']}: TTFT on {row['ttft_on_s']:.3f} s, off "
                  f"{row['ttft_off_s']:.3f} s, on/off {row['ratio_median']:.3f} [{row['ratio_range'][0]:.3f}, "
                  f"{row['ratio_range'][1]:.3f}], cached {row['cached_tokens']} of {row['prompt_tokens']}, "
                  f"same text {row['same_text']}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
