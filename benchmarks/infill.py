"""Fill in the middle: the speed of speculative decoding on code infilling (a completion with ``suffix``), against
transformers' plain and prompt-lookup decoding with the LM-head fix on the same prompts and end tokens.

The cases are cut from this repository's own Python source (``metasd/``, files taken at an even stride, so the model
cannot have seen them in training): in each file, one statement of a function body is removed - of one, two, then
three lines, by turns - the middle one of that size in the file; the prompt is the verifier's fill-in-the-middle
format (``Engine.encode_infill``) of up to ``--before`` lines before the gap and ``--after`` lines after it, and every
method stops at the format's end tokens or ``--max-new-tokens``. Methods, in an order rotated per case and repeat:
``plain`` (transformers +fix, the reference), ``prompt lookup`` (transformers +fix), ``metasd suffix`` (suffix
decoding alone) and ``metasd default`` (the embedded default pool). Greedy; every method's tokens are compared with
plain's (bf16 ties may differ).

Per repeat and method: tokens/s = the sum of tokens over the sum of seconds (prefill included, as a user waits for
it) over the cases, over plain's in the same repeat; the figures are medians over repeats with their ranges. Also
reported: how many middles equal the removed lines (whitespace at the ends aside) - the model's infilling, the same
for every method.

    python benchmarks/infill.py --cases 8 --repeats 3 --out benchmarks/results/infill.json
"""
from __future__ import annotations

import argparse
import ast
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = ("plain", "prompt lookup", "metasd suffix", "metasd default")


@dataclass(frozen=True)
class Case:
    """One infilling task: where it was cut from, the text before and after the gap, and the removed lines."""

    source: str
    line: int
    before: str
    after: str
    middle: str


def _statements(source: str) -> list[tuple[int, int]]:
    """The (first, last) lines (1-based) of the simple statements inside function bodies - not compound ones (``if``,
    ``for``, ...), not docstrings or other bare strings."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if node is fn or not isinstance(node, ast.stmt) or hasattr(node, "body"):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                 str):
                continue
            out.append((node.lineno, node.end_lineno))
    return sorted(set(out))


def cut_cases(root: Path, count: int, gaps: tuple[int, ...] = (1, 2, 3), before: int = 30,
              after: int = 15) -> list[Case]:
    """``count`` cases from the Python files under ``root`` (sorted, taken at an even stride): in each, the middle
    one of the function-body statements that span ``gaps[i % len(gaps)]`` lines is the gap."""
    files = sorted(p for p in root.rglob("*.py") if p.name != "__init__.py")
    if not files:
        raise ValueError(f"no Python files under {root}")
    stride = max(len(files) // count, 1)
    cases = []
    for path in files[::stride] + [f for i, f in enumerate(files) if i % stride]:  # the stride first, then the rest
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        gap = gaps[len(cases) % len(gaps)]
        spans = [(a, b) for a, b in _statements(text) if b - a + 1 == gap]
        if not spans:
            continue
        first, last = spans[len(spans) // 2]
        at, end = first - 1, last
        cases.append(Case(str(path.relative_to(root.parent)), first, "".join(lines[max(at - before, 0):at]),
                          "".join(lines[end:end + after]), "".join(lines[at:end])))
        if len(cases) == count:
            break
    return cases


def summarize(rows: list[dict]) -> dict:
    """Per method: per repeat sum(tokens)/sum(seconds) over the cases over plain's; medians and ranges over the
    complete repeats; how many runs gave plain's tokens."""
    out = {}
    per_repeat: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in sorted({r["repeat"] for r in rows}):
        mine = {(r["case"], r["method"]): r for r in rows if r["repeat"] == rep}
        cases = sorted({c for c, _ in mine})
        if any((c, m) not in mine for c in cases for m in METHODS):
            continue  # an incomplete repeat (a run still going)

        def rate(m: str) -> float:
            return sum(mine[c, m]["tokens"] for c in cases) / sum(mine[c, m]["seconds"] for c in cases)
        for m in METHODS:
            per_repeat[m].append(rate(m) / rate("plain"))
    plain_ids = {(r["repeat"], r["case"]): r["token_ids"] for r in rows if r["method"] == "plain"}
    for m in METHODS:
        vals = per_repeat[m]
        if not vals:
            continue
        runs = [r for r in rows if r["method"] == m and (r["repeat"], r["case"]) in plain_ids]
        same = sum(r["token_ids"] == plain_ids[r["repeat"], r["case"]] for r in runs)
        out[m] = {"vs plain": {"median": statistics.median(vals), "range": [min(vals), max(vals)]},
                  "per_repeat": vals, "identical to plain": f"{same}/{len(runs)}"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool)")
    p.add_argument("--source", default=str(REPO / "metasd"), help="the Python files the cases are cut from")
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--before", type=int, default=30, help="lines of code before the gap")
    p.add_argument("--after", type=int, default=15, help="lines of code after the gap")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", help="write the rows and the summary here (JSON), after every case")
    args = p.parse_args(argv)

    import torch

    import metasd
    from metasd.bench import baselines
    from metasd.core.engine import Engine
    from metasd.core.execution.hooks import contiguous_lm_head_input
    from metasd.drafters import SuffixDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    cases = cut_cases(Path(args.source), args.cases, before=args.before, after=args.after)
    pool = metasd.load_pool(args.pool) if args.pool else metasd.load_pool()
    model = contiguous_lm_head_input(pool.verifier.model)
    suffix = Engine(pool.verifier, SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"))
    prompts = [pool.encode_infill(c.before, c.after) for c in cases]
    # plain decoding untimed, with its top-two logit margin at each position: where a method's tokens first
    # differ from these, the margin says whether it was a bf16 tie
    reference = [baselines.plain_with_margins(model, pr.ids, args.max_new_tokens, eos_token_id=pr.stop_token_ids)
                 for pr in prompts]  # (ids, seconds, margins)

    def run(method: str, prompt) -> tuple[list[int], float, float | None]:
        n, stops = args.max_new_tokens, prompt.stop_token_ids
        if method == "plain":
            ids, seconds = baselines.plain(model, prompt.ids, n, eos_token_id=stops)
            return ids, seconds, None
        if method == "prompt lookup":
            ids, seconds = baselines.prompt_lookup(model, prompt.ids, n, eos_token_id=stops)
            return ids, seconds, None
        engine = suffix if method == "metasd suffix" else pool
        t0 = time.perf_counter()
        result = engine.generate(prompt.ids, n, stop_token_ids=stops)
        return result.token_ids, time.perf_counter() - t0, result.stats.mean_tokens_per_step

    report = {"command": " ".join(["python benchmarks/infill.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "cases": [{**asdict(c), "prompt_tokens": len(p.ids)} for c, p in zip(cases, prompts)],
              "rows": [], "complete": False}
    step = 0
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            shift, step = step % len(METHODS), step + 1
            for method in METHODS[shift:] + METHODS[:shift]:
                ids, seconds, per_step = run(method, prompt)
                text = pool.tokenizer.decode([t for t in ids if t not in prompt.stop_token_ids])
                ref_ids, _, margins = reference[i]
                at = baselines.first_divergence(ids, ref_ids)
                row = {"repeat": rep, "case": i, "method": method, "tokens": len(ids), "seconds": seconds,
                       "first_divergence": at, "plain_margin_there": margins[at] if at is not None else None,
                       "tokens_per_s": len(ids) / seconds, "tokens_per_step": per_step, "token_ids": ids,
                       "text": text, "matches_removed_lines": text.strip() == cases[i].middle.strip()}
                report["rows"].append(row)
                print(f"repeat {rep + 1} case {i + 1} ({cases[i].source}:{cases[i].line}) {method:>14}: "
                      f"{row['tokens_per_s']:.2f} tok/s, {len(ids)} tokens", flush=True)
            report["summary"] = summarize(report["rows"])
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    report["complete"] = True
    report["summary"] = summarize(report["rows"])
    plain_rows = [r for r in report["rows"] if r["method"] == "plain" and r["repeat"] == 0]
    report["middles matching the removed lines"] = f"{sum(r['matches_removed_lines'] for r in plain_rows)}/" \
                                                   f"{len(plain_rows)}"
    print(json.dumps({m: {k: v for k, v in s.items() if k != "per_repeat"} for m, s in report["summary"].items()},
                     indent=1))
    print("middles matching the removed lines:", report["middles matching the removed lines"])
    report["divergences"] = [{"case": r["case"], "repeat": r["repeat"], "method": r["method"],
                              "at": r["first_divergence"], "plain_margin": r["plain_margin_there"]}
                             for r in report["rows"] if r["first_divergence"] is not None]
    print("first differences from plain (case, method, position, plain's top-2 margin):",
          [(d["case"], d["method"], d["at"], d["plain_margin"]) for d in report["divergences"]])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
