"""Load benchmark of OpenAI-compatible servers: `metasd serve` (speculation on and off) against `transformers serve
--continuous-batching`, same verifier, at fixed concurrency levels.

Servers (``--servers``; each started by this script alone on the machine, health-checked, warmed up, loaded, killed):

- ``transformers``: ``transformers serve --continuous-batching --device cpu --dtype bfloat16`` with the bundled
  verifier's cache directory as the pinned model (offline: ``HF_HUB_OFFLINE=1``; clients send that path as ``model``),
  its paged KV cache sized to the load (``--cb-num-blocks``, otherwise it takes 60% of the machine's RAM on CPU)
  and its prefix cache off (every prompt repeats across levels and repeats, so its prefills would be cache hits
  that a server without one does not get; ``--transformers-prefix-cache`` keeps it, as shipped). A warm-up
  request (not a benchmark prompt) first: the first request initialises continuous batching (about 20 s on CPU)
  and fixes its sampling settings for every later request, so it uses the load's temperature.
- ``metasd-off``: ``metasd serve`` (its default pool), every request with ``extra_body={"metasd": {"speculate":
  false}}``.
- ``metasd``: ``metasd serve`` with its default pool, speculation on: the adaptive pool
  (``configs/pools/serve_adaptive.yaml``) since load run 5; load runs 1-3 served the default cascade
  (``configs/default.yaml``) - for it now: ``--extra-pool cascade=configs/default.yaml``.
- ``--extra-pool NAME=pool.yaml``: ``metasd serve --pool pool.yaml`` as server NAME.
- ``metasd-llama-cpp`` / ``metasd-llama-cpp-off``: ``metasd serve --backend llama.cpp`` (its default pool, the
  verifier's forwards in llama.cpp over the bf16 GGUF of the same weights), speculation on / off.
- ``llama-server`` / ``llama-server-draft``: llama.cpp's own server on that GGUF (``llama_server_command``), plain
  and with the bundled 0.5B bf16 GGUF as its draft model. Not in the default ``--servers``: they need llama.cpp's
  tools built (``metasd.bench.llama_cpp.build_tools``, ~11 min once) and the extra ``llama-cpp`` for metasd's rows.

Each server gets ``OMP_NUM_THREADS=MKL_NUM_THREADS=--threads`` (and metasd serve ``--threads``) and runs one at a
time; the client (this process, asyncio + the official ``openai`` AsyncOpenAI client, streaming) shares the machine
with it.

Load: the prompt set is the first turn of the Spec-Bench questions (``--per-group`` per group, as
benchmarks/speed.py; ``--groups`` keeps only the groups named) plus ``--copy-heavy N`` prompts per copy-heavy category, in one fixed shuffled order (seed 0,
the same for every server, level and repeat). At concurrency c a semaphore keeps exactly c requests in flight
(a request starts when one finishes) until the level's requests are sent: by default whole passes over the prompt
set, as many as make at least 2c requests (20 prompts: 20 requests at c <= 8, 40 at c = 16; ``--requests-per-c K``
sets that 2 to K), or exactly
``--requests N`` (prompts cycled). A level stops by itself after ``--level-timeout`` seconds (unfinished requests
are cancelled and the row is marked). Repeats are interleaved: repeat r runs every server at every level, the
server order rotated by r; every server process is started fresh for each repeat.

Per (server, concurrency, repeat) row:

- output tok/s: the completion tokens of all requests (``usage.completion_tokens``) / the level's wall time (first
  request sent to last stream closed); requests/s likewise.
- TTFT: request sent to the first chunk with text (the role-only chunk does not count). p50 and p99 over the
  level's requests (linear interpolation; with 20-40 requests p99 is close to the maximum).
- ITL, per token: a stream's chunks are grouped into deliveries (chunks that reach the client within 2 ms of the
  previous one: events of one network read), a delivery's tokens are its text tokenised alone by the verifier's
  tokenizer (the servers do not say how many tokens a chunk holds; a speculative server delivers several per
  step), and every token of every delivery but a stream's first (whose time is the TTFT) is one sample of
  (time since the previous delivery) / (tokens in the delivery). p50 and p99 over all tokens of the level. The per-delivery gap p50 is kept too.
- TPOT p50 (per request: (last text - first text) / (completion tokens - 1)), e2e latency p50 (sent to stream end).
- tokens/step: metasd's extension record (a ``metasd`` object in a chunk) when the server sends one.
- graphs (metasd servers): what the server's fixed-shape forwards did during the level, read from its ``/metrics``
  before and after (``graph_counters``): the shapes met so far, and the CUDA graphs captured and the seconds capturing
  took during the level (verify forward and drafting levels apart). On a GPU a shape is captured the first time it is
  met, inside the step that meets it, so a level's wall time includes those seconds; the warm-up's are kept apart
  (``warmup_graphs``). All zero where nothing is captured (a CPU, ``graphs: off``). Requests a level timeout
  cancelled may still finish a step in the next level, and their captures count there.

The table gives per (server, c) the median over repeats and [min-max] range; the ratios are per repeat (the two
servers measured in the same repeat), median [range], with "faster"/"slower" when the two servers' tok/s ranges do
not overlap and "within noise" when they do (one repeat: no verdict).

    python benchmarks/serve_load.py --per-group 2 --copy-heavy 4 --max-tokens 64 --concurrency 1 2 4 8 16 \\
        --repeats 3 --out benchmarks/results/serve_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path


SERVERS = ("transformers", "metasd-off", "metasd")
VERIFIER = "bundled:qwen2.5-coder-1.5b-instruct"
COALESCE_S = 0.002  # chunks closer than this to the previous one are one delivery (one network read)
SPECULATE_OFF = {"metasd": {"speculate": False}}


@dataclass
class _Prompt:
    question_id: str
    group: str
    turns: list


WARMUP = _Prompt("warmup", "warmup", ["Say hi."])  # not a benchmark prompt: no prefix cache entry for one


# --------------------------------------------------------------------------------------------- statistics
def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_range(values) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that are not None; None when there are none."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs)


def verdict(a, b) -> str:
    """Whether the values of a are "faster" (higher) or "slower" than those of b, by their [min, max] ranges:
    "within noise" when the ranges overlap, "one repeat" when either has fewer than two values."""
    a = [v for v in a if v is not None]
    b = [v for v in b if v is not None]
    if len(a) < 2 or len(b) < 2:
        return "one repeat"
    if min(a) > max(b):
        return "faster"
    if max(a) < min(b):
        return "slower"
    return "within noise"


def fmt_mr(mr, digits: int = 2, scale: float = 1.0, range_: bool = True) -> str:
    """'median [min-max]' (or the median alone) of a median_range triple; '-' for None."""
    if mr is None:
        return "-"
    m, lo, hi = (x * scale for x in mr)
    if not range_ or lo == hi:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def deliveries(chunks, gap_s: float = COALESCE_S) -> list[tuple[float, str]]:
    """(arrival time, text) per delivery: consecutive text chunks closer than gap_s to the previous chunk are
    merged (they came in one network read); the delivery keeps its first chunk's time."""
    out: list[list] = []
    last = None
    for t, text in chunks:
        if not text:
            continue
        if out and last is not None and t - last < gap_s:
            out[-1][1] += text
        else:
            out.append([t, text])
        last = t
    return [(t, text) for t, text in out]


def itl_samples(times, counts) -> list[float]:
    """Per-token inter-token latencies of one stream: for every delivery after the first, (its time - the
    previous delivery's time) / its token count, once per token (a delivery counted as at least one token)."""
    out = []
    for i in range(1, len(times)):
        n = max(1, counts[i])
        out += [(times[i] - times[i - 1]) / n] * n
    return out


def tokens_per_step(records) -> float | None:
    """Mean tokens per step of a level from metasd's per-request records: all the steps' new tokens (not the one
    each drew with its prefill) / all steps when the records count them, else the mean of their
    mean_tokens_per_step; None when no record has either."""
    recs = [r for r in records if r]
    steps = [r.get("steps") for r in recs]
    new = [r.get("new_tokens") - r.get("prefill_committed", 0) if isinstance(r.get("new_tokens"), (int, float))
           else None for r in recs]
    if recs and all(isinstance(s, (int, float)) for s in steps) and all(isinstance(n, (int, float)) for n in new) \
            and sum(steps) > 0:
        return sum(new) / sum(steps)
    tps = [r.get("mean_tokens_per_step") for r in recs if isinstance(r.get("mean_tokens_per_step"), (int, float))]
    return statistics.mean(tps) if tps else None


def summarise_level(requests: list[dict], wall_s: float, count_tokens) -> dict:
    """A level's figures from its request records (see run_level); count_tokens(text) -> tokens."""
    ok = [r for r in requests if r.get("ok")]
    ttft, e2e, tpot, itl, gaps, per_delivery = [], [], [], [], [], []
    tokens = 0
    for r in ok:
        d = deliveries(r["chunks"])
        counts = [count_tokens(text) for _, text in d]
        times = [t for t, _ in d]
        n = r.get("completion_tokens")
        if n is None:
            n = sum(counts)
        tokens += n
        r["deliveries"] = [[round(t, 5), c] for t, c in zip(times, counts)]
        if times:
            ttft.append(times[0])
            if n > 1 and len(times) > 1:
                tpot.append((times[-1] - times[0]) / (n - 1))
        e2e.append(r["e2e"])
        itl += itl_samples(times, counts)
        gaps += [b - a for a, b in zip(times, times[1:])]
        per_delivery += counts
    return {
        "requests_done": len(ok), "errors": sum(1 for r in requests if not r.get("ok")),
        "wall_s": wall_s, "completion_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else None,
        "requests_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        "delivery_gap_p50": percentile(gaps, 50), "tokens_per_delivery": statistics.mean(per_delivery) if per_delivery else None,
        "tpot_p50": percentile(tpot, 50), "e2e_p50": percentile(e2e, 50),
        "mean_tokens_per_step": tokens_per_step([r.get("metasd") for r in ok]),
    }


#: metasd's /metrics gauges of its fixed-shape forwards (metasd/serve/metrics.py): key -> metric name; the drafters'
#: are labelled per drafter and summed here
GRAPH_METRICS = {"verify_shapes": "metasd:verify_fixed_shapes", "verify_captured": "metasd:verify_graphs_captured",
                 "verify_capture_s": "metasd:verify_graph_capture_seconds",
                 "draft_shapes": "metasd:draft_fixed_shapes", "draft_captured": "metasd:draft_graphs_captured",
                 "draft_capture_s": "metasd:draft_graph_capture_seconds"}
#: of those, the ones a level reports as what happened during it (the others as they stand at its end)
GRAPH_DELTAS = ("verify_captured", "verify_capture_s", "draft_captured", "draft_capture_s")


def graph_counters(metrics_text: str) -> dict[str, float]:
    """GRAPH_METRICS read from a ``/metrics`` page (Prometheus text): each summed over its samples, 0 where absent."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in GRAPH_METRICS.items()}
    out = dict.fromkeys(GRAPH_METRICS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def graph_delta(before: dict | None, after: dict | None) -> dict | None:
    """What happened between two ``graph_counters`` reads: GRAPH_DELTAS as differences, the shapes as they stand
    ``after``; None where either read failed."""
    if before is None or after is None:
        return None
    return {key: round(after[key] - before[key], 3) if key in GRAPH_DELTAS else after[key] for key in GRAPH_METRICS}


def read_graph_counters(base: str) -> dict[str, float] | None:
    """``graph_counters`` of the server at ``base``; None (and a printed note) where its /metrics cannot be read."""
    import httpx

    try:
        r = httpx.get(base + "/metrics", timeout=30)
        r.raise_for_status()
        return graph_counters(r.text)
    except Exception as e:  # noqa: BLE001 - a benchmark figure the row goes without, said so
        print(f"  /metrics not read ({type(e).__name__}: {e}); the row has no graph counters", flush=True)
        return None


def captured(graphs: dict) -> tuple[float, float]:
    """(graphs captured, seconds capturing) of a ``graph_delta``: the verify forward's and the drafters' together."""
    return (graphs["verify_captured"] + graphs["draft_captured"],
            graphs["verify_capture_s"] + graphs["draft_capture_s"])


def graph_note(graphs: dict | None) -> str:
    """The level line's note on captures during it ("" when none)."""
    if not graphs:
        return ""
    n, s = captured(graphs)
    return f", {n:.0f} CUDA graphs captured in {s:.2f}s" if n else ""


# --------------------------------------------------------------------------------------------- tables
def _levels(rows, server):
    return sorted({r["concurrency"] for r in rows if r["server"] == server})


def _by(rows, server, c, key):
    """{repeat: value} of the rows of (server, c)."""
    return {r["repeat"]: r.get(key) for r in rows if r["server"] == server and r["concurrency"] == c}


def servers_in(rows) -> list[str]:
    seen = []
    for r in rows:
        if r["server"] not in seen:
            seen.append(r["server"])
    order = {s: i for i, s in enumerate(SERVERS)}
    return sorted(seen, key=lambda s: order.get(s, len(order)))


def summary_table(rows) -> str:
    """Markdown: per (server, c), medians over repeats ([min-max] for tok/s)."""
    lines = ["| server | c | requests done/sent | output tok/s median [range] | req/s | TTFT p50 / p99 (s) | "
             "ITL p50 / p99 (ms/token: delivery gap / its tokens) | TPOT p50 (ms) | e2e p50 (s) | tokens/delivery | tokens/step | repeats |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in servers_in(rows):
        for c in _levels(rows, s):
            rs = [r for r in rows if r["server"] == s and r["concurrency"] == c]

            def mr(key, rs=rs):
                return median_range([r.get(key) for r in rs])
            done = sum(r["requests_done"] for r in rs)
            sent = sum(r["requests_sent"] for r in rs)
            flags = " (timeout)" if any(r.get("timed_out") for r in rs) else ""
            lines.append(
                f"| {s} | {c} | {done}/{sent}{flags} | {fmt_mr(mr('output_tok_s'))} | {fmt_mr(mr('requests_s'), 3, range_=False)} | "
                f"{fmt_mr(mr('ttft_p50'), range_=False)} / {fmt_mr(mr('ttft_p99'), range_=False)} | "
                f"{fmt_mr(mr('itl_p50'), 0, 1000, False)} / {fmt_mr(mr('itl_p99'), 0, 1000, False)} | "
                f"{fmt_mr(mr('tpot_p50'), 0, 1000, False)} | {fmt_mr(mr('e2e_p50'), range_=False)} | "
                f"{fmt_mr(mr('tokens_per_delivery'), range_=False)} | {fmt_mr(mr('mean_tokens_per_step'), range_=False)} | "
                f"{len(rs)} |")
    return "\n".join(lines)


def paired_ratio(rows, a, ca, b, cb, key="output_tok_s") -> tuple[tuple[float, float, float] | None, str]:
    """(median, low, high) of the per-repeat ratios a@ca / b@cb (None: no repeat has both) and the verdict of a's
    values against b's. A repeat is paired where both have a value and b's is > 0 (a's may be 0: it served nothing)."""
    va, vb = _by(rows, a, ca, key), _by(rows, b, cb, key)
    common = [k for k in va if k in vb and va[k] is not None and vb[k]]
    if not common:
        return None, "-"
    rs = [va[k] / vb[k] for k in common]
    return median_range(rs), verdict([va[k] for k in common], [vb[k] for k in common])


def ratio(rows, a, ca, b, cb, key="output_tok_s") -> tuple[str, str]:
    """('median [range]x' of the per-repeat ratios a@ca / b@cb, verdict) for tables (``paired_ratio``); ('-', '-')
    where no repeat pairs."""
    mr, v = paired_ratio(rows, a, ca, b, cb, key)
    return ("-", "-") if mr is None else (fmt_mr(mr) + "x", v)


#: (server, reference) ratios the table gives where both ran, beside every server against transformers serve
PAIRS = (("metasd", "metasd-off"), ("metasd-llama-cpp", "llama-server"), ("metasd-llama-cpp", "llama-server-draft"),
         ("metasd-llama-cpp", "metasd-llama-cpp-off"), ("metasd-llama-cpp-off", "llama-server"),
         ("llama-server-draft", "llama-server"))


def ratio_table(rows) -> str:
    """Markdown: output tok/s ratios per concurrency level (metasd default and off, extra pools, against
    transformers serve; the ``PAIRS``: metasd default against off, metasd on llama.cpp against llama-server with and
    without its draft model), and each server's scaling from c=1 to c=8 (or from its lowest
    to its highest level when those are missing)."""
    servers = servers_in(rows)
    pairs = [(s, "transformers") for s in servers if s != "transformers"]
    pairs += [(a, b) for a, b in PAIRS if a in servers]
    pairs = [(a, b) for a, b in dict.fromkeys(pairs) if b in servers]
    lines = []
    if pairs:
        lines += ["| c | " + " | ".join(f"{a} vs {b}" for a, b in pairs) + " |", "|---|" + "---|" * len(pairs)]
        for c in sorted({r["concurrency"] for r in rows}):
            cells = []
            for a, b in pairs:
                x, v = ratio(rows, a, c, b, c)
                cells.append(f"{x} {v}" if x != "-" else "-")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    scale = []
    for s in servers:
        levels = _levels(rows, s)
        if len(levels) < 2:
            continue
        lo, hi = (1, 8) if 1 in levels and 8 in levels else (levels[0], levels[-1])
        x, v = ratio(rows, s, hi, s, lo)
        scale.append(f"| {s} | c={hi} vs c={lo} | {x} | {v} |")
    if scale:
        if lines:
            lines.append("")
        lines += ["| server | total output tok/s | ratio median [range] | verdict |", "|---|---|---|---|"] + scale
    return "\n".join(lines)


def identity_line(rows, reference: str = "transformers") -> str:
    """How many completions of each server have the text the ``reference`` server gave the same prompt (greedy)."""
    ref = {}
    for r in rows:
        if r["server"] == reference:
            for q in r.get("requests", []):
                if q.get("ok"):
                    ref.setdefault(q["question_id"], q.get("text"))
    if not ref:
        return ""
    parts = []
    for s in servers_in(rows):
        if s == reference:
            continue
        pairs = [(q.get("text"), ref[q["question_id"]]) for r in rows if r["server"] == s
                 for q in r.get("requests", []) if q.get("ok") and q["question_id"] in ref]
        if pairs:
            parts.append(f"{s} {sum(a == b for a, b in pairs)}/{len(pairs)}")
    label = "transformers serve" if reference == "transformers" else reference
    return (f"completions identical to {label}'s text for the same prompt: " + ", ".join(parts)) if parts else ""


def capture_lines(rows) -> list[str]:
    """Per (server, c) whose levels captured CUDA graphs: how many and the seconds, median [range] over repeats - time
    inside the level's wall time (``graphs``); none where no level captured any."""
    out = []
    for server in servers_in(rows):
        for c in _levels(rows, server):
            g = [r["graphs"] for r in rows if r["server"] == server and r["concurrency"] == c and r.get("graphs")]
            n = [captured(x)[0] for x in g]
            if any(n):
                secs = [captured(x)[1] for x in g]
                out.append(f"  {server} c={c}: {fmt_mr(median_range(n), 0)} graphs in {fmt_mr(median_range(secs))} s")
    return ["CUDA graphs captured inside the measured levels (their seconds count in the levels' wall time):", *out] \
        if out else []


def print_tables(rows) -> None:
    print(summary_table(rows))
    t = ratio_table(rows)
    if t:
        print()
        print(t)
    lines = capture_lines(rows)
    if lines:
        print()
        print("\n".join(lines))
    for reference in ("transformers", "llama-server"):  # llama.cpp's servers against llama.cpp's plain decoding
        line = identity_line(rows, reference)
        if line:
            print()
            print(line)


# --------------------------------------------------------------------------------------------- servers
@dataclass
class ServerSpec:
    name: str
    kind: str  # "transformers" | "metasd" | "llama-server"
    pool: str | None = None
    extra_body: dict | None = None
    args: tuple[str, ...] = ()  # more command-line arguments of this server
    pythonpath: str | None = None  # put first on the server's PYTHONPATH (--server-path: another build of metasd)


#: metasd serve with its verifier on llama.cpp (the same bf16 weights as a GGUF)
ON_LLAMA_CPP = ("--backend", "llama.cpp")
#: the bundled draft model llama-server's speculative row drafts with (its bf16 GGUF, as llama-speculative's rows)
DRAFT = "bundled:qwen2.5-coder-0.5b-instruct"


def server_specs(args) -> list[ServerSpec]:
    known = {"transformers": ServerSpec("transformers", "transformers"),
             "metasd-off": ServerSpec("metasd-off", "metasd", extra_body=SPECULATE_OFF),
             "metasd": ServerSpec("metasd", "metasd"),
             "metasd-llama-cpp-off": ServerSpec("metasd-llama-cpp-off", "metasd", extra_body=SPECULATE_OFF,
                                                args=ON_LLAMA_CPP),
             "metasd-llama-cpp": ServerSpec("metasd-llama-cpp", "metasd", args=ON_LLAMA_CPP),
             "llama-server": ServerSpec("llama-server", "llama-server"),
             "llama-server-draft": ServerSpec("llama-server-draft", "llama-server",
                                              args=("--spec-draft-n-max", str(args.llama_server_draft_n_max)))}
    for spec in args.extra_pool or []:
        name, path = spec.rsplit("=", 1)
        known[name] = ServerSpec(name, "metasd", pool=str(Path(path).resolve()))
    names = args.servers or list(SERVERS) + [s.rsplit("=", 1)[0] for s in args.extra_pool or []]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"error: unknown server(s) {unknown}; choose from {sorted(known)}")
    for spec in args.server_path or []:
        name, _, path = spec.partition("=")
        if name not in names or not path or not Path(path, "metasd").is_dir():
            raise SystemExit(f"error: --server-path {spec!r}: NAME must be a server of this run ({names}) and DIR "
                             f"a directory holding a metasd package (pip install --no-deps --target DIR <checkout>)")
        known[name] = replace(known[name], pythonpath=str(Path(path).resolve()))
    return [known[n] for n in names]


def server_env(spec: ServerSpec, env: dict[str, str]) -> dict[str, str]:
    """The environment ``spec``'s server starts in: ``env``, with its ``pythonpath`` first on PYTHONPATH."""
    if spec.pythonpath is None:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (spec.pythonpath, env.get("PYTHONPATH")) if p)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cb_num_blocks(max_concurrency: int, longest_prompt_tokens: int, max_tokens: int, page: int = 256) -> int:
    """KV-cache blocks (of 256 tokens for the whole model) for transformers serve: every request in flight at its
    longest, twice over (prefix-cache blocks kept by finished requests, chat template), plus 8."""
    per_request = math.ceil((longest_prompt_tokens + 64 + max_tokens) / page)
    return 2 * max_concurrency * per_request + 8


#: `transformers serve` with ContinuousBatchingConfig.allow_block_sharing=False (its prefix cache off; no CLI flag)
NO_PREFIX_CACHE = ("import sys; from transformers import ContinuousBatchingConfig as C; post = C.__post_init__; "
                   "C.__post_init__ = lambda self: (setattr(self, 'allow_block_sharing', False), post(self))[1]; "
                   "from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())")


def server_command(spec: ServerSpec, args, port: int, model_dir: Path, num_blocks: int) -> list[str]:
    if spec.kind == "transformers":
        head = ["transformers"] if args.transformers_prefix_cache else [sys.executable, "-c", NO_PREFIX_CACHE]
        return head + ["serve", "--continuous-batching", "--device", args.device, "--dtype", "bfloat16",
                "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(num_blocks),
                "--cb-max-batch-tokens", str(args.cb_max_batch_tokens), "--log-level", "warning", str(model_dir)]
    if spec.kind == "llama-server":
        return llama_server_command(spec, args, port)
    cmd = list(args.metasd_cmd) + list(spec.args) + ["--host", "127.0.0.1", "--port", str(port),
                                   "--max-batch", str(args.max_batch or max(args.concurrency)),
                                   "--threads", str(args.threads)]
    if spec.pool:
        cmd += ["--pool", spec.pool]
    return cmd + list(args.metasd_arg or [])


def llama_server_command(spec: ServerSpec, args, port: int) -> list[str]:
    """llama.cpp's own server on the bundled verifier's bf16 GGUF (the weights metasd's bf16 runs and its llama.cpp
    backend load; built and converted once, benchmarks/speed.py's llama.cpp rows do the same): one slot per request in
    flight at the highest concurrency, each with room for the longest prompt and --max-tokens, its prompt cache off
    (``--no-cache-prompt``, ``--cache-ram 0``: every prompt repeats across levels, as for transformers serve); the
    draft row adds the bundled 0.5B's bf16 GGUF (``-md``) drafting ``--llama-server-draft-n-max`` tokens."""
    from metasd.bench.llama_cpp import build_tools
    from metasd.models.llama_cpp_source import converted_gguf

    slots = max(args.concurrency)
    cmd = [str(build_tools() / "llama-server"), "-m", str(converted_gguf(VERIFIER, "bf16")), "--host", "127.0.0.1",
           "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
           "-c", str(slots * args.llama_server_slot_context), "--no-cache-prompt", "--cache-ram", "0", "--no-webui",
           "--jinja", "--alias", VERIFIER]
    if spec.args:
        cmd += ["-md", str(converted_gguf(DRAFT, "bf16")), "-td", str(args.threads), *spec.args]
    return cmd


class Server:
    """One server process in its own process group: started, health-checked (GET /health until 200), its model
    id read from /v1/models; ``stop`` (also on any exit from the with block) sends SIGTERM to the group, then
    SIGKILL after 15 s."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, startup_timeout: float):
        self.cmd, self.env, self.log_path, self.startup_timeout = cmd, env, log_path, startup_timeout
        self.proc = None
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = None
        self.startup_s = None

    def __enter__(self):
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.cmd) + "\n")
        log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        _LIVE.add(self)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy:\n{self.log_tail()}")
                if time.perf_counter() - t0 > self.startup_timeout:
                    raise RuntimeError(f"server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")
                try:
                    if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            self.startup_s = time.perf_counter() - t0
            try:
                models = httpx.get(self.base + "/v1/models", timeout=30).json()["data"]
                self.model = models[0]["id"] if models else None
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                self.model = None
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        _LIVE.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


_LIVE: set[Server] = set()


def _terminate(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------------------------- load
async def stream_one(client, model: str, prompt: str, args, extra_body, max_tokens: int | None = None) -> dict:
    """One streaming chat request (``max_tokens``, default ``args.max_tokens``): chunk arrival times (s after
    sending) and texts, usage, metasd's record."""
    rec = {"ok": False, "chunks": []}
    t0 = time.perf_counter()
    try:
        kwargs = {"extra_body": extra_body} if extra_body else {}
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens or args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True}, **kwargs)
        text = []
        async for chunk in stream:
            t = time.perf_counter() - t0
            piece = ""
            if chunk.choices:
                ch = chunk.choices[0]
                piece = (ch.delta.content if ch.delta else None) or ""
                if ch.finish_reason:
                    rec["finish_reason"] = ch.finish_reason
            if piece:
                rec["chunks"].append((t, piece))
                text.append(piece)
            if chunk.usage is not None:
                rec["completion_tokens"] = chunk.usage.completion_tokens
                rec["prompt_tokens"] = chunk.usage.prompt_tokens
            extra = chunk.model_extra or {}
            if isinstance(extra.get("metasd"), dict):
                rec["metasd"] = extra["metasd"]
        rec["e2e"] = time.perf_counter() - t0
        rec["text"] = "".join(text)
        rec["ok"] = True
    except asyncio.CancelledError:
        rec["error"] = "cancelled at the level timeout"
        rec["e2e"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed request is a row entry, not the end of the run
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
        rec["e2e"] = time.perf_counter() - t0
    return rec


async def run_level(base: str, model: str, prompts: list, concurrency: int, n: int, args, extra_body) -> tuple[list, float, bool]:
    """n requests (prompts cycled) with exactly `concurrency` in flight; stops at args.level_timeout."""
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
                             timeout=httpx.Timeout(args.level_timeout, connect=30))
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, http_client=http)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * n
    sent_at = [None] * n

    async def one(i):
        async with sem:
            q = prompts[i % len(prompts)]
            sent_at[i] = time.perf_counter()
            rec = await stream_one(client, model, q.turns[0], args, extra_body,
                                   getattr(q, "meta", {}).get("max_tokens"))  # a question's own length, if it gives one
            rec.update({"question_id": q.question_id, "group": q.group, "sent_s": sent_at[i] - t0})
            results[i] = rec

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    await http.aclose()
    out = []
    for i, r in enumerate(results):
        if r is None:  # cancelled before it was sent, or while sending
            q = prompts[i % len(prompts)]
            r = {"ok": False, "chunks": [], "question_id": q.question_id, "group": q.group,
                 "error": "not finished at the level timeout"}
        out.append(r)
    return out, wall, bool(pending)


def requests_for(concurrency: int, n_prompts: int, fixed: int | None, per_c: int = 2) -> int:
    """Requests per level: `fixed`, else whole passes over the prompt set making at least per_c x concurrency."""
    if fixed:
        return fixed
    return n_prompts * math.ceil(max(per_c * concurrency, n_prompts) / n_prompts)


def load_prompts(args):
    from metasd.data import SPEC_BENCH_DEFAULT, load_questions

    paths = args.questions or [str(SPEC_BENCH_DEFAULT)]
    groups, categories = getattr(args, "groups", None), getattr(args, "categories", None)
    questions = ([q for path in paths
                  for q in load_questions(path, groups=groups, per_group=args.per_group, categories=categories)]
                 if args.per_group else [])
    if args.copy_heavy:
        from metasd.data.copy_heavy import build_copy_heavy

        questions += build_copy_heavy(args.copy_heavy)
    if not questions:
        raise SystemExit("error: no prompts (--per-group 0 and no --copy-heavy)")
    random.Random(0).shuffle(questions)
    return questions


def model_dir_of(args) -> Path:
    if args.model_dir:
        return Path(args.model_dir).expanduser()
    from metasd.models.bundled import cache_dir, prepared_dir

    return prepared_dir(VERIFIER) or cache_dir() / VERIFIER.split(":", 1)[1]


def write_result(args, argv, rows, t_start) -> None:
    result = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads per server",
        "args": vars(args), "wall_s": time.time() - t_start, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", help=f"servers to load (default: {' '.join(SERVERS)} and every --extra-pool)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, help="exactly N requests per level (default: whole passes over the "
                                                "prompts, at least 2 x concurrency)")
    p.add_argument("--requests-per-c", type=int, default=2, metavar="K",
                   help="without --requests: whole passes over the prompts making at least K x concurrency requests")
    p.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (repeatable; default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=2)
    p.add_argument("--groups", nargs="+", help="only these Spec-Bench groups (default: all)")
    p.add_argument("--categories", nargs="+", help="only these Spec-Bench categories (e.g. coding math: prompts "
                                                   "outside the plan the allocator was tuned on)")
    p.add_argument("--copy-heavy", type=int, default=0, metavar="N", help="also N prompts per copy-heavy category")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to answer; a question whose meta gives max_tokens "
                                                                 "(trace_replay.py serve-prep writes them) asks for its own")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--threads", type=int, default=2, help="OMP/MKL threads of each server")
    p.add_argument("--level-timeout", type=float, default=3600, help="seconds; a level stops by itself after this")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds for a server to answer /health")
    p.add_argument("--warmup", type=int, default=1, help="requests (8 tokens) sent to each server before its load")
    p.add_argument("--warmup-prompt", choices=["fixed", "first"], default="fixed",
                   help="the warm-up's prompt: a fixed one outside the plan, or the plan's first (a server replaying "
                        "traces serves only the replayed prompts: trace_replay.py serve-prep)")
    p.add_argument("--device", default="cpu", help="transformers serve --device (metasd serve: its pool's)")
    p.add_argument("--model-dir", help="the verifier's HF directory: transformers serve's model and the tokenizer "
                                       "that counts tokens per chunk (default: the bundled verifier's cache)")
    p.add_argument("--transformers-prefix-cache", action="store_true",
                   help="leave transformers serve's prefix cache on, as shipped (default: off, because every prompt "
                        "repeats across levels and repeats, so its prefills would mostly be cache hits)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=2048, help="transformers serve --cb-max-batch-tokens")
    p.add_argument("--cb-num-blocks", type=int, help="transformers serve --cb-num-blocks (default: sized to the load)")
    p.add_argument("--max-batch", type=int, help="metasd serve --max-batch (default: the highest --concurrency)")
    p.add_argument("--metasd-cmd", nargs="+", default=[sys.executable, "-m", "metasd.cli", "serve"],
                   help="the command that starts metasd serve (before --host/--port/...)")
    p.add_argument("--metasd-arg", action="append", help="one more argument for metasd serve (repeatable)")
    p.add_argument("--llama-server-draft-n-max", type=int, default=8,
                   help="llama-server-draft: --spec-draft-n-max (the best of 4, 8, 16 in the llama.cpp speed rows)")
    p.add_argument("--llama-server-slot-context", type=int, default=2048,
                   help="llama-server: KV positions per slot (-c is this x the highest concurrency)")
    p.add_argument("--extra-pool", action="append",
                   help="NAME=pool.yaml: also load `metasd serve --pool pool.yaml` as server NAME (repeatable)")
    p.add_argument("--server-path", action="append", metavar="NAME=DIR",
                   help="start server NAME with DIR first on its PYTHONPATH: a metasd installed from another checkout "
                        "(pip install --no-deps --target DIR <checkout>), to measure two builds in one rotated run "
                        "(repeatable)")
    p.add_argument("--out", default="benchmarks/results/serve_load.json",
                   help="the results file (JSON, rewritten after every level); server logs go to <out>.logs/")
    p.add_argument("--table", metavar="RESULT_JSON", help="only print the tables of an earlier run")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows an interrupted run with the same command already wrote to --out, for "
                        "each (server, repeat) that finished every level (the others run again whole); --repeats may "
                        "grow")
    return p


def resumed_rows(args) -> list[dict]:
    """The rows an interrupted run with the same arguments (--resume and --repeats aside: a run may be resumed with
    more repeats) wrote to --out, of the servers that finished every level (``whole_servers``); none without the
    file."""
    out = Path(args.out)
    if not out.exists():
        return []
    saved = json.loads(out.read_text())
    ours = json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in ("resume", "repeats")}))
    theirs = {k: v for k, v in saved["args"].items() if k not in ("resume", "repeats")}
    if ours != theirs:
        changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise SystemExit(f"error: --resume: {out} was written with other arguments ({', '.join(changed)})")
    rows = whole_servers(saved["rows"], args.concurrency)
    print(f"resuming: {len(rows)} levels already in {out}"
          + (f" ({len(saved['rows']) - len(rows)} dropped: their server stopped before its last level)"
             if len(rows) < len(saved["rows"]) else ""), flush=True)
    return rows


def whole_servers(rows: list[dict], levels) -> list[dict]:
    """The rows of each (server, repeat) that ran every one of ``levels``: a server measured at some levels only
    is run again from its first, as a fresh server carries nothing an adaptive pool learnt at the levels before."""
    ran: dict[tuple[str, int], set[int]] = {}
    for r in rows:
        ran.setdefault((r["server"], r["repeat"]), set()).add(r["concurrency"])
    return [r for r in rows if ran[(r["server"], r["repeat"])] >= set(levels)]


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.table:
        print_tables(json.loads(Path(args.table).read_text())["rows"])
        return 0
    if min(args.concurrency) < 1 or args.repeats < 1 or args.requests_per_c < 1:
        raise SystemExit("error: --concurrency, --repeats and --requests-per-c must be at least 1")
    specs = server_specs(args)
    prompts = load_prompts(args)
    model_dir = model_dir_of(args)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    longest = max(count_tokens(q.turns[0]) for q in prompts)
    num_blocks = args.cb_num_blocks or cb_num_blocks(max(args.concurrency), longest, args.max_tokens)
    rows = resumed_rows(args) if args.resume else []
    done = {(r["server"], r["concurrency"], r["repeat"]) for r in rows}
    logs = Path(str(args.out) + ".logs")
    plan = [(c, requests_for(c, len(prompts), args.requests, args.requests_per_c)) for c in sorted(args.concurrency)]
    print(f"{len(prompts)} prompts (longest {longest} tokens); requests per level: "
          + ", ".join(f"c={c}: {n}" for c, n in plan) + f"; servers {[s.name for s in specs]}, {args.repeats} repeats",
          flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t_start = time.time()
    try:
        for rep in range(args.repeats):
            order = specs[rep % len(specs):] + specs[:rep % len(specs)]
            for spec in order:
                todo = [(c, n) for c, n in plan if (spec.name, c, rep) not in done]
                if not todo:
                    continue
                cmd = server_command(spec, args, free_port(), model_dir, num_blocks)
                print(f"[repeat {rep + 1}/{args.repeats}] starting {spec.name}: {' '.join(cmd)}", flush=True)
                with Server(cmd, server_env(spec, env), logs / f"{spec.name}_r{rep}.log",
                            args.startup_timeout) as server:
                    model = server.model or str(model_dir)
                    metasd = spec.kind == "metasd"
                    counters = read_graph_counters(server.base) if metasd else None
                    t_warm = time.perf_counter()
                    for _ in range(args.warmup):
                        warm_args = argparse.Namespace(**{**vars(args), "max_tokens": 8, "level_timeout": args.startup_timeout})
                        warm = WARMUP if args.warmup_prompt == "fixed" else dataclasses.replace(prompts[0], meta={})
                        r = asyncio.run(run_level(server.base, model, [warm], 1, 1, warm_args, spec.extra_body))[0][0]
                        if not r.get("ok"):
                            raise RuntimeError(f"{spec.name}: warm-up request failed: {r.get('error')}\n{server.log_tail()}")
                    warm_s = time.perf_counter() - t_warm
                    if metasd:
                        counters, before = read_graph_counters(server.base), counters
                        warm_graphs = graph_delta(before, counters)
                    print(f"  healthy after {server.startup_s:.1f}s, warm-up {warm_s:.1f}s, model {model!r}", flush=True)
                    for c, n in todo:
                        if metasd and counters is None:  # the last read failed: this level reads its own start
                            counters = read_graph_counters(server.base)
                        reqs, wall, timed_out = asyncio.run(run_level(server.base, model, prompts, c, n, args, spec.extra_body))
                        row = {"server": spec.name, "concurrency": c, "repeat": rep, "requests_sent": n,
                               "timed_out": timed_out, "startup_s": server.startup_s, "warmup_s": warm_s,
                               "command": cmd, **summarise_level(reqs, wall, count_tokens)}
                        if metasd:
                            counters, before = read_graph_counters(server.base), counters
                            row.update(graphs=graph_delta(before, counters), warmup_graphs=warm_graphs)
                        for q in reqs:
                            q.pop("chunks", None)
                        row["requests"] = reqs
                        rows.append(row)
                        write_result(args, argv, rows, t_start)
                        errs = [q.get("error") for q in reqs if not q.get("ok")]
                        print(f"  c={c}: {row['requests_done']}/{n} requests in {wall:.1f}s, "
                              f"{row['output_tok_s'] or 0:.2f} tok/s, TTFT p50 {row['ttft_p50'] or 0:.2f}s"
                              + graph_note(row.get("graphs"))
                              + (f", {len(errs)} failed (first: {errs[0]})" if errs else "")
                              + (" [level timeout]" if timed_out else ""), flush=True)
    except KeyboardInterrupt:
        print("interrupted: servers stopped; finished levels are in " + str(args.out), file=sys.stderr)
        return 130
    finally:
        for s in list(_LIVE):
            s.stop()
    print(f"\ntotal {time.time() - t_start:.0f}s\n")
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
