"""A fault and soak run of ``metasd serve`` (issue: "A server that survives faults and hostile input"): concurrent
clients send a mix of normal requests (greedy and seeded sampling, streamed and not, and completions of two prompts
with two choices each), malformed, oversized and absurd ones, streams they abandon mid-way and bodies they send only half of, while the server's KV allocations and batched
forwards fail at random (injected). Afterwards every request that succeeded must have returned exactly what
``Engine.generate`` gives alone (greedy: its greedy text; seeded: plain seeded decoding's text,
docs/architecture.md#random-streams), every one that failed must have got an OpenAI-style error, the server must
answer, and the KV memory it accounts must be back within its budget (zero once idle).

The server runs in this process (a uvicorn thread on 127.0.0.1, a free port), faults injected where they happen
(``BatchCache._allocate``, the verifier's forward). Bounded: at most ``--requests`` requests and ``--seconds`` of
sending. Two kinds of models:

- by default tiny random fp32 models: every answer must be exactly its text alone;
- with ``--pool`` a real pool (``default``: ``metasd serve``'s own) in the dtype it asks for - bf16 on a CPU with
  native bf16 - where a batched tree verify and plain decoding's one-token forwards round differently, so an answer may
  leave plain decoding's text at a near-tie. Such an answer is walked token by token (``tie_walk``): at every place
  it leaves plain decoding, the token it took must be one the reference ranked within ``--tie-margin`` of its own
  choice (greedy: log-probabilities; seeded: log-probability / T + the request's keyed Gumbel noise, rescaled by T),
  and from there plain decoding is followed again. Anything else is a wrong output. The server runs with
  ``generation_config="none"`` (OpenAI's defaults for unset fields), so the reference decodes what was asked.

    python benchmarks/serve_soak.py --requests 400 --clients 8 --out benchmarks/results/serve_soak.json
    python benchmarks/serve_soak.py --pool default --requests 160 --clients 6 --threads 2 --alloc-fault 0.001 \
        --out benchmarks/results/serve_soak_real.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "tiny"
#: the name the real pool is served as
REAL_MODEL = "metasd-soak"
#: the largest log-probability gap at which a bf16 answer may leave plain decoding's (``--tie-margin``): the top-5
#: log-probabilities of the default pool's tree verifies and of plain decoding's one-token forwards differed by up to
#: 0.244 on the bundled pair in bf16 (BENCHMARKS.md, "Log-probabilities under speculation")
BF16_TIE_MARGIN = 0.25
KINDS = ("greedy", "greedy_stream", "seeded", "malformed", "unknown_field", "oversized", "absurd", "disconnect",
         "slow_body", "batch")


class Faults:
    """Injected faults: each KV allocation and each batched verify forward fails with its probability (a seeded
    RNG), while ``on``; with ``certain_at`` N, the N-th of each kind fails for certain too (thread timing decides which
    draws of the one RNG go to which kind, so a small run may otherwise draw no fault of a kind at all)."""

    def __init__(self, alloc_p: float, forward_p: float, seed: int = 0, certain_at: int | None = None):
        self.alloc_p, self.forward_p, self.rng, self.on = alloc_p, forward_p, random.Random(seed), True
        self.certain_at, self.draws, self.counts = certain_at, Counter(), Counter()
        self.lock = threading.Lock()

    def hit(self, kind: str, p: float) -> bool:
        with self.lock:
            if not self.on:
                return False
            self.draws[kind] += 1
            if self.rng.random() < p or self.draws[kind] == self.certain_at:
                self.counts[kind] += 1
                return True
        return False

    def install(self, scheduler) -> None:
        import torch

        cache = scheduler.verifier.cache
        allocate = cache._allocate

        def failing_allocate(shape):
            if self.hit("allocation", self.alloc_p):
                raise torch.OutOfMemoryError("injected: out of memory")
            return allocate(shape)
        cache._allocate = failing_allocate

        def failing_forward(module, args, kwargs):
            if kwargs.get("position_ids") is not None and self.hit("forward", self.forward_p):  # batched verifies
                raise RuntimeError("injected forward failure")
        scheduler.engine.verifier.model.register_forward_pre_hook(failing_forward, with_kwargs=True)


def tiny_pair():
    """(engine served, reference engine): the tiny fp32 verifier with a chain drafter of its own weights at a softer
    scale, and a separate copy of the verifier for ``Engine.generate`` alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import tiny_qwen, tiny_tokenizer

    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.drafters import PretrainedDrafter

    tok = tiny_tokenizer()
    served = Engine(Verifier(tiny_qwen(seed=0, logit_scale=3.0, context=1024), tok, name=MODEL),
                    [PretrainedDrafter(tiny_qwen(seed=0, logit_scale=2.0, context=1024), k=4, name="chain")])
    reference = Engine(Verifier(tiny_qwen(seed=0, logit_scale=3.0, context=1024), tok, name="ref"), [])
    return served, reference


def real_pool(pool: str):
    """(engine served, reference engine, the pool's serving section or None) for a pool file (``default``: the pool
    ``metasd serve`` runs without ``--pool``). The reference is plain decoding on the same verifier, run after the
    server has stopped."""
    from metasd.config import build_engine, default_serve_pool_path, read_pool_config
    from metasd.core.engine import Engine

    config = read_pool_config(default_serve_pool_path() if pool == "default" else pool)
    served = build_engine(config)
    serving = config.serving.model_dump() if config.serving.adaptive else None
    return served, Engine(served.verifier, None), serving


#: a 40-word start two prompts share (as a system prompt would): with the prefix cache on, later requests reuse it
SHARED = " ".join(f"w{20 + i % 30}" for i in range(40))
PROMPTS = ["w10 w11 w12 w10 w11", "w20 w21", "w30 w31 w32 w33 w30 w31", "w40", "w12 w13 w14 w15 w16 w17 w18",
           SHARED + " w10 w11", SHARED + " w12"]
#: the real pool's prompts (completions: raw text, no chat template): code to continue, prose, a list, and two that
#: share a system-prompt-like start
REAL_SHARED = ("You are a careful assistant for a team of software engineers. Answer briefly, with correct code where "
               "code is asked for, and say when you are unsure.\n\n")
REAL_PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                "The three most common causes of a memory leak in a long-running Python service are",
                "Translate into French: The weather is nice today, so we will walk to the station.\nFrench:",
                "1. Preheat the oven to 200 degrees.\n2.",
                "import json\n\n\ndef load_config(path):\n",
                REAL_SHARED + "Question: what does a KV cache store?\nAnswer:",
                REAL_SHARED + "Question: write a SQL query counting the rows of a table named users.\nAnswer:"]


def plan(n: int, seed: int, prompts: list[str] = PROMPTS, model: str = MODEL) -> list[dict]:
    """n requests: a kind each (normal ones most often) and its parameters."""
    rng = random.Random(seed)
    weights = [5, 3, 3, 1, 1, 1, 2, 2, 1, 2]
    out = []
    for i in range(n):
        kind = rng.choices(KINDS, weights)[0]
        out.append({"i": i, "kind": kind, "prompt": rng.choice(prompts), "max_tokens": rng.choice([4, 12, 30]),
                    "seed": rng.randrange(1000), "temperature": rng.choice([0.7, 1.0]), "model": model,
                    "prompts": rng.sample(prompts, 2), "sampled": rng.random() < 0.5})  # a batch's
    return out


def choices_of(r: dict, o: dict) -> list[tuple[dict, str]]:
    """Each checked answer of an outcome as (the request it must equal alone, its text): one, or a batch's every
    choice - prompt p's choice i (``index`` p x 2 + i) as that prompt alone with seed + i."""
    if "texts" in o:
        return [(r | {"prompt": r["prompts"][k // 2], "seed": r["seed"] + k % 2}, text)
                for k, text in enumerate(o["texts"])]
    return [(r, o["text"])] if "text" in o else []


def send(url: str, r: dict, body_limit: int, timeout: float = 60.0) -> dict:
    """Send one planned request; its outcome: {"status", "text" or "error"}. ``timeout``: how long the client waits
    for a byte of the answer before it gives up (httpx's read timeout): an answer later than that is lost."""
    import httpx

    path = url + "/v1/completions"
    base = {"model": r["model"], "prompt": r["prompt"], "max_tokens": r["max_tokens"]}
    kind = r["kind"]
    try:
        if kind == "malformed":
            resp = httpx.post(path, content=b'{"model": "' + r["model"].encode() + b'", "prompt": ',
                              headers={"content-type": "application/json"}, timeout=timeout)
        elif kind == "unknown_field":  # accepted with a warning (as vLLM does): the text must be plain greedy's
            resp = httpx.post(path, json=base | {"temperature": 0, "best_guess": True}, timeout=timeout)
            if resp.status_code == 200:
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": "greedy"}
        elif kind == "oversized":
            resp = httpx.post(path, json=base | {"prompt": "w10 " * (body_limit // 3)}, timeout=timeout)
        elif kind == "absurd":
            absurd = random.Random(r["seed"]).choice([{"max_tokens": 10 ** 9}, {"temperature": 1e-40},
                                                      {"top_p": 0}, {"stop": ["w1"] * 100}, {"seed": -5},
                                                      {"max_tokens": 0}, {"stop": "w" * 10_000}])
            resp = httpx.post(path, json=base | {"temperature": 0} | absurd, timeout=timeout)
            if absurd == {"temperature": 1e-40} and resp.status_code == 200:  # greedy: the text is checkable
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": "greedy"}
        elif kind == "disconnect":
            with httpx.stream("POST", path, json=base | {"temperature": 0, "stream": True, "max_tokens": 30},
                              timeout=timeout) as s:
                for _ in s.iter_lines():
                    break  # the first event, then the client goes away
            return {"status": "disconnected"}
        elif kind == "batch":  # several prompts, two choices each: every choice must be its prompt's text alone
            extra = {"temperature": r["temperature"], "seed": r["seed"]} if r["sampled"] else {"temperature": 0}
            resp = httpx.post(path, json=base | extra | {"prompt": r["prompts"], "n": 2}, timeout=timeout)
            if resp.status_code == 200:
                choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
                return {"status": 200, "texts": [c["text"] for c in choices],
                        "check": "seeded" if r["sampled"] else "greedy"}
        elif kind == "slow_body":  # half the body, then nothing: the server must give up on it (408)
            return send_half_a_body(url, json.dumps(base | {"temperature": 0}).encode())
        elif kind == "greedy_stream":
            text, error = "", None
            with httpx.stream("POST", path, json=base | {"temperature": 0, "stream": True}, timeout=timeout) as s:
                if s.status_code != 200:
                    s.read()
                    return {"status": s.status_code, "error": s.json().get("error")}
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        break
                    text += event["choices"][0]["text"] if event.get("choices") else ""
            return {"status": 500, "error": error} if error else {"status": 200, "text": text, "check": "greedy"}
        else:
            extra = {"temperature": 0} if kind == "greedy" else {"temperature": r["temperature"], "seed": r["seed"]}
            resp = httpx.post(path, json=base | extra, timeout=timeout)
            if resp.status_code == 200:
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": kind}
        if resp.status_code == 200:
            return {"status": 200}
        return {"status": resp.status_code, "error": resp.json().get("error")}
    except Exception as e:  # noqa: BLE001 - no answer at all: a lost request
        return {"status": "lost", "exception": f"{type(e).__name__}: {e}"}


def send_half_a_body(url: str, body: bytes) -> dict:
    """POST ``body``'s first half over a raw socket, its Content-Length saying the whole, and wait for the answer;
    the outcome as ``send``'s (the status and error body the server sent)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, answer = data.partition(b"\r\n\r\n")
    return {"status": int(head.split(b" ", 2)[1]), "error": json.loads(answer).get("error")}


def _content_length(data: bytes) -> int:
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", data.split(b"\r\n\r\n", 1)[0])
    return int(match.group(1)) if match else 0


def expected_text(reference, r: dict, check: str) -> str:
    if check == "greedy":
        return reference.generate(r["prompt"], r["max_tokens"]).text
    return reference.generate(r["prompt"], r["max_tokens"], temperature=r["temperature"], seed=r["seed"]).text


def tie_walk(reference, r: dict, check: str, served: str, tie_margin: float, max_divergences: int = 8) -> dict:
    """Whether ``served`` is plain decoding's text up to near-ties: follow the reference (plain decoding with the
    top-20 log-probabilities) along the served text; where the served text leaves it, the token it took must be among
    the reference's top 20 and within ``tie_margin`` of the reference's choice - greedy: ``lp(ref) - lp(served)``;
    seeded: ``T * [(lp/T + G)(ref) - (lp/T + G)(served)]`` with G the request's keyed Gumbel noise at that position
    (``KeyedNoise``, choice 0): the score the token was drawn by. Then plain decoding is followed from the served token.
    Returns {"ok", "margins": the gap at each place left, "reason" when not ok}."""
    from metasd.core.decoding.prompt import encode_prompt
    from metasd.core.decoding.sampling import KeyedNoise

    tok = reference.verifier.tokenizer
    prompt = encode_prompt(tok, r["prompt"])
    sampled = check == "seeded"
    temperature = r["temperature"] if sampled else 1.0
    noise = KeyedNoise(r["seed"]) if sampled else None
    width = reference.verifier.model.config.vocab_size  # the logits' width: what the keyed noise is drawn over
    kwargs = {"temperature": r["temperature"], "seed": r["seed"]} if sampled else {}

    def text(ids):
        return tok.decode(ids, skip_special_tokens=True)

    def fits(ids):  # the decoded ids are a start of the served text (a split character's replacement mark aside)
        return served.startswith(text(ids).rstrip("\ufffd"))

    forced, margins = [], []
    while len(margins) <= max_divergences:
        if len(forced) >= r["max_tokens"]:  # it left plain decoding at its last token: nothing more to generate
            if text(forced) == served:
                return {"ok": True, "margins": margins}
            return {"ok": False, "margins": margins, "reason": "the served text goes on past max_tokens"}
        result = reference.generate(prompt + forced, r["max_tokens"] - len(forced), logprobs=20, **kwargs)
        ids = forced + list(result.token_ids)
        if text(ids) == served:
            return {"ok": True, "margins": margins}
        j = next((j for j in range(len(forced), len(ids)) if not fits(ids[: j + 1])), None)
        if j is None:
            return {"ok": False, "margins": margins, "reason": "the served text goes on past plain decoding's end"}
        row = result.logprobs[j - len(forced)]
        logp = dict(row.top) | {row.token: row.logprob}
        taken = [t for t in logp if t != ids[j] and fits(ids[:j] + [t])]
        if not taken:
            return {"ok": False, "margins": margins, "reason": f"token {j} is not among plain decoding's top 20"}

        def score(t):
            g = noise.gumbel(len(prompt) + j, width)[t].item() if sampled else 0.0
            return logp[t] / temperature + g
        t = max(taken, key=score)
        margin = temperature * (score(ids[j]) - score(t))
        margins.append(round(margin, 4))
        if margin > tie_margin or margin < -1e-3:  # a negative gap: plain decoding did not take its best score
            return {"ok": False, "margins": margins, "reason": f"token {j}: gap {margin:.4f} to plain decoding's"}
        forced = ids[:j] + [t]
    return {"ok": False, "margins": margins, "reason": f"more than {max_divergences} near-ties"}


def run_soak(requests: int = 60, clients: int = 4, seconds: float = 120.0, alloc_p: float = 0.05,
             forward_p: float = 0.03, kv_budget: int = 2048, body_limit: int = 32 * 1024, seed: int = 0,
             prefix_caching: bool = True, pool: str | None = None, tie_margin: float | None = None,
             body_timeout: float = 1.0, client_timeout: float = 300.0, certain_fault_at: int | None = None) -> dict:
    """Run the soak; its report (counts by outcome, faults injected, memory, whether the server answers). With
    ``prefix_caching`` (``metasd serve``'s default) finished requests' KV stays in the budget for later ones: the
    rows must still be freed when idle, and the stored prefixes stay within the budget. ``pool``: a real pool file
    (``default``: ``metasd serve``'s) instead of the tiny models, its answers checked by ``tie_walk`` within
    ``tie_margin`` (default ``BF16_TIE_MARGIN``; the tiny models: 0, exact); ``body_timeout``: the server's
    ``--body-timeout`` (what a client sending half a body waits for its 408); ``client_timeout``: how long each client
    waits for an answer before it gives up (a lost request); ``certain_fault_at`` N: the N-th allocation and the N-th
    forward fail for certain (``Faults``). The report gives the seconds each answered request took
    (``answer_seconds``), so a lost request can be told from a slow server."""
    import httpx

    from metasd.core.batching.scheduler import Scheduler
    from metasd.core.execution.draft_rows import draft_rows_of
    from metasd.serve.app import create_app

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_helpers import ServerThread

    if pool is None:
        served, reference = tiny_pair()
        scheduler = Scheduler(served, max_batch=4, max_queue=64, kv_budget=kv_budget, max_draft_nodes=16,
                              prefix_caching=prefix_caching)
        model, prompts, tie_margin = MODEL, PROMPTS, tie_margin or 0.0
    else:
        from metasd.serve.cli import SchedulerSettings

        served, reference, serving = real_pool(pool)
        scheduler = SchedulerSettings(max_batch=4, max_queue=64, adaptive=serving, kv_budget=kv_budget,
                                      prefix_caching=prefix_caching).make(served)
        model, prompts = REAL_MODEL, REAL_PROMPTS
        tie_margin = BF16_TIE_MARGIN if tie_margin is None else tie_margin
    faults = Faults(alloc_p, forward_p, seed, certain_fault_at)
    faults.install(scheduler)
    peak = {"held": 0, "step_s": 0.0}

    def watch(record) -> None:  # the KV held at its peak, and the longest step (a stalled server shows there)
        peak["held"] = max(peak["held"], scheduler.verifier.cache.held_bytes)
        peak["step_s"] = max(peak["step_s"], getattr(record, "seconds", 0.0))

    scheduler.add_listener(watch)
    todo = plan(requests, seed, prompts, model)
    deadline = time.monotonic() + seconds
    outcomes: list[tuple[dict, dict]] = []
    srv = ServerThread(create_app(scheduler, model, max_body_bytes=body_limit, body_timeout_s=body_timeout,
                                generation_config="none"))
    t0 = time.perf_counter()
    with srv:
        def one(r):
            if time.monotonic() > deadline:
                return r, {"status": "not_sent"}
            t = time.perf_counter()
            outcome = send(srv.url, r, body_limit, client_timeout)
            return r, outcome | {"seconds": round(time.perf_counter() - t, 4)}

        with ThreadPoolExecutor(clients) as senders:
            outcomes = list(senders.map(one, todo))
        faults.on = False
        settle_until = time.monotonic() + 30  # the abandoned streams leave within a step; then the server is idle
        while scheduler.running and time.monotonic() < settle_until:
            time.sleep(0.05)
        # after the faults: a sampled several-prompt request (n = 2), every choice checked as its prompt alone - the
        # soak's own batch requests may all meet a fault (each forward fails with forward_p), this one cannot
        probe_request = {"i": requests, "kind": "batch", "prompt": prompts[0], "prompts": prompts[:2],
                         "max_tokens": 12, "seed": seed, "temperature": 0.7, "model": model, "sampled": True}
        probe = send(srv.url, probe_request, body_limit, client_timeout)
        alive = probe["status"] == 200 and httpx.get(srv.url + "/health", timeout=10).status_code == 200
        cache = scheduler.verifier.cache
        settle_until = time.monotonic() + 10  # the probe's answer arrives before its step ends and the buffers shrink
        while cache.row_bytes and time.monotonic() < settle_until:
            time.sleep(0.01)
        held_idle, prefixes_idle = cache.row_bytes, cache.pinned_bytes  # rows freed; stored prefixes may stay
        reserved_idle = len(cache.reserved)
    scheduler.close()
    wall = time.perf_counter() - t0
    tally, wrong, lost, unclear, near_ties = Counter(), [], [], [], []
    for r, o in outcomes + [(probe_request, probe | {"after_faults": True})]:
        status = o["status"]
        if not o.get("after_faults"):
            tally[f"{r['kind']}:{status}"] += 1
        if status == "lost":
            lost.append((r, o))
        elif isinstance(status, int) and status >= 400:
            err = o.get("error") or {}
            if not (isinstance(err, dict) and err.get("message") and err.get("type")):
                unclear.append((r, o))
        else:
            for alone, text in choices_of(r, o):
                if text != expected_text(reference, alone, o["check"]):
                    walk = tie_walk(reference, alone, o["check"], text, tie_margin)
                    (near_ties if walk["ok"] else wrong).append((alone, o | {"text": text, "walk": walk}))
    return {"requests_planned": requests, "requests_sent": sum(1 for _, o in outcomes if o["status"] != "not_sent"),
            "clients": clients, "wall_s": round(wall, 1), "by_kind_and_status": dict(sorted(tally.items())),
            "bad_inputs_tried": dict(Counter(r["kind"] for r, o in outcomes if r["kind"] not in
                                             ("greedy", "greedy_stream", "seeded", "batch")
                                             and o["status"] != "not_sent")),
            "faults_injected": dict(faults.counts),
            "checked_texts": sum(len(choices_of(r, o)) for r, o in outcomes), "client_timeout_s": client_timeout,
            "after_faults": {"status": probe["status"], "checked_texts": len(choices_of(probe_request, probe))},
            "answer_seconds": _spread([o["seconds"] for _, o in outcomes if isinstance(o["status"], int)]),
            "longest_step_s": round(peak["step_s"], 4),
            "wrong_outputs": len(wrong), "lost_without_error": len(lost), "errors_without_a_clear_body": len(unclear),
            "model": "tiny random fp32" if pool is None else f"pool {pool}: {served.verifier.describe()}",
            "tie_margin": tie_margin, "left_plain_decoding_at_near_ties": len(near_ties),
            "near_tie_gaps": sorted(g for _, o in near_ties for g in o["walk"]["margins"]),
            "server_alive_at_end": alive, "kv_budget_bytes": cache.budget_bytes, "kv_peak_held_bytes": peak["held"],
            "kv_held_bytes_when_idle": held_idle, "kv_prefix_cache_bytes_when_idle": prefixes_idle,
            # with fixed shapes the buffers stay allocated between requests (graphs read them; within the budget)
            "kv_reservations_when_idle": reserved_idle, "kv_buffers_kept": cache.keep_allocation,
            "prefix_cache_hit_tokens": scheduler.prefix_cache.stats.hits if scheduler.prefix_cache else None,
            # model drafters whose forks drafted over rows (fixed shapes): their levels' shapes, rows, rows still held
            "draft_rows": {r.name: r.describe() for r in draft_rows_of(served.all_drafters)},
            "examples": {"wrong": wrong[:3], "lost": lost[:3], "unclear": unclear[:3], "near_ties": near_ties[:3]}}


def _spread(xs: list[float]) -> dict:
    """The median and largest of ``xs`` (an empty dict when there are none)."""
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2], "max": xs[-1]} if xs else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=600.0, help="stop sending after this long")
    p.add_argument("--alloc-fault", type=float, default=0.05,
                   help="probability a KV allocation fails (each layer's key and value buffers are allocations of "
                        "their own: a real model makes ~60 per resize, so use ~0.001 with --pool)")
    p.add_argument("--forward-fault", type=float, default=0.03, help="probability a batched forward fails")
    p.add_argument("--kv-budget", type=int, default=2048, help="KV positions of the verifier's cache")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="run without the prefix cache (metasd serve's default has it on)")
    p.add_argument("--pool", help="a real pool file instead of the tiny models ('default': metasd serve's own); "
                                   "answers are checked up to near-ties (--tie-margin)")
    p.add_argument("--tie-margin", type=float, help=f"with --pool: the largest log-probability gap at which an answer "
                                                    f"may leave plain decoding's (default {BF16_TIE_MARGIN})")
    p.add_argument("--body-timeout", type=float, default=1.0,
                   help="the server's --body-timeout: what a client that sends half a body waits for its 408")
    p.add_argument("--client-timeout", type=float, default=300.0,
                   help="seconds a client waits for its answer before it gives up (a lost request): raise it where "
                        "a real pool's requests queue behind a slow verifier")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    report = run_soak(args.requests, args.clients, args.seconds, args.alloc_fault, args.forward_fault, args.kv_budget,
                      seed=args.seed, prefix_caching=args.prefix_caching, pool=args.pool,
                      tie_margin=args.tie_margin, body_timeout=args.body_timeout,
                      client_timeout=args.client_timeout)
    report = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads",
              **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "examples"}, indent=1))
    ok = (report["wrong_outputs"] == 0 and report["lost_without_error"] == 0 and report["server_alive_at_end"]
          and report["errors_without_a_clear_body"] == 0 and report["kv_reservations_when_idle"] == 0
          and (report["kv_held_bytes_when_idle"] == 0 or report["kv_buffers_kept"]
               and report["kv_held_bytes_when_idle"] + report["kv_prefix_cache_bytes_when_idle"]
               <= report["kv_budget_bytes"])
          and report["kv_prefix_cache_bytes_when_idle"] <= report["kv_budget_bytes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
