"""What structured output costs speculative decoding: the speedup of the default pool over plain decoding with a JSON
schema, against the same speedup without one, on the same prompts.

Four methods per prompt - plain and speculative (the embedded default pool), each unconstrained and constrained by the
prompt's JSON schema - in an order rotated per prompt and repeat, greedy, ``--max-new-tokens`` each. Plain decoding is
metasd's engine with no drafter (constrained plain decoding is that engine with the grammar mask: transformers has no
grammar-constrained ``generate`` to compare with). Per repeat: R_u = tokens/s(speculative) / tokens/s(plain) without
the schema and R_c the same with it, each a geometric mean over the prompts; the figure is the median over repeats of
R_c / R_u, with its range (the target of issue "Serve like the tools users already run": >= 0.8). A fifth method,
``speculative+schema/unmasked``, is the constrained speculative run with the drafters' own grammar masks off
(``Engine.mask_drafts = False``; the verifier is masked as always, so the output is the same): R_m = tokens/s(masked)
/ tokens/s(unmasked), what masking the drafts buys. The last prompt is a tool call (a named ``get_weather``): its
"schema" is the grammar of the model's own call format (Hermes, ``metasd.serve.tools``), the tool shown to the model
through its chat template.

    python benchmarks/structured.py --out benchmarks/results/structured.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"}, "genres": {"type": "array",
                                                                                "items": {"type": "string"}}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}
FUNCTION = {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {
    "type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                               "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["name", "arguments", "returns", "summary"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}, "skills": {"type": "array",
                                                                                  "items": {"type": "string"}}},
          "required": ["name", "age", "email", "skills"], "additionalProperties": False}
PROMPTS = [
    ("Describe the novel 'Dune' as a JSON object with title, author, year and genres.", BOOK),
    ("Describe this Python function as JSON (name, arguments with types, returns, summary):\n\n"
     "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    i = j = 0\n"
     "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
     "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]", FUNCTION),
    ("Return a JSON record for a fictional software engineer: name, age, email and a list of skills.", PERSON),
    ("Give the book 'The Pragmatic Programmer' as JSON: title, author, year, genres.", BOOK),
    ("What is the weather in Paris right now?", {"tool": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
            "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}),
]
METHODS = ("plain", "speculative", "plain+schema", "speculative+schema", "speculative+schema/unmasked")


def run_one(engines: dict, method: str, prompt: str, schema: dict, max_new_tokens: int) -> dict:
    from metasd.core.constraints import Constraint

    from metasd.serve.tools import HermesParser, added_tokens

    engine = engines["speculative" if method.startswith("speculative") else "plain"]
    tool = schema.get("tool")
    constrained = "+schema" in method
    messages = [{"role": "user", "content": prompt}]
    ids = engine.encode(messages, tools=[{"type": "function", "function": tool}] if tool else None)
    constraint = None
    if constrained:
        constraint = Constraint.grammar_of(HermesParser().grammar([tool], False, added_tokens(engine.tokenizer))) \
            if tool else Constraint.json_schema(schema)
    engine.mask_drafts = not method.endswith("/unmasked")
    t0 = time.perf_counter()
    r = engine.generate(ids, max_new_tokens, constraint=constraint)
    seconds = time.perf_counter() - t0
    engine.mask_drafts = True
    return {"method": method, "tokens": len(r.token_ids), "seconds": seconds,
            "tokens_per_s": len(r.token_ids) / seconds, "tokens_per_step": r.stats.mean_tokens_per_step,
            "stop_reason": r.stats.stop_reason, "text": r.text, "token_ids": r.token_ids}


def summarize(rows: list[dict], repeats: int) -> dict:
    """Per repeat R_u, R_c and R_c / R_u (geometric means over prompts); medians and ranges over repeats."""
    per = []
    for rep in range(repeats):
        mine = [r for r in rows if r["repeat"] == rep]
        if len({r["prompt"] for r in mine}) * len(METHODS) != len(mine) or not mine:
            continue
        tps = {(r["prompt"], r["method"]): r["tokens_per_s"] for r in mine}
        prompts = sorted({r["prompt"] for r in mine})
        def ratio(a: str, b: str) -> float:  # geometric mean over the prompts of a's tokens/s over b's
            return statistics.geometric_mean([tps[p, a] / tps[p, b] for p in prompts])
        ru, rc = ratio("speculative", "plain"), ratio("speculative+schema", "plain+schema")
        rm = ratio("speculative+schema", "speculative+schema/unmasked")
        per.append({"repeat": rep, "R_u": ru, "R_c": rc, "ratio": rc / ru, "R_m": rm,
                    "R_m_per_prompt": {p: tps[p, "speculative+schema"] / tps[p, "speculative+schema/unmasked"]
                                       for p in prompts}})
    if not per:
        return {}
    out = {"per_repeat": per}
    for key in ("R_u", "R_c", "ratio", "R_m"):
        vals = [p[key] for p in per]
        out[key] = {"median": statistics.median(vals), "range": [min(vals), max(vals)]}
    same = [r for r in rows if r["method"].startswith("speculative")]
    plain = {(r["repeat"], r["prompt"], r["method"]): r["token_ids"] for r in rows if r["method"].startswith("plain")}

    def twin(r):
        return r["repeat"], r["prompt"], r["method"].replace("speculative", "plain").removesuffix("/unmasked")
    out["identical_to_plain"] = sum(plain.get(twin(r)) == r["token_ids"] for r in same)
    out["compared"] = len(same)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", help="write the rows and the summary here (JSON), after every prompt")
    args = p.parse_args(argv)

    import torch

    import metasd
    from metasd.core.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    speculative = metasd.load_pool(args.pool) if args.pool else metasd.load_pool()
    engines = {"speculative": speculative, "plain": Engine(speculative.verifier, None)}
    report = {"command": " ".join(["python benchmarks/structured.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "rows": [],
              "complete": False}
    prompts = PROMPTS[: args.prompts]
    for rep in range(args.repeats):
        for i, (prompt, schema) in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(METHODS)
            for method in METHODS[shift:] + METHODS[:shift]:
                row = run_one(engines, method, prompt, schema, args.max_new_tokens)
                report["rows"].append({"repeat": rep, "prompt": i, **row})
                print(f"repeat {rep + 1} prompt {i + 1} {method:>28}: {row['tokens_per_s']:.2f} tok/s, "
                      f"{row['tokens_per_step']:.2f} tokens/step, {row['stop_reason']}", flush=True)
            report["summary"] = summarize(report["rows"], args.repeats)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    report["complete"] = True
    report["summary"] = summarize(report["rows"], args.repeats)
    print(json.dumps({k: v for k, v in report["summary"].items() if k != "per_repeat"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
