"""Prefix caching on a multi-turn chat: time to first token and the whole turn's time with the scheduler's prefix cache
off, on for the verifier alone, and on for the verifier and the model drafters (the default: ``PrefixEntry.drafters``).

A chat of ``--turns`` turns over a long first message (``--history-tokens`` tokens of metasd's own source text, then a
question); each later turn is the history, the model's last answer (greedy, ``--answer-tokens``) and the next
question, as a chat client sends it. Per repeat, every setting runs the whole chat on a fresh scheduler over the same
engine, in an order rotated per repeat; the answers of the settings must be the same text (checked and reported).
The figures per turn are medians over repeats of paired ratios, with their ranges: TTFT(on) / TTFT(off), and the
turn's end-to-end time with the drafters' positions kept over the verifier's alone; both are the scheduler's own
(from submit, in-process: no HTTP).

    python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache.json          # the embedded serving pool
    python benchmarks/prefix_cache.py --pool my_pool.yaml --repeats 3 --threads 2 --answer-tokens 64
    python benchmarks/prefix_cache.py --threads 2 --margins-of benchmarks/results/prefix_cache.json   # near-ties?

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


def first_message(history: str) -> list[dict]:
    """The chat's first turn: the module's source and the first question."""
    return [{"role": "user", "content": f"Here is a Python module:\n\n{history}\n\n{QUESTIONS[0]}"}]


#: the settings compared: prefix caching off, on for the verifier alone, on for the verifier and the model drafters
SETTINGS = {"off": (False, False), "verifier": (True, False), "both": (True, True)}


def run_chat(scheduler, history: str, turns: int, answer_tokens: int) -> list[dict]:
    """One chat on a fresh scheduler (shut down at the end): per turn its TTFT and end-to-end time (s), prompt tokens,
    cached tokens, the drafter positions it started with, its steps and answer."""
    from metasd.core.batching.scheduler import RequestFinished

    finished: dict[str, RequestFinished] = {}
    messages = first_message(history)
    rows = []
    with scheduler:
        scheduler.add_listener(lambda r: finished.__setitem__(r.id, r) if isinstance(r, RequestFinished) else None)
        for turn in range(turns):
            drafter_hits = scheduler.prefix_cache.stats.drafter_hits if scheduler.prefix_cache is not None else 0
            handle = scheduler.submit(messages, answer_tokens, chat=True)
            result = handle.result(timeout=3600)
            while handle.id not in finished:  # the listener runs on the scheduler thread, after the last event
                time.sleep(0.001)
            done = finished[handle.id]
            resumed = scheduler.prefix_cache.stats.drafter_hits - drafter_hits if scheduler.prefix_cache else 0
            rows.append({"turn": turn + 1, "ttft_s": done.ttft_s, "e2e_s": done.e2e_s,
                         "prompt_tokens": len(result.prompt_ids), "cached_tokens": result.stats.cached_prompt_tokens,
                         "drafter_positions_resumed": resumed, "new_tokens": result.stats.new_tokens,
                         "steps": result.stats.steps, "draft_s": result.stats.draft_s, "text": result.text,
                         "token_ids": list(result.token_ids)})
            messages = messages + [{"role": "assistant", "content": result.text},
                                   {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    return rows


def _paired(runs: list[dict], t: int, key: str, a: str, b: str) -> tuple[float, list[float]]:
    """Median and [min, max] over repeats of turn ``t``'s ``key`` under setting ``a`` over setting ``b``."""
    ratios = [r[a][t][key] / r[b][t][key] for r in runs]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def summarize(runs: list[dict], turns: int) -> list[dict]:
    """Per turn: medians over repeats of each setting's TTFT and end-to-end time, the paired ratios TTFT both/off and
    end-to-end both/verifier, what was reused, and whether every setting gave the same answer."""
    out = []
    for t in range(turns):
        row = {"turn": t + 1, "prompt_tokens": runs[0]["off"][t]["prompt_tokens"]}
        for name in SETTINGS:
            for key in ("ttft_s", "e2e_s"):
                row[f"{key}_{name}"] = statistics.median(r[name][t][key] for r in runs)
        row["ttft_both_over_off"], row["ttft_both_over_off_range"] = _paired(runs, t, "ttft_s", "both", "off")
        row["e2e_both_over_verifier"], row["e2e_both_over_verifier_range"] = _paired(runs, t, "e2e_s", "both",
                                                                                     "verifier")
        row["cached_tokens"] = [r["both"][t]["cached_tokens"] for r in runs]
        row["drafter_positions_resumed"] = [r["both"][t]["drafter_positions_resumed"] for r in runs]
        row["steps"] = {name: [r[name][t]["steps"] for r in runs] for name in SETTINGS}
        row["same_text"] = all(len({r[name][t]["text"] for name in SETTINGS}) == 1 for r in runs)
        out.append(row)
    return out


def chat_messages(history: str, run: dict, name: str, turn: int) -> list[dict]:
    """The messages of turn ``turn`` (0-based) of setting ``name``'s chat in ``run``: its own earlier answers."""
    messages = first_message(history)
    for k in range(turn):
        messages += [{"role": "assistant", "content": run[name][k]["text"]},
                     {"role": "user", "content": QUESTIONS[(k + 1) % len(QUESTIONS)]}]
    return messages


def divergence_margins(engine, history: str, runs: list[dict]) -> list[dict]:
    """Where two settings' answers to the same prompt differ: the first differing token and plain decoding's top-two
    logit margin there (the verifier's own forward over the prompt and the common prefix; a bf16 near-tie is a margin
    of a logit step or two)."""
    import torch

    out, tok = [], engine.tokenizer
    for i, run in enumerate(runs):
        names = list(run)
        for t in range(len(run[names[0]])):
            for a, b in ((x, y) for j, x in enumerate(names) for y in names[j + 1:]):
                messages = chat_messages(history, run, a, t)
                if run[a][t]["text"] == run[b][t]["text"] or messages != chat_messages(history, run, b, t):
                    continue  # the same answer, or different prompts (an earlier turn differed)
                ids_a, ids_b = (run[x][t].get("token_ids") or tok.encode(run[x][t]["text"], add_special_tokens=False)
                                for x in (a, b))
                d = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
                with torch.inference_mode():
                    logits = engine.verifier.model(torch.tensor([engine.encode(messages) + ids_a[:d]])).logits[0, -1]
                top = logits.float().topk(2)
                out.append({"repeat": i + 1, "turn": t + 1, "settings": [a, b], "token": d,
                            "tokens": [tok.decode(ids_a[d: d + 1]), tok.decode(ids_b[d: d + 1])],
                            "plain_top2": [tok.decode([x]) for x in top.indices.tolist()],
                            "margin": float(top.values[0] - top.values[1])})
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
    p.add_argument("--margins-of", metavar="JSON", help="no chat: read a report this script wrote, add where the "
                   "settings' answers differ and plain decoding's top-two logit margin there, and write it back")
    args = p.parse_args(argv)

    from metasd.serve.cli import PoolEngine, SchedulerSettings

    recipe = PoolEngine.from_file(args.pool, args.threads)
    config = recipe.parse()
    engine = recipe()
    if args.margins_of:
        saved = json.loads(Path(args.margins_of).read_text())
        saved["divergences"] = divergence_margins(engine, history_text(engine.tokenizer, saved["history_tokens"]),
                                                  saved["runs"])
        Path(args.margins_of).write_text(json.dumps(saved, indent=1))
        for d in saved["divergences"]:
            print(f"repeat {d['repeat']} turn {d['turn']} {d['settings']}: token {d['token']} {d['tokens']}, plain's "
                  f"top two {d['plain_top2']}, margin {d['margin']:.4f}")
        return 0
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
    names = list(SETTINGS)
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]  # rotated per repeat
        run = {}
        for name in order:
            caching, drafters = SETTINGS[name]
            scheduler = dataclasses.replace(settings, prefix_caching=caching).make(engine)
            if scheduler.prefix_cache is not None:
                scheduler.prefix_cache.drafters = drafters
            run[name] = run_chat(scheduler, history, args.turns, args.answer_tokens)
        report["runs"].append(run)
        report["summary"] = summarize(report["runs"], args.turns)
        report["complete"] = repeat == args.repeats - 1
        for row in report["summary"]:
            print(f"after repeat {repeat + 1}, turn {row['turn']}: TTFT off {row['ttft_s_off']:.2f} s, verifier "
                  f"{row['ttft_s_verifier']:.2f} s, both {row['ttft_s_both']:.2f} s (both/off "
                  f"{row['ttft_both_over_off']:.3f} {row['ttft_both_over_off_range']}); turn time off "
                  f"{row['e2e_s_off']:.2f} s, verifier {row['e2e_s_verifier']:.2f} s, both {row['e2e_s_both']:.2f} s "
                  f"(both/verifier {row['e2e_both_over_verifier']:.3f} {row['e2e_both_over_verifier_range']}); "
                  f"cached {row['cached_tokens']}, drafter positions {row['drafter_positions_resumed']} of "
                  f"{row['prompt_tokens']}; steps {row['steps']}; same text {row['same_text']}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
