"""Trace-replayed acceptance from a pool file (``type: metasd.drafters.trace:TraceDrafter``, drafters/trace.py): the
entry replays a recorded arm on another verifier - the way ``metasd serve`` serves recorded acceptance on random
weights of the real shapes - and commits that verifier's own text in the recorded steps, alone and over HTTP; every
way the entry can be wrong is refused naming its field, and a prompt the replay does not hold is refused, never
drafted for otherwise."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from metasd.config import ConfigError, ModelCache, load_pool
from metasd.core import Engine, Verifier
from metasd.drafters import PretrainedTreeDrafter
from metasd.drafters.trace import PromptTrace, Trace, TraceMiss
from metasd.drafters.trace_record import record_arm
from metasd.models import load_model
from test_trace_replay import _noisy
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5, 12, 9, 33], [0, 21, 5, 8, 21, 5, 8, 30]]
N = 20
TYPE = "metasd.drafters.trace:TraceDrafter"


def _tree(model):
    return PretrainedTreeDrafter(model, mode="dynamic", nodes=8, depth=4, width=2, name="tree")


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A trace of the tree arm recorded with one tiny pair, replayed on another pair saved as HF directories: the
    folder, each prompt's replay ids, the replaying verifier's continuation and the recorded pair's steps alone."""
    root = tmp_path_factory.mktemp("trace_serve")
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    traces, steps_alone = [], []
    for i, prompt in enumerate(PROMPTS):
        R = plain_greedy(verifier, prompt, N + 6)
        alone = Engine(Verifier(verifier), _tree(drafter), check_tokenizers=False).generate(prompt, max_new_tokens=N)
        steps_alone.append(alone.stats.tokens_per_step)
        traces.append(PromptTrace(f"group/{i}", len(prompt), N, {"tree": record_arm(_tree(drafter), prompt, R, N)}))
    trace = Trace(traces)
    trace.save(root / "trace.json")
    other = {"verifier": tiny_qwen(seed=5, logit_scale=4.0), "drafter": tiny_qwen(seed=6)}
    for name, model in other.items():
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    ids, continuations = [], []
    for i, prompt in enumerate(PROMPTS):  # replay prompts whose continuation holds no special token (</s> ends it)
        for shift in range(100):
            x = [3 + (t * 5 + i + shift) % 60 for t in prompt]
            G = plain_greedy(other["verifier"], x, N + 6)
            if min(G) >= 3:
                break
        ids.append(x)
        continuations.append(G)
    for p, x, G in zip(trace.prompts, ids, continuations):
        p.replay_on(x, G)
    trace.save_replay(root / "replay.json")
    return root, ids, continuations, steps_alone


def _pool(root, name="pool", **entry):
    body = {"name": "tree", "type": TYPE, "model": str(root / "drafter"),
            "params": {"trace": "trace.json", "replay": "replay.json"}}  # relative: to the pool file's folder
    body.update(entry)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"verifier": {"model": str(root / "verifier"), "dtype": "fp32"},
                                    "drafters": [{k: v for k, v in body.items() if v is not None}]}))
    return path


def _load(root, path):
    cache = ModelCache("cpu")
    for name in ("verifier", "drafter"):  # with the word-level tokenizer they were saved with
        model, _ = load_model(str(root / name), dtype="fp32", device="cpu")
        cache.put(str(root / name), "fp32", (model, tiny_tokenizer()))
    return load_pool(path, models=cache)


def test_a_pool_entry_replays_the_recorded_steps_on_its_own_verifier(replayed):
    root, ids, continuations, steps_alone = replayed
    engine = _load(root, _pool(root))
    assert engine.drafter("tree").describe()["models"] == 1
    for x, G, steps in zip(ids, continuations, steps_alone):
        result = engine.generate(x, max_new_tokens=N)
        assert result.token_ids == G[:N]  # the replaying verifier's own greedy text
        assert result.stats.tokens_per_step == steps  # the recorded pair's acceptance, step by step
    with pytest.raises(TraceMiss, match="no trace is replayed on this prompt"):
        engine.generate([3, 4, 5, 6], max_new_tokens=4)  # a prompt the replay file does not hold


def test_served_over_http_each_request_takes_its_recorded_steps(replayed):
    pytest.importorskip("fastapi")
    from metasd.core.batching.scheduler import Scheduler
    from metasd.serve.app import create_app
    from serve_helpers import ServerThread, openai_client

    root, ids, continuations, steps_alone = replayed
    engine = _load(root, _pool(root))
    scheduler = Scheduler(engine, max_batch=4)
    getattr(scheduler, "start", lambda: None)()
    try:
        with ServerThread(create_app(scheduler, "trace")) as srv:
            client = openai_client(srv)
            with ThreadPoolExecutor(2) as pool:  # side by side: the requests share the batch and its drafting
                answers = list(pool.map(lambda x: client.completions.create(
                    model="trace", prompt=x, max_tokens=N, temperature=0), ids))
    finally:
        scheduler.close()
    tok = tiny_tokenizer()
    for answer, G, steps in zip(answers, continuations, steps_alone):
        assert answer.choices[0].text == tok.decode(G[:N], skip_special_tokens=True)  # as the server decodes
        assert answer.usage.completion_tokens == N
        assert answer.model_extra["metasd"]["tokens_per_step"] == steps  # batched, as it replayed alone


@pytest.mark.parametrize("entry, field", [
    ({"params": {"trace": "trace.json", "replay": "missing.json"}}, "params.replay"),
    ({"params": {"trace": "nowhere.json", "replay": "replay.json"}}, "params.trace"),
    ({"params": {"trace": "trace.json", "replay": "replay.json", "arm": "chain"}}, "params.arm"),
    ({"model": None}, "model"),  # the tree arm ran a model: the entry must give one
])
def test_a_wrong_entry_is_refused_naming_its_field(replayed, entry, field):
    root = replayed[0]
    with pytest.raises(ConfigError, match=rf"drafters\.0 \('tree'\): {field}\b"):
        _load(root, _pool(root, name="wrong", **entry))


def test_serve_prep_writes_what_a_server_serves_the_trace_from(tmp_path, replayed):
    """``benchmarks/trace_replay.py serve-prep`` (the GPU session's serving set-up, here on the tiny shapes): random
    models with a word-level tokenizer, the replay, the prompts as chat text and the pool rewritten to trace entries -
    loaded from the folder as a server loads it, each chat prompt commits the random verifier's continuation in the
    recorded steps."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import trace_replay

    root = replayed[0]
    pool = {"verifier": {"model": "bundled:qwen2.5-coder-1.5b-instruct", "dtype": "auto"},
            "drafters": [{"name": "lookup", "type": "suffix", "arm": False},
                         {"name": "tree", "type": "pretrained_tree", "model": "bundled:qwen2.5-coder-0.5b-instruct",
                          "budgets": [8], "params": {"mode": "dynamic", "nodes": 8, "depth": 4, "width": 2}}],
            "policy": {"name": "ucb"}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    out = tmp_path / "served"
    assert trace_replay.main(["serve-prep", "--trace", str(root / "trace.json"), "--pool", str(tmp_path / "pool.yaml"),
                              "--verifier-shape", "tiny", "--drafter-shape", "tiny", "--device", "cpu",
                              "--dtype", "fp32", "--out", str(out)]) == 0
    served = yaml.safe_load((out / "pool.yaml").read_text())
    assert [d["name"] for d in served["drafters"]] == ["tree"]  # the entry that is no arm is replayed by the trace
    assert served["drafters"][0]["type"] == TYPE and served["drafters"][0]["budgets"] == [8]
    assert served["verifier"]["model"] == str(out / "verifier") and served["policy"] == pool["policy"]
    questions = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    replay = json.loads((out / "replay.json").read_text())["prompts"]
    assert [q["meta"]["max_tokens"] for q in questions] == [N, N] and len(replay) == 2
    engine = load_pool(out / "pool.yaml")  # from the folder: its own word-level tokenizer
    from transformers import AutoConfig, GenerationConfig

    for name in ("verifier", "drafter"):  # transformers serve stops where metasd does: at the tokenizer's EOS
        assert AutoConfig.from_pretrained(out / name).eos_token_id == engine.tokenizer.eos_token_id is not None
        assert GenerationConfig.from_pretrained(out / name).eos_token_id == engine.tokenizer.eos_token_id
    for q, r in zip(questions, replay):
        ids = engine.encode([{"role": "user", "content": q["turns"][0]}])
        assert ids == r["prompt_ids"]  # the chat text tokenizes to exactly the replay's ids
        result = engine.generate(ids, max_new_tokens=q["meta"]["max_tokens"])
        assert result.token_ids == r["continuation"][:N] and result.stats.drafted > 0
    # served over HTTP as benchmarks/serve_load.py sends it: chat text, each question's own max_tokens (its meta)
    pytest.importorskip("fastapi")
    import argparse
    import asyncio

    import serve_load
    from metasd.core.batching.scheduler import Scheduler
    from metasd.data import load_questions
    from metasd.serve.app import create_app
    from serve_helpers import ServerThread

    alone = [engine.generate(r["prompt_ids"], max_new_tokens=N).stats.tokens_per_step for r in replay]
    scheduler = Scheduler(engine, max_batch=4)
    getattr(scheduler, "start", lambda: None)()
    args = argparse.Namespace(max_tokens=3, temperature=0.0, level_timeout=60)  # 3: overridden by each question's
    try:
        with ServerThread(create_app(scheduler, "trace")) as srv:
            sent = load_questions(out / "questions.jsonl")
            records, _, timed_out = asyncio.run(serve_load.run_level(srv.url, "trace", sent, 2, 2, args, None))
    finally:
        scheduler.close()
    assert not timed_out and all(r["ok"] for r in records), records
    assert [r["completion_tokens"] for r in records] == [N, N]
    assert [r["metasd"]["tokens_per_step"] for r in records] == alone  # side by side, the steps each takes alone
