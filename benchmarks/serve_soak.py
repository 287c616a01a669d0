"""A fault and soak run of ``metasd serve`` (issue: "A server that survives faults and hostile input"): concurrent
clients send a mix of normal requests (greedy and seeded sampling, streamed and not), malformed, oversized and
absurd ones, and streams they abandon mid-way, while the server's KV allocations and batched forwards fail at random
(injected). Afterwards every request that succeeded must have returned exactly what ``Engine.generate`` gives alone
(greedy: its greedy text; seeded: plain seeded decoding's text, docs/architecture.md#random-streams), every one that
failed must have got an OpenAI-style error, the server must answer, and the KV memory it accounts must be back
within its budget (zero once idle).

The server runs in this process (a uvicorn thread on 127.0.0.1, a free port) over tiny random fp32 models - exact
comparison, and faults injected where they happen (``BatchCache._allocate``, the verifier's forward). Bounded: at
most ``--requests`` requests and ``--seconds`` of sending.

    python benchmarks/serve_soak.py --requests 400 --clients 8 --out benchmarks/results/serve_soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "tiny"
KINDS = ("greedy", "greedy_stream", "seeded", "malformed", "unknown_field", "oversized", "absurd", "disconnect")


class Faults:
    """Injected faults: each KV allocation and each batched verify forward fails with its probability (a seeded
    RNG), while ``on``."""

    def __init__(self, alloc_p: float, forward_p: float, seed: int = 0):
        self.alloc_p, self.forward_p, self.rng, self.on = alloc_p, forward_p, random.Random(seed), True
        self.counts = Counter()
        self.lock = threading.Lock()

    def hit(self, kind: str, p: float) -> bool:
        with self.lock:
            if self.on and self.rng.random() < p:
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


#: a 40-word start two prompts share (as a system prompt would): with the prefix cache on, later requests reuse it
SHARED = " ".join(f"w{20 + i % 30}" for i in range(40))
PROMPTS = ["w10 w11 w12 w10 w11", "w20 w21", "w30 w31 w32 w33 w30 w31", "w40", "w12 w13 w14 w15 w16 w17 w18",
           SHARED + " w10 w11", SHARED + " w12"]


def plan(n: int, seed: int) -> list[dict]:
    """n requests: a kind each (normal ones most often) and its parameters."""
    rng = random.Random(seed)
    weights = [5, 3, 3, 1, 1, 1, 2, 2]
    out = []
    for i in range(n):
        kind = rng.choices(KINDS, weights)[0]
        out.append({"i": i, "kind": kind, "prompt": rng.choice(PROMPTS), "max_tokens": rng.choice([4, 12, 30]),
                    "seed": rng.randrange(1000), "temperature": rng.choice([0.7, 1.0])})
    return out


def send(url: str, r: dict, body_limit: int) -> dict:
    """Send one planned request; its outcome: {"status", "text" or "error"}."""
    import httpx

    path = url + "/v1/completions"
    base = {"model": MODEL, "prompt": r["prompt"], "max_tokens": r["max_tokens"]}
    kind = r["kind"]
    try:
        if kind == "malformed":
            resp = httpx.post(path, content=b'{"model": "tiny", "prompt": ',
                              headers={"content-type": "application/json"}, timeout=60)
        elif kind == "unknown_field":  # accepted with a warning (as vLLM does): the text must be plain greedy's
            resp = httpx.post(path, json=base | {"temperature": 0, "best_guess": True}, timeout=60)
            if resp.status_code == 200:
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": "greedy"}
        elif kind == "oversized":
            resp = httpx.post(path, json=base | {"prompt": "w10 " * (body_limit // 3)}, timeout=60)
        elif kind == "absurd":
            absurd = random.Random(r["seed"]).choice([{"max_tokens": 10 ** 9}, {"temperature": 1e-40},
                                                      {"top_p": 0}, {"stop": ["w1"] * 100}, {"seed": -5},
                                                      {"max_tokens": 0}, {"stop": "w" * 10_000}])
            resp = httpx.post(path, json=base | {"temperature": 0} | absurd, timeout=60)
            if absurd == {"temperature": 1e-40} and resp.status_code == 200:  # greedy: the text is checkable
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": "greedy"}
        elif kind == "disconnect":
            with httpx.stream("POST", path, json=base | {"temperature": 0, "stream": True, "max_tokens": 30},
                              timeout=60) as s:
                for _ in s.iter_lines():
                    break  # the first event, then the client goes away
            return {"status": "disconnected"}
        elif kind == "greedy_stream":
            text, error = "", None
            with httpx.stream("POST", path, json=base | {"temperature": 0, "stream": True}, timeout=60) as s:
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
            resp = httpx.post(path, json=base | extra, timeout=60)
            if resp.status_code == 200:
                return {"status": 200, "text": resp.json()["choices"][0]["text"], "check": kind}
        if resp.status_code == 200:
            return {"status": 200}
        return {"status": resp.status_code, "error": resp.json().get("error")}
    except Exception as e:  # noqa: BLE001 - no answer at all: a lost request
        return {"status": "lost", "exception": f"{type(e).__name__}: {e}"}


def expected_text(reference, r: dict, check: str) -> str:
    if check == "greedy":
        return reference.generate(r["prompt"], r["max_tokens"]).text
    return reference.generate(r["prompt"], r["max_tokens"], temperature=r["temperature"], seed=r["seed"]).text


def run_soak(requests: int = 60, clients: int = 4, seconds: float = 120.0, alloc_p: float = 0.05,
             forward_p: float = 0.03, kv_budget: int = 2048, body_limit: int = 32 * 1024, seed: int = 0,
             prefix_caching: bool = True) -> dict:
    """Run the soak; its report (counts by outcome, faults injected, memory, whether the server answers). With
    ``prefix_caching`` (``metasd serve``'s default) finished requests' KV stays in the budget for later ones: the
    rows must still be freed when idle, and the stored prefixes stay within the budget."""
    import httpx

    from metasd.core.batching.scheduler import Scheduler
    from metasd.serve.app import create_app

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_helpers import ServerThread

    served, reference = tiny_pair()
    scheduler = Scheduler(served, max_batch=4, max_queue=64, kv_budget=kv_budget, max_draft_nodes=16,
                          prefix_caching=prefix_caching)
    faults = Faults(alloc_p, forward_p, seed)
    faults.install(scheduler)
    peak = {"held": 0}
    scheduler.add_listener(lambda _: peak.__setitem__("held", max(peak["held"], scheduler.verifier.cache.held_bytes)))
    todo = plan(requests, seed)
    deadline = time.monotonic() + seconds
    outcomes: list[tuple[dict, dict]] = []
    srv = ServerThread(create_app(scheduler, MODEL, max_body_bytes=body_limit))
    t0 = time.perf_counter()
    with srv:
        def one(r):
            if time.monotonic() > deadline:
                return r, {"status": "not_sent"}
            return r, send(srv.url, r, body_limit)

        with ThreadPoolExecutor(clients) as pool:
            outcomes = list(pool.map(one, todo))
        faults.on = False
        settle_until = time.monotonic() + 30  # the abandoned streams leave within a step; then the server is idle
        while scheduler.running and time.monotonic() < settle_until:
            time.sleep(0.05)
        probe = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 3,
                                                              "temperature": 0}, timeout=60)
        alive = probe.status_code == 200 and httpx.get(srv.url + "/health", timeout=10).status_code == 200
        cache = scheduler.verifier.cache
        settle_until = time.monotonic() + 10  # the probe's answer arrives before its step ends and the buffers shrink
        while cache.row_bytes and time.monotonic() < settle_until:
            time.sleep(0.01)
        held_idle, prefixes_idle = cache.row_bytes, cache.pinned_bytes  # rows freed; stored prefixes may stay
    scheduler.close()
    wall = time.perf_counter() - t0
    tally, wrong, lost, unclear = Counter(), [], [], []
    for r, o in outcomes:
        status = o["status"]
        tally[f"{r['kind']}:{status}"] += 1
        if status == "lost":
            lost.append((r, o))
        elif isinstance(status, int) and status >= 400:
            err = o.get("error") or {}
            if not (isinstance(err, dict) and err.get("message") and err.get("type")):
                unclear.append((r, o))
        elif "text" in o and o["text"] != expected_text(reference, r, o["check"]):
            wrong.append((r, o))
    return {"requests_planned": requests, "requests_sent": sum(1 for _, o in outcomes if o["status"] != "not_sent"),
            "clients": clients, "wall_s": round(wall, 1), "by_kind_and_status": dict(sorted(tally.items())),
            "bad_inputs_tried": dict(Counter(r["kind"] for r, o in outcomes if r["kind"] not in
                                             ("greedy", "greedy_stream", "seeded") and o["status"] != "not_sent")),
            "faults_injected": dict(faults.counts),
            "checked_texts": sum(1 for _, o in outcomes if "text" in o),
            "wrong_outputs": len(wrong), "lost_without_error": len(lost), "errors_without_a_clear_body": len(unclear),
            "server_alive_at_end": alive, "kv_budget_bytes": cache.budget_bytes, "kv_peak_held_bytes": peak["held"],
            "kv_held_bytes_when_idle": held_idle, "kv_prefix_cache_bytes_when_idle": prefixes_idle,
            "prefix_cache_hit_tokens": scheduler.prefix_cache.stats.hits if scheduler.prefix_cache else None,
            "examples": {"wrong": wrong[:3], "lost": lost[:3], "unclear": unclear[:3]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=600.0, help="stop sending after this long")
    p.add_argument("--alloc-fault", type=float, default=0.05, help="probability a KV allocation fails")
    p.add_argument("--forward-fault", type=float, default=0.03, help="probability a batched forward fails")
    p.add_argument("--kv-budget", type=int, default=2048, help="KV positions of the verifier's cache")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="run without the prefix cache (metasd serve's default has it on)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    report = run_soak(args.requests, args.clients, args.seconds, args.alloc_fault, args.forward_fault, args.kv_budget,
                      seed=args.seed, prefix_caching=args.prefix_caching)
    report = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads",
              **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "examples"}, indent=1))
    ok = (report["wrong_outputs"] == 0 and report["lost_without_error"] == 0 and report["server_alive_at_end"]
          and report["errors_without_a_clear_body"] == 0 and report["kv_held_bytes_when_idle"] == 0
          and report["kv_prefix_cache_bytes_when_idle"] <= report["kv_budget_bytes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
